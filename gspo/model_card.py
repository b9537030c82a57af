"""The model card: a README.md written beside saved weights, saying how they were made.

No hub is involved: the card is a plain file in the model folder (Hugging Face's layout, so a later
upload shows it). It holds what a reader needs to trust or reproduce the weights: the base model,
the run's kind and objective, the data (files with their row counts and SHA-256, or the built-in
task), the reward functions, held-out scores before and after, the last step's metrics, and the
whole config as the run saved it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

CARD_FILE = "README.md"

# The held-out metrics in the card's results table, in this order (others follow, sorted).
_EVAL_FIRST = ("eval/accuracy", "eval/reward", "eval/mean_at_k", "eval/pass_at_k", "eval/sampled_reward")


def _value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _results(evals: dict) -> list[str]:
    """A markdown table of the first and last evaluation: metric | step a | step b."""
    if not evals:
        return ["No held-out evaluation ran (eval_num_prompts: 0, or nothing held out)."]
    steps = sorted({min(evals), max(evals)})
    keys = [k for k in _EVAL_FIRST if k in evals[steps[-1]]]
    keys += sorted(k for k in evals[steps[-1]] if k not in keys)
    head = "| held-out metric | " + " | ".join(f"step {s}" + (" (before training)" if s == 0 else "")
                                             for s in steps) + " |"
    rows = [head, "|---" * (len(steps) + 1) + "|"]
    rows += [f"| {k} | " + " | ".join(_value(evals[s].get(k, "")) for s in steps) + " |" for k in keys]
    return rows


def _data(config: dict, data: dict) -> list[str]:
    lines = []
    if config.get("tasks"):
        lines.append("Tasks: " + ", ".join(str(t.get("name") or t.get("task") or t.get("dataset"))
                                            for t in config["tasks"]))
    elif config.get("dataset"):
        lines.append(f"Dataset: `{config['dataset']}`" + (f", held-out `{config['eval_dataset']}`"
                                                           if config.get("eval_dataset") else ""))
    elif config.get("task"):
        lines.append(f"Built-in task: `{config['task']}` (generated, seed {config.get('seed')})")
    for key in ("train_rows", "held_out_rows"):
        if key in data:
            lines.append(f"{key.replace('_', ' ').capitalize()}: {data[key]}")
    for path, fingerprint in (data.get("files") or {}).items():
        lines.append(f"`{path}`: {fingerprint.get('rows')} rows, sha256 {fingerprint.get('sha256')}")
    weights = config.get("reward_weights")
    rewards = [str(f) + (f" (weight {weights[i]})" if weights else "")
               for i, f in enumerate(config.get("reward_funcs") or [])]
    if rewards:
        lines.append("Rewards: " + ", ".join(rewards))
    return [f"- {line}" for line in lines]


def model_card(config: dict, *, kind: str, evals: dict | None = None, metrics: dict | None = None,
               data: dict | None = None, adapter: bool = False, version: str = "") -> str:
    """The card's text. `config`: the run's config as JSON values (TrainConfig: `saved_config`); `kind`: "rl" or
    "sft"; `evals`: {step: held-out metrics}; `metrics`: the last step's; `data`: {"train_rows", "held_out_rows",
    "files": {path: data_fingerprint}}; `adapter`: the folder holds LoRA adapters (PEFT's layout), not a model."""
    evals, metrics, data = evals or {}, metrics or {}, data or {}
    base = str(config.get("model", ""))
    what = (f"{str(config.get('objective', '')).upper()} reinforcement learning, {config.get('max_steps')} steps of "
            f"{config.get('per_device_batch_size')} prompts x {config.get('num_generations')} completions"
            if kind == "rl" else f"supervised fine-tuning, {config.get('max_steps')} steps")
    tags = dict.fromkeys(["gspo", kind, *([str(config.get("objective"))] if kind == "rl" else [])])
    meta = ["---", f"library_name: {'peft' if adapter else 'transformers'}", f"tags: [{', '.join(tags)}]"]
    if "/" in base and not os.path.exists(base):  # a hub name (org/name): the card links the model it came from
        meta.append(f"base_model: {base}")
    meta.append("---")
    if adapter:
        load = ["from peft import AutoPeftModelForCausalLM", "from transformers import AutoTokenizer", "",
                "folder = \".\"  # this folder",
                f"model = AutoPeftModelForCausalLM.from_pretrained(folder)  # base: {base}"]
    else:
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "", "folder = \".\"  # this folder",
                "model = AutoModelForCausalLM.from_pretrained(folder)"]
    load += ["tokenizer = AutoTokenizer.from_pretrained(folder)"]
    lines = [*meta, "", f"# {base or 'model'}, trained with gspo", "",
             f"{'LoRA adapters' if adapter else 'Weights'} from `{base}` after {what}, written by gspo {version} "
             f"on {time.strftime('%Y-%m-%d %H:%M %Z')}.", "", "## Use", "", "```python", *load, "```", "",
             "## Data", "", *_data(config, data), "", "## Results", "", *_results(evals)]
    if metrics:
        lines += ["", f"<details><summary>The last step's metrics ({len(metrics)})</summary>", "",
                  "| metric | value |", "|---|---|", *[f"| {k} | {_value(v)} |" for k, v in sorted(metrics.items())],
                  "", "</details>"]
    lines += ["", "## Config", "", "The run's settings as it saved them (`gspo train --config` reads this form back).",
              "", "```json", json.dumps(config, indent=2, sort_keys=True, default=str), "```", ""]
    return "\n".join(lines)


def write_model_card(folder: Path, config: dict, **details) -> Path:
    """Write `model_card(config, **details)` as folder/README.md; returns its path."""
    from gspo.version import __version__

    path = Path(folder) / CARD_FILE
    path.write_text(model_card(config, version=__version__, **details), encoding="utf-8")
    return path
