"""Objects handed to the trainer from Python (`gspo.Trainer`): how a config names them.

A model object, an in-memory dataset, a reward instance or lambda cannot be written to
train_config.json. The config records each by a readable name behind the `object:` prefix
("object:train_dataset", "object:my_rewards:Judge(...)"); resuming from Python with the same
objects passed again matches those names, and whatever meets such a name without its object (the
CLI reading a saved config) refuses it in one line instead of loading something else.
"""

from __future__ import annotations

PREFIX = "object:"


def marker(name: str) -> str:
    """The config value naming an object handed over from Python: "object:<name>"."""
    return PREFIX + name


def is_marker(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def not_rebuildable(what: str, value: str, again: str) -> ValueError:
    """The error for a config that names a Python object (`what` `value`) nobody handed over this time;
    `again`: how to hand it over or replace it."""
    return ValueError(f"{what} {value!r} was a Python object given to the trainer, which a saved config cannot "
                      f"rebuild: {again}")
