"""Helpers shared by the test modules: tiny models and runs, `gspo` in a process of its own, run outputs.

Test modules import them as `from conftest import ...`: pytest's default ("prepend") import mode puts
tests/ on sys.path (there is no tests/__init__.py), and this module is registered as `conftest`, so the
import gets this very module rather than a second copy.
"""

import contextlib
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import torch
from hypothesis import settings

from gspo.config import TrainConfig, make_config
from gspo.models import load_model
from gspo.tracking import read_jsonl

ROOT = Path(__file__).resolve().parents[1]

# Property tests draw the same examples on every run (randomness in a test is seeded);
# HYPOTHESIS_PROFILE=default explores new ones.
settings.register_profile("seeded", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))

# ------------------------------------------------------------------------------- skips CI sees
# A test that skips is only a count in pytest's summary: on a machine without a cgroup, tmpfs or seccomp its
# check silently never runs. `make test` runs with -rs (every skip listed with its reason), and where CI is set
# (CI=true, as CI runs .ci/run) a skip whose reason matches no line of tests/skips_allowed.txt fails the run.
SKIPS_ALLOWED = ROOT / "tests" / "skips_allowed.txt"


def allowed_skips(path: Path = SKIPS_ALLOWED) -> list:
    """The allowlist's patterns (regular expressions searched in a skip's reason); a line is
    `<pattern>  # <why it may skip>`, blank lines and lines starting with # are left out."""
    import re

    patterns = []
    for line in path.read_text().splitlines():
        pattern = line.split("  # ", 1)[0].strip()
        if pattern and not line.lstrip().startswith("#"):
            patterns.append(re.compile(pattern))
    return patterns


def unlisted_skips(reports, patterns) -> list[str]:
    """"nodeid: reason" of each skipped test report whose reason no pattern matches."""
    out = []
    for report in reports:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(p.search(reason) for p in patterns):
            out.append(f"{report.nodeid}: {reason}")
    return out


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    unlisted = unlisted_skips(skipped, allowed_skips())
    if unlisted:
        print(f"\nCI: {len(unlisted)} skip(s) whose reason is not in tests/skips_allowed.txt (add it there with why "
              "it may skip, or make the test run here):", file=sys.stderr)
        for line in unlisted:
            print(f"  {line}", file=sys.stderr)
        session.exitstatus = 1


# ------------------------------------------------------------------------------- tiny models
# Overrides of the tiny-dense / tiny-moe presets for in-process training: 2 decoder layers, width 64.
SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32}
SMALL_MOE = {"num_hidden_layers": 2, "hidden_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 32}  # 8 experts, top-2 (the preset's)
# The smallest tiny-dense that still trains: runs of the `gspo` command, where start-up dominates.
TINY_MODEL = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16}


def qwen3(vocab_size: int, *, seed: int = 0, moe: bool = False, **config):
    """A randomly initialised Qwen3 (moe=False) or Qwen3-MoE causal LM from config, built after
    torch.manual_seed(seed): the same seed gives the same weights. In training mode, as built."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    torch.manual_seed(seed)
    return model_cls(config_cls(vocab_size=vocab_size, **config))


def perturb_routers(model, seed: int = 1, std: float = 1.0) -> None:
    """Large random router weights: what a (big) training step could do; free routing then picks
    clearly different experts."""
    from gspo.plugs.moe import find_routers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in find_routers(model):
            r.module.weight.copy_(torch.randn(r.module.weight.shape, generator=g) * std)


def no_hooks(model) -> bool:
    """No gspo hook is left on any module (transformers may install its own capture hooks)."""
    return not any(getattr(hook, "__module__", "").startswith("gspo")
                   for m in model.modules() for hooks in (m._forward_hooks, m._forward_pre_hooks)
                   for hook in hooks.values())


# ------------------------------------------------------------------------------- tiny runs
def starts_with_digit(prompts, completions, **_):
    """A reward a random model earns now and then (10 of its 81 tokens are digits): spread within groups."""
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def random_record(model, ids, seed: int = 3):
    """A RoutingRecord of experts drawn at random (not the routers' own choice) for every token of `ids`
    (N, L), each token's k distinct: a replay that visibly changes the forward."""
    from gspo.plugs.moe import RoutingRecord, find_routers

    routers = find_routers(model)
    E, k = routers[0].module.num_experts, routers[0].module.top_k
    g = torch.Generator().manual_seed(seed)
    draws = torch.rand(len(routers), *ids.shape, E, generator=g).argsort(-1)[..., :k]  # (R, N, L, k)
    return RoutingRecord(draws, tuple(r.layer for r in routers))


def tiny_cfg(tmp_path, **kw) -> TrainConfig:
    """A TrainConfig for a few in-process steps of tiny-dense (SMALL) on add3, written to tmp_path/run."""
    base = dict(model="tiny-dense", model_overrides=SMALL, task="add3", max_steps=3, per_device_batch_size=2,
                num_generations=4, num_minibatches=2, max_completion_length=12, learning_rate=1e-3,
                eval_num_prompts=4, eval_k=2, progress=False, output_dir=str(tmp_path / "run"), log_samples_steps=1,
                device="cpu")
    return make_config(TrainConfig, {**base, **kw})


# A config file's worth of settings for `gspo train` runs (TINY_MODEL, two of everything).
TINY_RUN = {"model": "tiny-dense", "model_overrides": TINY_MODEL, "per_device_batch_size": 2, "num_generations": 2,
            "num_minibatches": 2, "max_completion_length": 6, "eval_num_prompts": 2, "eval_k": 2, "progress": False,
            "device": "cpu"}


@contextlib.contextmanager
def gspo_serving(cfg):
    """`gspo serve` of `cfg` on a free loopback port, on a thread of its own: the listening Server; stopped after."""
    from gspo.apps.serve import serve

    ready, stop = [], threading.Event()
    thread = threading.Thread(target=serve, args=(cfg, "127.0.0.1", 0), kwargs={"ready": ready.append, "stop": stop})
    thread.start()
    try:
        while not ready and thread.is_alive():
            thread.join(0.05)
        assert ready, "gspo serve ended before it listened"
        yield ready[0]
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "gspo serve did not stop"


# ------------------------------------------------------------------------------- `gspo` in a process
def gspo_env(*paths, **extra: str) -> dict:
    """The environment of a `gspo` process: offline, one thread, this checkout's gspo ahead of any installed
    copy, and `paths` (folders of reward modules, say) importable; `extra` variables on top."""
    python_path = [*map(str, paths), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in python_path if p), **extra}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now (for a rollout_address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gspo_argv(*args, nproc: int = 1) -> list[str]:
    """argv of `gspo <args>`; under torchrun (--standalone, gloo on CPU) with nproc > 1."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, "-m", "gspo", *map(str, args)]


def run_gspo(*args, cwd, paths=(), nproc: int = 1, timeout: float = 300, env: dict | None = None,
             **kwargs) -> subprocess.CompletedProcess:
    """Run `gspo <args>` to its end in `cwd`; text output captured. `env` replaces gspo_env(*paths)."""
    return subprocess.run(gspo_argv(*args, nproc=nproc), cwd=cwd, env=env or gspo_env(*paths), capture_output=True,
                          text=True, timeout=timeout, **kwargs)


# ------------------------------------------------------------------------------- what a run wrote
TIMINGS = ("time/", "throughput/")  # the only metrics two runs of the same computation may disagree on


def read_metrics(run_dir) -> list[dict]:
    """The records of run_dir/metrics.jsonl (null read as NaN)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def logged_steps(run_dir) -> list[int]:
    """The step of every metrics line, in file order; [] while there is no metrics file."""
    path = Path(run_dir) / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)] if path.exists() else []


def comparable(run_dir) -> list[dict]:
    """The metrics lines without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in read_metrics(run_dir)]


def final_weights(run_dir) -> dict:
    """The state dict of the model a run saved (run_dir/model), loaded as a user would: MoE experts
    come back fused as in memory, so it compares key by key with initial_weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(run_dir) / "model").state_dict()


def saved_tensors(run_dir) -> dict:
    """The tensors of run_dir/model/model.safetensors as written: MoE experts one by one, a tied head once."""
    from safetensors.torch import load_file

    return load_file(Path(run_dir) / "model" / "model.safetensors")


def initial_weights(cfg) -> dict:
    """The state dict a run of `cfg` starts from (a preset, built with cfg.seed and cfg.model_overrides)."""
    model, _ = load_model(cfg.model, seed=cfg.seed, overrides=cfg.model_overrides)
    return model.state_dict()


def changed(before: dict, after: dict) -> list[str]:
    """The names of the tensors in `after` that differ from `before` in any bit."""
    return [name for name, tensor in after.items() if not torch.equal(tensor, before[name])]


# ------------------------------------------------------------------------------- a tiny reward model
def answer_pairs(split: str, n: int, seed: int, *, one_digit: bool = False) -> list[dict]:
    """`n` add3 problems of `split` as {"prompt", "answer", "correct", "wrong"} completions.

    `correct` is the task's worked solution, ending in "#### <answer>" (answer_match: 1.0); `wrong` is
    the same text with another answer (answer_match: 0.0). By default that is the answer of another
    random add3 problem, so a wrong answer is as plausible on its own as the right one and only its
    agreement with the prompt and the worked steps tells them apart; `one_digit` changes one digit of
    the right answer instead (a near miss). The same split and seed give the same pairs (fewer: a prefix).
    """
    import random

    from gspo.tasks import get_task

    task = get_task("add3")
    rng = random.Random(f"answer_pairs:{split}:{seed}:{one_digit}")  # n rows: a prefix of n + 1
    pairs = []
    for row in task.dataset(split, n, seed=seed):
        answer = row["answer"]
        stem = row["solution"].removesuffix(answer)  # "7+5=12;...;#### "
        wrong = answer
        while wrong == answer:
            if one_digit:
                i = rng.randrange(len(answer))
                wrong = answer[:i] + rng.choice("123456789" if i == 0 else "0123456789") + answer[i + 1:]
            else:
                wrong = task.sample(rng)["answer"]
        pairs.append({"prompt": row["prompt"], "answer": answer, "correct": row["solution"], "wrong": stem + wrong})
    return pairs


def _reward_scores(model, tokenizer, prompts: list[str], completions: list[str]):
    """logits[:, 0] of prompt + completion, right-padded as RewardModelReward pads: (n,), with grad."""
    enc = tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True,
                    padding_side="right")
    return model(**enc).logits[:, 0]  # (n,)


def _margins(model, tokenizer, pairs: list[dict]):
    """r(x, y_correct) - r(x, y_wrong) per pair: (n,), with grad."""
    prompts = [p["prompt"] for p in pairs]
    r = _reward_scores(model, tokenizer, prompts + prompts,
                       [p["correct"] for p in pairs] + [p["wrong"] for p in pairs])  # (2n,)
    return r[: len(pairs)] - r[len(pairs):]  # (n,)


def _bradley_terry(margins):
    """-log sigmoid(r_correct - r_wrong) per pair: ln 2 where the two scores tie."""
    return -torch.nn.functional.logsigmoid(margins)


def train_tiny_reward_model(path, steps: int = 300, seed: int = 0, *, batch_pairs: int = 16,
                            lr: float = 3e-4) -> dict:
    """Train a tiny Qwen3ForSequenceClassification reward model on add3 and save it (and its tokenizer) to
    `path`, where `get_reward_fn("rm:<path>")` loads it. Seeded: the same arguments save the same weights.

    The model (2 layers, width 64, 4 heads, MLP 256: 136,704 parameters) reads the character tokenizer of the
    tiny-dense preset, so prompts and completions tokenize as in training. Each of `steps` Adam steps
    takes `batch_pairs` fresh train-split answer_pairs and descends the Bradley-Terry loss
    -log sigmoid(r(x, y_correct) - r(x, y_wrong)); steps=0 saves the untrained model (a random RM).
    About 10 s on one CPU thread at the default 300 steps.

    Returns {"train_loss": mean loss of the last 20 steps (NaN without steps), "eval_loss": mean loss
    on 256 held-out test-split pairs (ln 2 = 0.693 when every score ties), "accuracy": the fraction of
    those pairs the model ranks correctly, "one_digit_accuracy": the same on one-digit near misses}.
    """
    import math

    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from gspo.tasks import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=512,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    train = answer_pairs("train", steps * batch_pairs, seed)
    with torch.random.fork_rng(devices=[]):  # the caller's random stream does not move
        torch.manual_seed(seed)
        model = Qwen3ForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = max(1, steps // 20)  # Adam's first steps are its largest: ramp the rate up over 5% of the steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    losses = []
    for step in range(steps):
        loss = _bradley_terry(_margins(model, tokenizer, train[step * batch_pairs:(step + 1) * batch_pairs])).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())

    model.eval()
    with torch.no_grad():
        held_out = _margins(model, tokenizer, answer_pairs("test", 256, seed))  # (256,)
        near_miss = _margins(model, tokenizer, answer_pairs("test", 256, seed, one_digit=True))  # (256,)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return {"train_loss": sum(losses[-20:]) / len(losses[-20:]) if losses else math.nan,
            "eval_loss": _bradley_terry(held_out).mean().item(),
            "accuracy": (held_out > 0).float().mean().item(),
            "one_digit_accuracy": (near_miss > 0).float().mean().item()}
