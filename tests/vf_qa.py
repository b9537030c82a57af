"""A verifiers (0.4.0, v1) taskset for tests/test_environments.py: one answer, scored against the row's."""

import verifiers.v1 as vf


class QAData(vf.TaskData):
    answer: str


class QATask(vf.Task[QAData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class QATaskset(vf.Taskset[QATask, vf.TasksetConfig]):
    def load(self):
        yield QATask(QAData(prompt="3+4=", answer="7"), self.config.task)


__all__ = ["QATaskset"]
