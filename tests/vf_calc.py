"""A verifiers (0.4.0, v1) taskset with a tool for tests/test_environments.py: the model may call calc (an MCP
tool server verifiers starts as `python -m vf_calc`), then answers."""

import verifiers.v1 as vf

from vf_qa import QAData


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool's own name, calc

    @vf.tool
    def calc(self, expression: str) -> str:
        """a+b of two integers."""
        a, b = expression.split("+")
        return str(int(a) + int(b))


class CalcTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalcTask(vf.Task[QAData, vf.State, CalcTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalcTaskConfig) -> list:
        return [CalcToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class CalcTasksetConfig(vf.TasksetConfig):
    task: CalcTaskConfig = CalcTaskConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcTasksetConfig]):
    def load(self):
        yield CalcTask(QAData(prompt="3+4=", answer="7"), self.config.task)


__all__ = ["CalcTaskset"]

if __name__ == "__main__":  # how verifiers starts the tool server
    CalcToolset.run()
