"""GSPO step throughput and learning: gspo's trainer against TRL's GRPOTrainer at equal settings.

    pip install '.[bench]'            # TRL is a benchmark-only dependency
    python benchmarks/vs_trl.py       # defaults: 3 repetitions per side, 20 RL steps each, CPU
    python benchmarks/vs_trl.py --model 50m --T 512 --B 2 --G 4 --M 2 --steps 4 --reps 2 --eval-prompts 1 --eval-k 1

    python benchmarks/vs_trl.py --model smollm2 --threads 1 --async 1 --steps 10   # the real model (make demo-real)

Both sides load the same saved model (`--model demo`: a cold start made by gspo's SFT; `50m`: the
~50M-parameter Qwen3 of utilisation.py, random init, whose completions stop anywhere from 2 to 512
tokens: a long-tailed length spread; both cached under --work-dir; `smollm2`: SmolLM2-135M-Instruct,
on `gspo demo --model smollm2`'s a+b problems with its `last_number` reward, float32 weights under
bf16 autocast where the CPU runs bf16 natively), the same tokenizer, the same prompts in the same
order, the same reward function (add3's `answer_match` for the first two) and the same GSPO settings;
unset flags take the model's PRESETS. The mapping of every setting is in `trl_args` and in
docs/benchmarks.md. Peak memory is each process's maximum resident set (getrusage). Runs alternate
gspo, TRL, gspo, TRL, ... each in a fresh subprocess; repetition i of both sides uses seed i.

`--baseline REV` adds a third side, gspo as of git revision REV (a worktree under --work-dir,
imported through PYTHONPATH), run in the same alternation: gspo, gspo@REV, TRL, ... so a library
change is measured before/after in one run, on the same machine state.

`--async K` adds the side gspo_async: gspo with one rollout worker process sampling K steps ahead
(`rollout_workers: 1, max_staleness: K`; the worker takes the trainer's thread count, so with
`--threads 1` the trainer and the worker each use one core), in the same alternation; pi_old is
recomputed by the trainer (decoupled). `--mu-as-pi-old` adds a further side, gspo_async_mu: the same
worker, the sampler's log-probs (mu) as pi_old (`use_sampler_logprobs`), no pi_old forward.

Timed region: one RL step = one rollout of B*G completions and M optimizer steps (TRL: M
`global_step`s), wall clock from the end of the previous step to the end of this one. gspo: time
between consecutive `MetricsLogger.log` calls (the final step, which also evaluates, until
its evaluation starts); TRL: time between `on_step_end` callbacks at multiples of M (logging, saving and
evaluation are off). The first step of each run is dropped as warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import baseline_tree, machine, median, table, write_result  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# ------------------------------------------------------------------------------- shared setup
PRESETS = {  # per --model, the settings a flag left unset takes
    "demo": dict(B=16, G=8, M=4, T=48, lr=1e-4, eval_prompts=200, eval_k=4, precision="fp32"),
    "50m": dict(B=16, G=8, M=4, T=48, lr=1e-4, eval_prompts=200, eval_k=4, precision="fp32"),
    # `gspo demo --model smollm2`'s run (gspo.apps.demo_real.DEMO_REAL), T 32 and a 50-prompt evaluation
    "smollm2": dict(B=8, G=4, M=4, T=32, lr=2e-5, eval_prompts=50, eval_k=4, precision="auto"),
    "qwen3-0.6b": dict(B=8, G=4, M=4, T=128, lr=1e-5, eval_prompts=8, eval_k=1, precision="auto"),
}


def rl_config(spec: dict):
    """gspo's TrainConfig for one run; TRL's arguments are derived from the same spec."""
    from gspo.config import TrainConfig, make_config

    data = spec.get("data") or {"task": "add3"}  # a built-in task, or the real-model demo's files and reward
    return make_config(TrainConfig, dict(
        model=spec["model_dir"], **data, seed=spec["seed"], output_dir=spec["output_dir"],
        max_steps=spec["steps"], per_device_batch_size=spec["B"], num_generations=spec["G"],
        num_minibatches=spec["M"], num_epochs=1, max_completion_length=spec["T"], temperature=1.0,
        top_k=0, top_p=1.0, objective="gspo", clip_low=3e-4, clip_high=4e-4, advantage_estimator="group",
        kl_coef=0.0, learning_rate=spec["lr"], lr_scheduler="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, eval_num_prompts=spec["eval_prompts"],
        eval_k=spec["eval_k"], eval_steps=0, save_steps=0, log_samples_steps=0, progress=False,
        overwrite_output_dir=True, device=spec.get("device", "cpu"), dtype="float32", bf16=spec.get("bf16", False),
        rollout_workers=int(spec.get("max_staleness") is not None), max_staleness=spec.get("max_staleness") or 0,
        use_sampler_logprobs=spec.get("use_sampler_logprobs", False), seeded_sampling=spec.get("seeded", False),
        generation_backend=spec.get("backend", "auto"), **spec.get("overrides", {})))  # gspo-only settings


def ordered_prompts(cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """The prompt rows gspo's trainer will draw, in order (B per step), and the held-out rows.

    Mirrors `gspo.trainer.train`: the same `load_splits` call and `PromptSampler`, so TRL can be
    given the identical sequence as an unshuffled dataset.
    """
    from gspo.config import DataSettings, section
    from gspo.data.rows import PromptSampler, SplitLoader

    train_rows, eval_rows = SplitLoader(tokenizer, max(1000, cfg.max_steps * cfg.per_device_batch_size),
                                        cfg.eval_num_prompts, cfg.seed, cfg.max_prompt_length,
                                        cfg.truncate_prompts)(section(cfg, DataSettings))
    sampler = PromptSampler(train_rows, cfg.seed)
    rows = [r for _ in range(cfg.max_steps) for r in sampler.next(cfg.per_device_batch_size)]
    return rows, eval_rows


def random_50m(work_dir: Path) -> tuple[str, dict]:
    """The ~50M model of utilisation.py (LARGE), random init (seed 0), saved once with its tokenizer.

    Untrained, it stops where its first stop token falls: at T = 512, 16 completions of 4 add3
    prompts ran 2 to 512 tokens (mean 119), so a padded batch is ~3/4 padding. Its answers are never
    right (answer_match 0: every advantage is 0), which changes no work either side does per step.
    """
    from utilisation import LARGE

    return random_model(work_dir / "random_50m", LARGE)


def random_model(folder: Path, overrides: dict) -> tuple[str, dict]:
    """tiny-dense with `overrides`, random init (seed 0), saved once under `folder`/model with add3's character
    tokenizer; (its path, {"params", "overrides"})."""
    model_dir = folder / "model"
    if not (model_dir / "config.json").is_file():
        import torch

        from gspo.models import count_parameters, load_model

        torch.manual_seed(0)
        model, tokenizer = load_model("tiny-dense", overrides=overrides)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        (folder / "info.json").write_text(json.dumps({"params": count_parameters(model), "overrides": overrides},
                                                     indent=2))
    return str(model_dir), json.loads((folder / "info.json").read_text())


def smollm2() -> tuple[str, dict]:
    """SmolLM2-135M-Instruct (`make demo-real` installs its package): the checkpoint gspo converts its GGUF file into
    (once, cached), which both sides load by path."""
    from gspo.gguf import converted
    from gspo.models import PACKAGED, packaged_gguf

    folder = converted(packaged_gguf("smollm2"))
    return str(folder), {"model": PACKAGED["smollm2"].about, "path": str(folder)}


def random_qwen3_06b(work_dir: Path) -> tuple[str, dict]:
    """A Qwen3-0.6B-shaped model (vllm_serve_check.SIZE: 28 layers, hidden 1024, ~0.44B parameters without
    embeddings), random init (seed 0), with add3's character tokenizer: nothing to download. Untrained, its answers
    are never right, so its rows time the work only (the GPU check, issue 52)."""
    from vllm_serve_check import SIZE

    return random_model(work_dir / "random_qwen3_06b", SIZE)


def cold_start(work_dir: Path, sft_steps: int) -> tuple[str, dict]:
    """A partially trained model (gspo's demo SFT stage), saved once with save_pretrained and reused."""
    model_dir = work_dir / "cold_start" / "model"
    info_path = work_dir / "cold_start" / "info.json"
    if (model_dir / "config.json").is_file() and info_path.is_file():
        return str(model_dir), json.loads(info_path.read_text())
    from gspo.apps.demo import DEMO_SFT
    from gspo.config import SFTConfig, make_config
    from gspo.sft import sft

    cfg = make_config(SFTConfig, {**DEMO_SFT, "max_steps": sft_steps, "seed": 0, "progress": False,
                                  "overwrite_output_dir": True, "output_dir": str(work_dir / "cold_start")})
    summary = sft(cfg)
    info = {"sft_steps": summary["steps"], "greedy_accuracy": summary["eval/accuracy"], "settings": DEMO_SFT}
    info_path.write_text(json.dumps(info, indent=2))
    return summary["model_dir"], info


# ------------------------------------------------------------------------------- workers
def run_gspo(spec: dict) -> dict:
    """One gspo run; per-step wall time, generation time, rollout and train time, tokens, rewards."""
    import torch

    import gspo.tracking as tracking
    import gspo.trainer as trainer

    stamps, records, gen_s, first_prompts, eval_starts = {}, {}, [], [], []
    from gspo.data.source import SingleTask
    from gspo.rollout import Sampler  # the trainer's rollout sampler only
    from gspo.rollout.endpoint.rollouts import EndpointSampler

    original_log, original_generate, original_evaluate = tracking.MetricsLogger.log, Sampler.sample, SingleTask.evaluate

    def log(self, step, metrics):
        stamps[step] = time.perf_counter()
        records[step] = dict(metrics)
        return original_log(self, step, metrics)

    def generate(self, prompts, *args, **kwargs):
        if self.name in ("workers", "endpoints"):  # a worker's sampling, on the endpoint sampler's thread: the
            return original_generate(self, prompts, *args, **kwargs)  # trainer's wait is time/generate_s
        if not first_prompts:
            first_prompts.extend(prompts[:4])
        t0 = time.perf_counter()
        out = original_generate(self, prompts, *args, **kwargs)
        gen_s.append(time.perf_counter() - t0)
        return out

    def evaluate(self, *args, **kwargs):
        eval_starts.append(time.perf_counter())
        return original_evaluate(self, *args, **kwargs)

    original_request = EndpointSampler.request

    def request(self, prompts, *args, **kwargs):  # a worker samples: its prompts, the wait is time/generate_s
        if not first_prompts:
            first_prompts.extend(prompts[:4])
        return original_request(self, prompts, *args, **kwargs)

    tracking.MetricsLogger.log, Sampler.sample, SingleTask.evaluate = log, generate, evaluate
    EndpointSampler.request = request
    cfg = rl_config(spec)
    summary = trainer.train(cfg)
    N = spec["B"] * spec["G"]
    steps = []
    for s in range(1, cfg.max_steps + 1):
        m = records[s]
        steps.append({
            "step": s,
            # the last step also runs the final evaluation before it logs: its wall time ends where that begins
            "wall_s": (stamps[s] if s < cfg.max_steps else eval_starts[-1]) - stamps[s - 1],
            "generate_s": gen_s[s - 1] if gen_s else m["time/generate_s"],
            "rollout_s": m["time/rollout_s"],  # generate + rewards + advantages + pi_old log-probs
            "train_s": m["time/train_s"],  # M optimizer steps
            "tokens": m["completion/mean_len"] * N,
            "reward": m["reward/mean"],
            "mean_len": m["completion/mean_len"],
            "clip_frac": m.get("clip/low_frac", 0.0) + m.get("clip/high_frac", 0.0),  # answers clipped, GSPO
        })
    final = summary["evals"][cfg.max_steps]
    return {"side": "gspo", "steps": steps, "eval": final, "first_prompts": first_prompts,
            "torch_threads": torch.get_num_threads(), "gspo_file": trainer.__file__, **peak_memory()}


def peak_memory() -> dict:
    """Peak resident memory (GiB) of this process and of its largest ended child (a rollout worker), by getrusage;
    on a GPU also the most this process's tensors held there (torch.cuda.max_memory_allocated)."""
    import resource

    import torch

    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "worker_peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def trl_args(spec: dict, output_dir: str):
    """TRL GRPOConfig equal to `rl_config(spec)`: field by field, see docs/benchmarks.md."""
    from trl import GRPOConfig

    B, G, M = spec["B"], spec["G"], spec["M"]
    return GRPOConfig(
        output_dir=output_dir,
        # one rollout of B*G completions feeds M optimizer steps of B*G/M completions each
        per_device_train_batch_size=B * G // M, gradient_accumulation_steps=1, steps_per_generation=M,
        num_generations=G, num_iterations=1, max_steps=spec["steps"] * M,
        max_completion_length=spec["T"], temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0,
        # GSPO: sequence-level, length-normalised ratio; loss_type grpo averages each sequence's
        # (constant) token losses, then sequences: the GSPO paper's objective, as gspo computes it
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4,
        scale_rewards="group", beta=0.0, mask_truncated_completions=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8, optim="adamw_torch", max_grad_norm=1.0,
        seed=spec["seed"], data_seed=spec["seed"], shuffle_dataset=False,
        # CPU, fp32 weights (bf16 autocast where the spec says), no activation checkpointing (TRL's defaults are
        # bf16 and checkpointing on)
        use_cpu=spec.get("device", "cpu") == "cpu", bf16=spec.get("bf16", False), fp16=False,
        gradient_checkpointing=False,
        # nothing logged, saved or evaluated inside the timed region
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0,
    )


def run_trl(spec: dict) -> dict:
    """One TRL GRPOTrainer run with the same model, prompts, reward and settings."""
    import datasets
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from gspo.config import EvalSettings, RewardSettings, SamplingSettings, section
    from gspo.data.evaluation import Evaluation, evaluate
    from gspo.data.rewards import get_reward_fn

    cfg = rl_config(spec)
    scorer = get_reward_fn(cfg.reward_funcs[0] if cfg.reward_funcs else "answer_match")  # add3: answer_match
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    rows, eval_rows = ordered_prompts(cfg, tokenizer)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    M = spec["M"]

    rewards = []

    def reward(prompts, completions, answer, **kwargs):
        out = scorer(prompts, completions, answer)
        rewards.append(sum(out) / len(out))
        return out

    reward.__name__ = getattr(scorer, "__name__", "reward")

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    clock = Clock()
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=[reward], args=trl_args(spec, spec["output_dir"]),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
    gen_s, rollout_s, tokens, lengths, first_prompts = [], [], [], [], []
    original_generate, original_score = trainer._generate, trainer._generate_and_score_completions

    def generate(prompts):
        if not first_prompts:
            first_prompts.extend(prompts[:: spec["G"]][:4])
        t0 = time.perf_counter()
        out = original_generate(prompts)
        gen_s.append(time.perf_counter() - t0)
        return out

    def generate_and_score(inputs):  # generate + rewards + advantages + pi_old log-probs
        t0 = time.perf_counter()
        out = original_score(inputs)
        rollout_s.append(time.perf_counter() - t0)
        n = out["completion_mask"].sum().item()
        tokens.append(n)
        lengths.append(n / out["completion_mask"].shape[0])
        return out

    trainer._generate, trainer._generate_and_score_completions = generate, generate_and_score
    trainer.train()
    ends = [clock.start] + clock.ends[M - 1 :: M]  # end of each RL step (M optimizer steps)
    steps = []
    for s in range(1, spec["steps"] + 1):
        wall = ends[s] - ends[s - 1]
        steps.append({"step": s, "wall_s": wall, "generate_s": gen_s[s - 1], "rollout_s": rollout_s[s - 1],
                      "train_s": wall - rollout_s[s - 1], "tokens": tokens[s - 1], "reward": rewards[s - 1],
                      "mean_len": lengths[s - 1]})
    model = trainer.model
    torch.manual_seed(spec["seed"])
    plan = Evaluation.of(section(cfg, EvalSettings), section(cfg, RewardSettings), section(cfg, SamplingSettings),
                         seed=cfg.seed, template_kwargs=cfg.chat_template_kwargs)
    with torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=cfg.bf16):  # as gspo's does
        final = evaluate(model, tokenizer, eval_rows, plan)
    return {"side": "trl", "steps": steps, "eval": final, "first_prompts": first_prompts,
            "torch_threads": torch.get_num_threads(), **peak_memory()}


# ------------------------------------------------------------------------------- driver
def summarise(run: dict, skip_first: int) -> dict:
    """Medians over the timed steps of one run; reward over its last 5 steps."""
    timed = [s for s in run["steps"] if s["step"] > skip_first and s["wall_s"] is not None]
    last = run["steps"][-5:]
    return {
        "s_per_step": median(s["wall_s"] for s in timed),
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["wall_s"] for s in timed),
        "generate_s": median(s["generate_s"] for s in timed),
        "rollout_s": median(s["rollout_s"] for s in timed),
        "train_s": median(s["train_s"] for s in timed),
        "mean_len": median(s["mean_len"] for s in timed),
        "timed_steps": len(timed),
        "reward_first": run["steps"][0]["reward"],
        "reward_last5": sum(s["reward"] for s in last) / len(last),
        "eval_accuracy": run["eval"].get("eval/accuracy"),
        "eval_mean_at_k": run["eval"].get("eval/mean_at_k"),
        "peak_rss_gib": run["peak_rss_gib"],  # the trainer's process
        "worker_peak_rss_gib": run["worker_peak_rss_gib"],  # a rollout worker's, where there is one (else ~0)
        "cuda_peak_gib": run.get("cuda_peak_gib", 0.0),  # the trainer's tensors on the GPU (0 on a CPU)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(PRESETS), default="demo",
                        help="demo: the demo model after a cold-start SFT; 50m: a random-init ~50M model "
                             "(long-tailed lengths); smollm2: SmolLM2-135M-Instruct; qwen3-0.6b: a random-init "
                             "Qwen3-0.6B-shaped model (for a GPU)")
    parser.add_argument("--device", default="cpu", help="both sides' device: cpu, or cuda (one GPU)")
    parser.add_argument("--reps", type=int, default=3, help="runs per side, alternating gspo/TRL; run i uses seed i")
    parser.add_argument("--steps", type=int, default=20, help="RL steps per run (each: 1 rollout, M optimizer steps)")
    parser.add_argument("--B", type=int, help="prompts per rollout (default: the model's in PRESETS)")
    parser.add_argument("--G", type=int, help="completions per prompt")
    parser.add_argument("--M", type=int, help="optimizer steps (minibatches) per rollout")
    parser.add_argument("--T", type=int, help="max completion tokens")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--eval-prompts", type=int, help="held-out prompts evaluated after each run")
    parser.add_argument("--eval-k", type=int)
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"],
                        help="both sides: fp32, or float32 weights under bf16 autocast; auto: bf16 where this machine "
                             "runs it natively (default: smollm2 auto, the others fp32)")
    parser.add_argument("--sft-steps", type=int, default=400, help="cold-start SFT steps (stops at 40%% accuracy)")
    parser.add_argument("--skip-first", type=int, default=1, help="warm-up RL steps left out of the timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of both sides (0: torch's default)")
    parser.add_argument("--work-dir", default="runs/bench/vs_trl")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile every run into <work-dir>/profile_<side>_<seed>.txt")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vs_trl.json)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also run gspo as of this git revision (before/after a change), "
                             "alternating with the others")
    parser.add_argument("--async", dest="async_k", type=int, default=None, metavar="K",
                        help="also run gspo with a rollout worker sampling K steps ahead (max_staleness K)")
    parser.add_argument("--mu-as-pi-old", action="store_true",
                        help="with --async: also run gspo_async_mu, the worker side with the sampler's log-probs "
                             "(mu) as pi_old (use_sampler_logprobs) instead of pi_old recomputed by the trainer")
    parser.add_argument("--skip", nargs="+", choices=["trl", "gspo_async"], default=[],
                        help="leave these sides out: trl (gspo's sides against each other, no TRL ratios), "
                             "gspo_async (with --mu-as-pi-old: the mu side alone beside synchronous gspo)")
    parser.add_argument("--worker", choices=["gspo", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in PRESETS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    if args.worker:  # inside a fresh subprocess: one run, result as JSON on the last stdout line
        spec = json.loads(args.spec)
        if spec.get("threads"):
            import torch

            torch.set_num_threads(spec["threads"])
        run = run_gspo if args.worker == "gspo" else run_trl
        if spec.get("profile"):  # cProfile of the whole run (load, train, final eval), top entries to a file
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            result = prof.runcall(run, spec)
            text = io.StringIO()
            for key in ("cumulative", "tottime"):
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(40)
            Path(spec["profile"]).write_text(text.getvalue())
        else:
            result = run(spec)
        print("RESULT " + json.dumps(result))
        return

    try:
        import trl
    except ImportError:
        if "trl" not in args.skip:
            sys.exit("vs_trl.py needs TRL: pip install '.[bench]' (or --skip trl)")
        trl = None
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "demo":
        model_dir, cold = cold_start(work, args.sft_steps)
        print(f"cold start: {model_dir} ({cold['sft_steps']} SFT steps, greedy accuracy {cold['greedy_accuracy']:.1%})")
    elif args.model == "smollm2":
        model_dir, cold = smollm2()
        print(f"model: {cold['model']} at {model_dir}; task: the real-model demo's a+b, reward last_number")
    else:
        model_dir, cold = (random_qwen3_06b if args.model == "qwen3-0.6b" else random_50m)(work)
        print(f"model: {model_dir} ({cold['params'] / 1e6:.1f}M parameters, random init)")
    if args.mu_as_pi_old and args.async_k is None:
        sys.exit("--mu-as-pi-old adds an asynchronous side: give --async K too")
    asyncs = ("gspo_async", *(("gspo_async_mu",) if args.mu_as_pi_old else ())) if args.async_k is not None else ()
    asyncs = tuple(side for side in asyncs if side not in args.skip)
    sides = ("gspo", *asyncs,
             *(("gspo_base",) if args.baseline else ()), *(() if "trl" in args.skip else ("trl",)))
    env = {side: dict(os.environ) for side in sides}
    if args.baseline:
        base = baseline_tree(args.baseline, work)
        env["gspo_base"]["PYTHONPATH"] = str(base) + os.pathsep + env["gspo_base"].get("PYTHONPATH", "")
        print(f"baseline: gspo at {args.baseline} in {base}")
    from gspo.apps.demo_real import resolve_precision, write_data

    bf16 = resolve_precision(args.precision) == "bf16"
    data = None
    if args.model == "smollm2":  # `gspo demo --model smollm2`'s problems, written once; its reward on both sides
        train_file, test_file = write_data(work / "demo_real_data")
        data = {"task": None, "dataset": str(train_file), "eval_dataset": str(test_file),
                "reward_funcs": ["last_number"]}
    print(f"precision: {'float32 weights under bf16 autocast' if bf16 else 'float32'} (both sides)")
    runs = []
    for rep in range(args.reps):
        for side in sides:
            spec = dict(model_dir=model_dir, seed=rep, steps=args.steps, B=args.B, G=args.G, M=args.M, T=args.T,
                        lr=args.lr, eval_prompts=args.eval_prompts, eval_k=args.eval_k, threads=args.threads,
                        data=data, bf16=bf16, device=args.device,
                        output_dir=str(work / f"{side}_seed{rep}"),
                        max_staleness=args.async_k if side in asyncs else None,
                        use_sampler_logprobs=side == "gspo_async_mu",
                        profile=str(work / f"profile_{side}_{rep}.txt") if args.profile else None)
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            worker = "trl" if side == "trl" else "gspo"
            proc = subprocess.run([sys.executable, __file__, "--worker", worker, "--spec", json.dumps(spec)],
                                  capture_output=True, text=True, env=env[side])
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                sys.exit(f"{side} run {rep} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            run = json.loads(lines[-1][len("RESULT "):])
            run["side"] = side
            run["rep"], run["seed"], run["process_s"], run["load_before"] = rep, rep, time.perf_counter() - t0, load
            run["summary"] = summarise(run, args.skip_first)
            runs.append(run)
            s = run["summary"]
            print(f"  rep {rep} {side:5s} {s['s_per_step']:.3f} s/step  {s['tokens_per_s']:.0f} tok/s  "
                  f"reward {s['reward_first']:.3f} -> {s['reward_last5']:.3f}  eval acc {s['eval_accuracy']:.3f}",
                  flush=True)
    by = {side: [r for r in runs if r["side"] == side] for side in sides}
    for rep in range(args.reps):
        a = by["gspo"][rep]
        for side in sides[1:]:
            if by[side][rep]["first_prompts"] != a["first_prompts"]:
                sys.exit(f"rep {rep}: gspo and {side} drew different prompts: {a['first_prompts']} vs "
                         f"{by[side][rep]['first_prompts']}")
        if args.baseline and by["gspo_base"][rep]["gspo_file"] == a["gspo_file"]:
            sys.exit(f"the baseline imported the current gspo ({a['gspo_file']}), not the revision's")
    keys = ["s_per_step", "tokens_per_s", "generate_s", "rollout_s", "train_s", "mean_len", "reward_first",
            "reward_last5", "eval_accuracy", "eval_mean_at_k", "peak_rss_gib", "worker_peak_rss_gib", "cuda_peak_gib"]
    med = {side: {k: median(r["summary"][k] for r in by[side]) for k in keys} for side in by}
    ratio = {}
    if "trl" in by:
        pair_ratio = [a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"]
                      for a, b in zip(by["gspo"], by["trl"])]
        pair_step = [b["summary"]["s_per_step"] / a["summary"]["s_per_step"] for a, b in zip(by["gspo"], by["trl"])]
        ratio = {"tokens_per_s": median(pair_ratio), "step_time_trl_over_gspo": median(pair_step),
                 "tokens_per_s_pairs": pair_ratio,
                 "generate_s_trl_over_gspo": med["trl"]["generate_s"] / med["gspo"]["generate_s"],
                 "train_s_trl_over_gspo": med["trl"]["train_s"] / med["gspo"]["train_s"]}
    for a_side in asyncs:  # the same per-pair medians: asynchronous over synchronous, and over TRL
        tag = a_side.removeprefix("gspo_")  # async, async_mu
        for name, other in (("sync", "gspo"), *((("trl", "trl"),) if "trl" in by else ())):
            pairs = [a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"] for a, b in zip(by[a_side], by[other])]
            ratio[f"{tag}_over_{name}_pairs"], ratio[f"{tag}_over_{name}"] = pairs, median(pairs)
        steps = [b["summary"]["s_per_step"] / a["summary"]["s_per_step"] for a, b in zip(by[a_side], by["gspo"])]
        ratio[f"{tag}_steps_per_s_over_sync_pairs"], ratio[f"{tag}_steps_per_s_over_sync"] = steps, median(steps)
    if args.baseline:  # before/after: the same per-pair medians, current gspo over the revision's
        ratio["baseline"] = args.baseline
        ratio["tokens_per_s_over_baseline_pairs"] = [a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"]
                                                     for a, b in zip(by["gspo"], by["gspo_base"])]
        ratio["tokens_per_s_over_baseline"] = median(ratio["tokens_per_s_over_baseline_pairs"])
        if "trl" in by:
            ratio["baseline_over_trl"] = median(b["summary"]["tokens_per_s"] / t["summary"]["tokens_per_s"]
                                                for b, t in zip(by["gspo_base"], by["trl"]))
    print()
    print(f"{args.reps} runs per side, {args.steps} RL steps each (first {args.skip_first} untimed), "
          f"B={args.B} G={args.G} M={args.M} T={args.T}, lr={args.lr}; {machine()['cores']} CPU cores")
    rows = [[side, med[side]["tokens_per_s"], med[side]["s_per_step"], med[side]["generate_s"],
             med[side]["rollout_s"] - med[side]["generate_s"], med[side]["train_s"], med[side]["mean_len"],
             med[side]["peak_rss_gib"], med[side]["worker_peak_rss_gib"]]
            for side in sides]
    print(table(["side", "tokens/s", "s/step", "generate s", "rewards + pi_old s", "train s (M opt. steps)",
                 "mean len", "peak GiB", "worker peak GiB"], rows))
    pairs_of = lambda key: ", ".join(f"{r:.2f}" for r in ratio[key])  # noqa: E731
    if "trl" in by:
        print(f"\ngspo / TRL end-to-end tokens/s: {ratio['tokens_per_s']:.2f}x (median of per-pair ratios "
              f"{pairs_of('tokens_per_s_pairs')}); generation {ratio['generate_s_trl_over_gspo']:.2f}x, "
              f"training {ratio['train_s_trl_over_gspo']:.2f}x")
    for a_side in asyncs:
        tag = a_side.removeprefix("gspo_")  # async, async_mu
        versus_trl = (f"; {a_side} / TRL tokens/s {ratio[f'{tag}_over_trl']:.2f}x "
                      f"(pairs {pairs_of(f'{tag}_over_trl_pairs')})" if "trl" in by else "")
        print(f"{a_side} (max_staleness {args.async_k}) / gspo: steps/s {ratio[f'{tag}_steps_per_s_over_sync']:.2f}x "
              f"(pairs {pairs_of(f'{tag}_steps_per_s_over_sync_pairs')}), tokens/s {ratio[f'{tag}_over_sync']:.2f}x "
              f"(pairs {pairs_of(f'{tag}_over_sync_pairs')}){versus_trl}")
    if args.baseline:
        versus_trl = f"; gspo@{args.baseline} / TRL: {ratio['baseline_over_trl']:.2f}x" if "trl" in by else ""
        print(f"gspo / gspo@{args.baseline}: {ratio['tokens_per_s_over_baseline']:.2f}x (pairs "
              f"{pairs_of('tokens_per_s_over_baseline_pairs')}){versus_trl}")
    rows = [[side, r["seed"], r["summary"]["reward_first"], r["summary"]["reward_last5"],
             r["summary"]["eval_accuracy"], r["summary"]["eval_mean_at_k"]] for side in by for r in by[side]]
    print()
    print(table(["side", "seed", "reward step 1", f"reward steps {max(1, args.steps - 4)}-{args.steps}",
                 "held-out greedy acc.", f"held-out mean@{args.eval_k}"], rows))
    import transformers

    path = write_result("vs_trl", {
        "settings": {**{k: getattr(args, k) for k in ("model", "reps", "steps", "B", "G", "M", "T", "lr",
                                                       "eval_prompts", "eval_k", "skip_first", "threads", "baseline",
                                                       "async_k", "mu_as_pi_old", "skip", "precision", "device")},
                     "bf16": bf16},
        "versions": {"trl": trl and trl.__version__, "transformers": transformers.__version__},
        "cold_start": cold, "median": med, "ratio": ratio,
        "runs": [{k: r[k] for k in ("side", "seed", "summary", "steps", "eval", "process_s", "load_before",
                                     "torch_threads")}
                 for r in runs],
    }, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
