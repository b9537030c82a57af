"""`gspo demo --tools`: the demo's tiny model learns to use a calculator tool on 4-digit addition, beside the same
model answering without it.

Both start from the tiny-dense model at random init. A short cold start by SFT on a few demonstrations: with
the tool, an episode "1234+5678=" -> "calc(1234+5678)" <eos>, the tool's "\nresult: 6912\n", -> "6912" <eos>
(the tool's tokens never trained: the labels mask them, as RL's completion mask does); without it, the answer
alone. Then GSPO on multi-turn episodes (environment: tools, the text call style) or on single answers, the
same reward: the final answer's last number against the row's answer.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import torch

# A partial cold start, on purpose: with the tool, SFT stops once greedy accuracy on 50 held-out problems reaches
# target_accuracy (checked every 10 steps), so what GSPO adds is measured; without it, the same number of steps.
TOOL_SFT = dict(max_steps=400, batch_size=32, learning_rate=2e-3, examples=1000, target_accuracy=0.4,
                check_every=10, check_prompts=50)
TOOL_RL = dict(task="add4", max_steps=40, per_device_batch_size=16, num_generations=8, num_minibatches=4,
               learning_rate=1e-4, warmup_steps=4, objective="gspo", eval_num_prompts=200, eval_batch_size=200,
               eval_k=4, eval_steps=20, log_samples_steps=10, seeded_sampling=True,
               reward_funcs=["gspo.apps.demo_tools:final_answer"])
WITH_TOOL = dict(environment="tools", tools=["gspo.apps.demo_tools:calc"], tool_call_style="text", max_turns=2,
                 max_episode_tokens=48, max_completion_length=20)
WITHOUT_TOOL = dict(max_completion_length=8)

_EXPRESSION = re.compile(r"^\s*(\d{1,12})\s*([+\-*])\s*(\d{1,12})\s*$")
_NUMBER = re.compile(r"-?\d+")


def calc(expression: str) -> str:
    """The demo's calculator: "a+b", "a-b" or "a*b" of non-negative integers."""
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError("expected a+b, a-b or a*b of integers")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def final_answer(prompts: list[str], completions: list[str], answer: list, final_turn: list | None = None,
                 **_) -> list[float]:
    """1.0 where the last number of the model's final answer (an episode's last turn; else the completion)
    equals the row's answer: a number only the observation shows does not count."""
    texts = final_turn if final_turn is not None else completions
    out = []
    for text, expected in zip(texts, answer, strict=True):
        found = _NUMBER.findall(text)
        out.append(float(bool(found) and found[-1] == str(expected).strip()))
    return out


def demonstration(tokenizer, row: dict, with_tool: bool) -> tuple[list[int], list[int]]:
    """(token ids, labels: -100 where not trained) of one demonstration episode of `row`."""
    from gspo.env import OBSERVATIONS

    eos = tokenizer.eos_token_id

    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    prompt = tokenizer(row["prompt"])["input_ids"]
    ids, labels = list(prompt), [-100] * len(prompt)
    if with_tool:
        call = text(f"calc({row['prompt'].rstrip('=')})") + [eos]
        seen = text(OBSERVATIONS["text"].format(text=calc(row["prompt"].rstrip("="))))
        ids, labels = ids + call + seen, labels + call + [-100] * len(seen)
    answer = text(str(row["answer"])) + [eos]
    return ids + answer, labels + answer


def cold_start(out: Path, seed: int, with_tool: bool, steps: int | None = None) -> tuple[str, dict]:
    """SFT of the tiny model on TOOL_SFT["examples"] demonstrations, `steps` of them (None: until the target
    accuracy); its saved folder and a summary."""
    from gspo.config import (
        EpisodeSettings,
        EvalSettings,
        RewardSettings,
        SamplingSettings,
        TrainConfig,
        make_config,
        section,
    )
    from gspo.data.evaluation import Evaluation, evaluate
    from gspo.models import load_model
    from gspo.plugs.supervised import labelled_nll
    from gspo.rollout.batch import pad_id
    from gspo.tasks import get_task

    torch.manual_seed(seed)
    model, tokenizer = load_model("tiny-dense", seed=seed)
    rows = get_task("add4").dataset("train", TOOL_SFT["examples"], seed=seed + 100)  # not the RL run's rows
    checks = get_task("add4").dataset("test", TOOL_SFT["check_prompts"], seed=seed + 100)
    rl = make_config(TrainConfig, {**TOOL_RL, **(WITH_TOOL if with_tool else WITHOUT_TOOL), "model": "tiny-dense",
                                   "output_dir": str(out)})  # evaluated as the RL run will evaluate
    plan = Evaluation.of(section(rl, EvalSettings), section(rl, RewardSettings), section(rl, SamplingSettings),
                         seed=rl.seed, template_kwargs=rl.chat_template_kwargs, episodes=section(rl, EpisodeSettings))
    demos = [demonstration(tokenizer, row, with_tool) for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=TOOL_SFT["learning_rate"])
    rng, pad, t0, accuracy = random.Random(seed), pad_id(tokenizer, model), time.perf_counter(), None
    model.train()
    for step in range(1, (steps or TOOL_SFT["max_steps"]) + 1):
        batch = [demos[rng.randrange(len(demos))] for _ in range(TOOL_SFT["batch_size"])]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])  # (b, L)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])  # (b, L)
        mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in batch])[:, None]).long()  # (b, L)
        loss = labelled_nll(model, ids, mask, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if steps is None and step % TOOL_SFT["check_every"] == 0:
            accuracy = evaluate(model, tokenizer, checks, plan, sampled=False)["eval/accuracy"]
            model.train()
            if accuracy >= TOOL_SFT["target_accuracy"]:
                break
    folder = out / "sft" / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder), {"sft_steps": step, "sft_loss": round(loss.item(), 4), "sft_check_accuracy": accuracy,
                         "sft_seconds": round(time.perf_counter() - t0, 1)}


def run_tool_demo(output_dir: str = "runs/demo-tools", seed: int = 0) -> dict:
    """Cold start, then GSPO, with the calculator tool and without it; prints and returns the comparison."""
    from gspo.config import TrainConfig, make_config
    from gspo.trainer import train

    started, out, results, steps = time.perf_counter(), Path(output_dir), {}, None
    for name, extra in (("tool", WITH_TOOL), ("no_tool", WITHOUT_TOOL)):
        folder = out / name
        print(f"[{name}] cold start on {TOOL_SFT['examples']} demonstrations: "
              + (f"{steps} SFT steps, as with the tool" if steps else
                 f"SFT until greedy accuracy >= {TOOL_SFT['target_accuracy']:.0%}"))
        model_dir, cold = cold_start(folder, seed, with_tool=name == "tool", steps=steps)
        steps = cold["sft_steps"]
        print(f"[{name}] GSPO, {TOOL_RL['max_steps']} steps")
        cfg = make_config(TrainConfig, {**TOOL_RL, **extra, "seed": seed, "model": model_dir,
                                        "output_dir": str(folder / "rl"), "overwrite_output_dir": True})
        rl = train(cfg)
        before, after = rl["evals"][0], rl["evals"][max(rl["evals"])]
        results[name] = {**cold, "before": before, "after": after, "rl_seconds": round(rl["seconds"], 1)}
    summary = {"seed": seed, "task": "add4", **results, "seconds": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nheld-out 4-digit addition ({TOOL_RL['eval_num_prompts']} problems never trained on), seed {seed}")
    print(f"  {'':34}{'cold start':>12}{'after GSPO':>12}")
    for name in results:
        b, a = results[name]["before"], results[name]["after"]
        print(f"  {name + ': greedy accuracy':34}{b['eval/accuracy']:>12.1%}{a['eval/accuracy']:>12.1%}")
        if "eval/tool_call_rate" in a:
            print(f"  {name + ': tool-call rate (greedy)':34}{b['eval/tool_call_rate']:>12.1%}"
                  f"{a['eval/tool_call_rate']:>12.1%}")
    print(f"time: {summary['seconds']:.0f} s   summary: {out / 'summary.json'}")
    return summary
