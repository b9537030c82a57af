"""Callbacks: user code the training loop calls after every step (`gspo.Trainer(callbacks=[...])`).

A callback is an object with an `on_step_end(step, metrics)` method, or a function `f(step, metrics)`
taken as that method. `metrics` is a copy of the step's line of metrics.jsonl (`reward/mean`,
`loss/policy`, `kl/approx`, ...; `eval/*` on evaluation steps). A callback that returns `STOP` ("stop")
makes this step the last one, as max_steps would: the run evaluates (after the callbacks, where this step
had no evaluation yet), saves a checkpoint and the model, and returns its summary. Under torchrun every
rank calls its callbacks (one rank's "stop" stops all). No callbacks: `Callbacks()` does nothing.
"""

from __future__ import annotations

STOP = "stop"


class Callbacks:
    """The loop's plug for user callbacks: each called at the end of every step, in the order given."""

    def __init__(self, callbacks=()):
        self.hooks = []
        for i, callback in enumerate(callbacks):
            hook = getattr(callback, "on_step_end", callback)
            if not callable(hook):
                raise ValueError(f"callbacks[{i}]={callback!r} has no on_step_end(step, metrics) method and is not "
                                 "a function")
            self.hooks.append(hook)

    def on_step_end(self, step: int, metrics: dict) -> bool:
        """Call every callback (each with its own copy of `metrics`); True if one of them returned "stop"."""
        answers = [hook(step, dict(metrics)) for hook in self.hooks]
        return any(isinstance(answer, str) and answer == STOP for answer in answers)
