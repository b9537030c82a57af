"""The environment of configs/tools_env.yaml: your own environment class, running a tool, named in the config as
`examples/tools_env/calculator_env.py:CalculatorEnv` (a file path and a class; a module on the import path works
too: `my_package.envs:MyEnv`).

An environment is any object with `reset(row) -> str` and `step(model_turn) -> gspo.env.Turn` (no base class);
the run makes one per episode by calling the class. This one lends the model a calculator: a turn that calls it
(a line `calc(1234+5678)`, the text call style) is answered with the result, `\\nresult: 6912\\n`, which the model
reads and is never trained on; the first turn without a call is the answer, and the environment scores it itself
(1.0 when its last number is the row's answer), so the config's reward is `environment`, the sum of the rewards
the episode's steps gave. `gspo.env.Toolbox` parses and runs the calls: a malformed call, an unknown tool or one
that raises is an error message the model reads, counted in `episode/tool_errors`.

It speaks the format that `gspo demo --tools` teaches in its cold start (docs/episodes.md, "The tool demo").
"""

import re

from gspo.apps.demo_tools import calc  # the tool: a plain function, type hints on its arguments
from gspo.env import OBSERVATIONS, Toolbox, Turn

RESULT_HEAD, RESULT_TAIL = OBSERVATIONS["text"].split("{text}")  # "\nresult: ", "\n": markup, kept as written


class CalculatorEnv:
    """An episode of one addition problem (a row with `prompt` and `answer`): calculator calls answered, the
    answer scored."""

    def __init__(self):
        self.toolbox = Toolbox([calc], style="text", timeout_s=1.0, max_output_chars=100)
        self.answer = ""

    def reset(self, row: dict) -> str:
        self.answer = str(row["answer"]).strip()
        return row["prompt"]

    def step(self, model_turn: str) -> Turn:
        results = self.toolbox.run(model_turn)
        if not results:  # no call: this turn is the answer
            numbers = re.findall(r"-?\d+", model_turn)
            return Turn(reward=float(bool(numbers) and numbers[-1] == self.answer), done=True)
        observation = [RESULT_HEAD]  # [markup, data, markup, ...]: the results are data (never control tokens)
        for result in results:
            observation += [result.text, RESULT_TAIL + RESULT_HEAD]
        info = {"tool_calls": len(results), "tool_errors": sum(r.error is not None for r in results)}
        return Turn(observation=observation[:-1] + [RESULT_TAIL], reward=0.0, info=info)
