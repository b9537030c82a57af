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
from functools import partial
from pathlib import Path

import torch

# A partial cold start, on purpose: with the tool, SFT stops once greedy accuracy on 50 held-out problems reaches
# target_accuracy (checked every 10 steps), so what GSPO adds is measured; without it, the same number of steps.
TOOL_SFT = dict(max_steps=400, batch_size=32, learning_rate=2e-3, examples=1000, target_accuracy=0.4,
                check_every=10, check_prompts=50, say_every=50)
TOOL_RL = dict(task="add4", max_steps=40, per_device_batch_size=16, num_generations=8, num_minibatches=4,
               learning_rate=1e-4, warmup_steps=4, objective="gspo", eval_num_prompts=200, eval_batch_size=200,
               eval_k=4, eval_steps=20, log_samples_steps=10, seeded_sampling=True,
               reward_funcs=["gspo.apps.demo_tools:final_answer"])
WITH_TOOL = dict(environment="tools", tools=["gspo.apps.demo_tools:calc"], tool_call_style="text", max_turns=2,
                 max_episode_tokens=48, max_completion_length=20)
WITHOUT_TOOL = dict(max_completion_length=8)
# `gspo demo --agent`: the same tool, through an agent written against the openai client (gspo/apps/demo_agent.py)
# on the run's endpoint; its reward is the agent's own (the same rule as final_answer)
WITH_AGENT = dict(agent="gspo.apps.demo_agent:agent", tool_call_style="text", agent_max_calls=2,
                  max_episode_tokens=48, max_completion_length=20, reward_funcs=["environment"])
VARIANTS = {"tool": WITH_TOOL, "no_tool": WITHOUT_TOOL, "agent": WITH_AGENT}
USES_TOOL = ("tool", "agent")  # cold-started on demonstrations with the tool
TOOL_DEMO = ("tool", "no_tool")  # `gspo demo --tools`, in this order: no_tool takes the SFT steps tool took

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


def cold_start(out: Path, seed: int, with_tool: bool, steps: int | None = None, say=print) -> tuple[str, dict]:
    """SFT of the tiny model on TOOL_SFT["examples"] demonstrations, `steps` of them (None: until the target
    accuracy); its saved folder and a summary (also in out/COLD_START_FILE, for --resume). `say` gets a line as
    each phase begins and every TOOL_SFT["say_every"] steps."""
    from gspo.apps.demo import COLD_START_FILE
    from gspo.data.evaluation import evaluate
    from gspo.models import load_model
    from gspo.rollout.batch import pad_id
    from gspo.tasks import get_task

    say(f"cold start: loading tiny-dense (random init), writing {TOOL_SFT['examples']} demonstrations")
    torch.manual_seed(seed)
    model, tokenizer = load_model("tiny-dense", seed=seed)
    rows = get_task("add4").dataset("train", TOOL_SFT["examples"], seed=seed + 100)  # not the RL run's rows
    checks = get_task("add4").dataset("test", TOOL_SFT["check_prompts"], seed=seed + 100)
    plan = check_plan(out, with_tool)
    demos = [demonstration(tokenizer, row, with_tool) for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=TOOL_SFT["learning_rate"])
    rng, pad, accuracy, target = random.Random(seed), pad_id(tokenizer, model), None, TOOL_SFT["target_accuracy"]
    t0 = time.perf_counter()  # sft_seconds: the steps and their checks
    say(f"cold start: SFT for {steps} steps" if steps else f"cold start: SFT until greedy accuracy on "
        f"{len(checks)} held-out problems >= {target:.0%} (checked every {TOOL_SFT['check_every']} steps)")
    model.train()
    for step in range(1, (steps or TOOL_SFT["max_steps"]) + 1):
        loss = sft_step(model, optimizer, [demos[rng.randrange(len(demos))] for _ in range(TOOL_SFT["batch_size"])],
                        pad)
        checked = steps is None and step % TOOL_SFT["check_every"] == 0
        if checked:
            accuracy = evaluate(model, tokenizer, checks, plan, sampled=False)["eval/accuracy"]
            model.train()
        done = checked and accuracy >= target
        if step % TOOL_SFT["say_every"] == 0 or done:
            say(f"cold start: step {step}, loss {loss:.3f}"
                + (f", greedy accuracy {accuracy:.0%} (target {target:.0%})" if accuracy is not None else ""))
        if done:
            break
    folder = out / "sft" / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    summary = {"sft_steps": step, "sft_loss": round(loss, 4), "sft_check_accuracy": accuracy,
               "sft_seconds": round(time.perf_counter() - t0, 1)}
    (out / COLD_START_FILE).write_text(json.dumps({**summary, "model_dir": str(folder)}, indent=2))
    say(f"cold start: done, {step} steps in {summary['sft_seconds']:.0f} s: {folder}")
    return str(folder), summary


def check_plan(out: Path, with_tool: bool):
    """How the cold start's checks evaluate: as the RL run will (gspo.data.evaluation.Evaluation)."""
    from gspo.config import (
        EpisodeSettings,
        EvalSettings,
        RewardSettings,
        SamplingSettings,
        TrainConfig,
        make_config,
        section,
    )
    from gspo.data.evaluation import Evaluation

    rl = make_config(TrainConfig, {**TOOL_RL, **(WITH_TOOL if with_tool else WITHOUT_TOOL), "model": "tiny-dense",
                                   "output_dir": str(out)})
    return Evaluation.of(section(rl, EvalSettings), section(rl, RewardSettings), section(rl, SamplingSettings),
                         seed=rl.seed, template_kwargs=rl.chat_template_kwargs, episodes=section(rl, EpisodeSettings))


def sft_step(model, optimizer, batch: list[tuple[list[int], list[int]]], pad: int) -> float:
    """One SFT step on demonstrations (token ids, labels), right-padded; its loss."""
    from gspo.plugs.supervised import labelled_nll

    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])  # (b, L)
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])  # (b, L)
    mask = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in batch])[:, None]).long()  # (b, L)
    loss = labelled_nll(model, ids, mask, labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def run_tool_demo(output_dir: str = "runs/demo-tools", seed: int = 0, resume: str | None = None,
                  variants: tuple[str, ...] = TOOL_DEMO) -> dict:
    """Cold start, then GSPO, with the calculator tool and without it (`variants`: ("agent",) for the agent's);
    prints and returns the comparison.

    `resume` (latest, latest_valid or a checkpoint folder of either run; `gspo demo --tools --resume`): continue a
    demo that stopped: each variant's finished cold start is kept and its RL run continues from its newest
    checkpoint (a folder: that one, for its own run), or starts; what had not started runs as usual.
    """
    from gspo.apps.demo import COLD_START_FILE, rl_resume, saved_cold_start
    from gspo.config import TrainConfig, make_config
    from gspo.trainer import train

    started, out, results, steps = time.perf_counter(), Path(output_dir), {}, None
    resumes = variant_resumes(out, resume, variants)  # a folder of none of the runs: refused before anything runs
    if resume is None:  # an earlier demo's cold starts are not this one's to resume after
        for name in variants:
            (out / name / COLD_START_FILE).unlink(missing_ok=True)
    for name in variants:
        extra = VARIANTS[name]
        folder, say = out / name, partial(print_line, f"[{name}]")
        earlier = saved_cold_start(folder) if resume is not None else None
        if earlier is None:
            model_dir, cold = cold_start(folder, seed, with_tool=name in USES_TOOL, steps=steps, say=say)
        else:
            model_dir, cold = earlier.pop("model_dir"), earlier
            say(f"cold start: done before ({cold['sft_steps']} steps, {model_dir})")
        steps = cold["sft_steps"]  # without the tool: as many SFT steps as with it
        again = rl_resume(folder / "rl", resumes[name]) if earlier is not None else None
        say(f"GSPO, {TOOL_RL['max_steps']} steps" + (f" (resumed: {again})" if again else ""))
        cfg = make_config(TrainConfig, {**TOOL_RL, **extra, "seed": seed, "model": model_dir, "output_dir":
                                        str(folder / "rl"), "overwrite_output_dir": True,
                                        "resume_from_checkpoint": again})
        rl = train(cfg)
        before, after = rl["evals"][0], rl["evals"][max(rl["evals"])]
        results[name] = {**cold, "before": before, "after": after, "rl_seconds": round(rl["seconds"], 1)}
    summary = {"seed": seed, "task": "add4", **results, "seconds": round(time.perf_counter() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_comparison(summary, out, variants)
    return summary


def variant_resumes(out: Path, resume: str | None, names: tuple[str, ...] = TOOL_DEMO) -> dict:
    """{variant: `resume` as its RL run takes it}: latest and latest_valid for all; a checkpoint folder for its own
    run, latest for the others (a ValueError where it is in none of the runs' folders)."""
    if resume in (None, "latest", "latest_valid"):
        return dict.fromkeys(names, resume)
    owner = [name for name in names if Path(resume).resolve().parent == (out / name / "rl").resolve()]
    if not owner:
        runs = ", ".join(str(out / name / "rl") for name in names)
        raise ValueError(f"--resume {resume}: not a checkpoint of this demo's runs ({runs}); give latest, "
                         "latest_valid or one of their checkpoint-<step> folders")
    return {name: resume if name in owner else "latest" for name in names}


def print_line(prefix: str, text: str) -> None:
    print(f"{prefix} {text}", flush=True)


def print_comparison(summary: dict, out: Path, variants: tuple[str, ...] = TOOL_DEMO) -> None:
    """The demo's table: held-out accuracy (and tool-call rate) before and after GSPO, with and without the tool."""
    print(f"\nheld-out 4-digit addition ({TOOL_RL['eval_num_prompts']} problems never trained on), seed "
          f"{summary['seed']}")
    print(f"  {'':34}{'cold start':>12}{'after GSPO':>12}")
    for name in variants:
        b, a = summary[name]["before"], summary[name]["after"]
        print(f"  {name + ': greedy accuracy':34}{b['eval/accuracy']:>12.1%}{a['eval/accuracy']:>12.1%}")
        if "eval/tool_call_rate" in a:
            print(f"  {name + ': tool-call rate (greedy)':34}{b['eval/tool_call_rate']:>12.1%}"
                  f"{a['eval/tool_call_rate']:>12.1%}")
    print(f"time: {summary['seconds']:.0f} s   summary: {out / 'summary.json'}")
