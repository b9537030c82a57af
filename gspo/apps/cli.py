"""`gspo <command>`: train, sft, bench, eval, serve, plot, demo, lab."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from gspo.config import SFTConfig, TrainConfig, config_help, load_config

# Exit statuses (docs/reliability.md): 0 done; 2 a user or environment error (config, data, reward
# function, files, disk) printed as one line; 3 aborted by the non-finite guard; 128+N stopped by
# signal N (checkpoint saved); 1 an unexpected error, with its traceback (a bug: please report it).
USER_ERROR, ABORTED = 2, 3
_COMMON = argparse.ArgumentParser(add_help=False)
_COMMON.add_argument("--debug", action="store_true", help="show the full traceback of an error instead of one line")


def _config_parser(sub, name: str, cls, summary: str):
    p = sub.add_parser(name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="config fields (YAML keys and key=value overrides; docs/configuration.md explains "
                              "each):\n" + config_help(cls),
                       parents=[_COMMON])
    p.add_argument("--config", help="YAML file whose keys are config field names")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides; they win over the YAML file")
    return p


class _LabHelp(argparse.Action):
    """`gspo lab --help`: the lab's config fields, read (gspo.apps.lab imported) only when the help is asked for,
    so that building the parser, e.g. for `gspo train`, leaves the lab out."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from gspo.apps.lab.runs import LabConfig

        parser.epilog = "config fields (YAML keys and key=value overrides):\n" + config_help(LabConfig)
        parser.print_help()
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo",
                                     description="Stable RL post-training: GSPO, GRPO, MoE routing replay.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = _config_parser(sub, "train", TrainConfig, "RL training (GSPO by default) of a causal LM")
    p.add_argument("--resume", metavar="DIR|latest|latest_valid",
                   help="continue exactly from a checkpoint folder, the newest one under output_dir (latest: an "
                        "error if it is damaged), or the newest that verifies (latest_valid: damaged newer ones are "
                        "set aside); same as resume_from_checkpoint=...")
    _config_parser(sub, "sft", SFTConfig, "cold-start supervised fine-tuning on prompt/answer pairs")
    p = _config_parser(sub, "bench", TrainConfig, "a few RL steps of a training config: tokens/s, seconds per step "
                       "by phase, utilisation of the measured matmul peak in each phase's dtype, sampling against the "
                       "memory-bandwidth roofline (nothing kept)")
    p.add_argument("--steps", type=int, default=4, help="RL steps to run (default 4)")
    p.add_argument("--skip-first", type=int, default=1, help="warm-up steps left out of the figures (default 1)")
    p.add_argument("--peak-seconds", type=float, default=5.0,
                   help="seconds of matmuls (per dtype) and of memory reads, each before and after the run")
    p.add_argument("--out", help="also write the figures as JSON to this file")
    p = _config_parser(sub, "serve", TrainConfig, "an OpenAI-compatible, token-in/token-out endpoint in front of a "
                       "model (model=...): /v1/chat/completions, /v1/completions, /v1/models (docs/agents.md)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1, loopback only); any "
                                                       "other needs the run's secret, which clients send as api_key")
    p.add_argument("--port", type=int, default=8000, help="default 8000 (0: a free port, printed)")
    p = _config_parser(sub, "eval", TrainConfig, "held-out scores of a model with a run's reward functions "
                       "(--config: the run's config; key=value: reward_funcs=..., drop_bad_rewards=true, ...)")
    p.add_argument("--model", help="saved model directory, preset or packaged model (default: the config's model)")
    p.add_argument("--task", help="a built-in task's test split (default: the config's held-out rows, as the run "
                                  "evaluates them; without a config, add3)")
    p.add_argument("--dataset", help="a data file, every row of it evaluated (none held out; --num-prompts: its "
                                     "first rows)")
    p.add_argument("--num-prompts", type=int, help="prompts to evaluate (default: eval_num_prompts, 200; with "
                                                   "--dataset, all its rows)")
    p.add_argument("--k", type=int, help="samples per prompt for mean@k / pass@k (default: eval_k, 4)")
    p.add_argument("--temperature", type=float, help="of the samples (default: eval_temperature, 1.0)")
    p.add_argument("--max-completion-length", type=int, help="default: max_completion_length, 64")
    p.add_argument("--seed", type=int, help="default: seed, 0")
    p = sub.add_parser("plot", parents=[_COMMON], help="draw PNG plots from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p = sub.add_parser("demo", parents=[_COMMON],
                       help="cold-start SFT, then GSPO, then held-out evaluation and plots, on CPU")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objective", default="gspo", help="gspo (default) or grpo, ...")
    p.add_argument("--model", help="a real pretrained model instead of the tiny one, with no cold start: smollm2 "
                                   "(SmolLM2-135M-Instruct; make demo-real installs it)")
    p.add_argument("--lora", action="store_true", help="with --model: LoRA (r 16) instead of full fine-tuning")
    p.add_argument("--smoke", action="store_true", help="with --model: 2 steps on 8 held-out prompts (a check)")
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="with --model: bf16 (autocast; a bfloat16 LoRA base), fp32, or auto (default): bf16 where "
                        "the GPU or CPU runs bfloat16 natively (AVX512-BF16, AMX), else fp32")
    p.add_argument("--rollout-correction", default="none",
                   help="with --model: a rollout correction (token_tis, seq_mis, ...) of pi_old/mu, the sampler's "
                        "log-probs against the trainer's; none (default)")
    p.add_argument("--tools", action="store_true", help="the tiny model learns a calculator tool on 4-digit "
                                                        "addition, beside the same model without it (multi-turn)")
    p.add_argument("--agent", action="store_true", help="the tiny model learns the calculator through an agent "
                                                        "written against the openai client (gspo/apps/demo_agent.py)")
    p.add_argument("--resume", metavar="latest|latest_valid|DIR",
                   help="continue a demo that stopped (Ctrl-C): its finished cold start kept, its RL run from the "
                        "newest checkpoint (latest_valid: the newest that verifies; DIR: that checkpoint folder); "
                        "give the other options as before")
    _add_lab(sub)
    return parser


def _add_lab(sub) -> None:
    """`gspo lab`: its config fields are listed by `--help` alone (`_LabHelp`)."""
    p = sub.add_parser("lab", parents=[_COMMON], add_help=False,
                       help="stability lab: GRPO vs GSPO on dense and MoE models, claims report",
                       description="Rerun the GSPO paper's claims in miniature; writes report.md with plots. "
                                   "Rerunning continues an interrupted lab.\nThe plots need matplotlib, the lab "
                                   "extra: pip install 'gspo[lab]'.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action=_LabHelp, help="show this help message and exit")
    p.add_argument("--quick", action="store_true", help="fewer objectives, seeds and steps (under 2 min on 2 cores)")
    p.add_argument("--config", help="YAML file whose keys are lab config field names")
    p.add_argument("--report-only", action="store_true", help="rebuild report.md from the finished runs, run nothing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides; they win over the YAML file")


RETIRED = {"rollout-server": "gspo rollout-server is retired: on each machine that samples, start `gspo serve "
                              "--config <the run's config> --host <its address> --port <port>` with the run's secret "
                              "(GSPO_ROLLOUT_SECRET) and list http://<address>:<port>/v1 in the trainer's "
                              "rollout_endpoints (docs/distributed.md)"}
"""Commands gspo no longer has -> what to do instead."""


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in RETIRED:
        print(f"gspo: error: {RETIRED[words[0]]}", file=sys.stderr)
        return USER_ERROR
    args = parse_args(build_parser(), argv)
    try:
        return _run(args, argv)
    except (Exception, KeyboardInterrupt) as err:
        status, kind = _classify(err)
        if args.debug or status is None:  # --debug, or a bug: the traceback is what helps
            raise
        print(f"gspo {args.command}: {kind}: {_one_line(err)}", file=sys.stderr)
        return status


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`parser.parse_args`, but key=value overrides may also follow an option (`--resume latest max_steps=3`).

    argparse fills a positional list once, from the words before the first option, and calls the rest
    unrecognised; those words join the overrides, in order (a later one wins), when they are not options.
    """
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(word.startswith("-") for word in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _classify(err: BaseException) -> tuple[int | None, str]:
    """(exit status, label) of an error that is reported as one line; (None, "") for a bug."""
    from gspo.data.rewards import RewardError
    from gspo.runtime import TrainingAborted, TrainingInterrupted

    if isinstance(err, TrainingInterrupted):
        return 128 + err.signum, "stopped"  # the shell's convention for "ended by signal N"
    if isinstance(err, TrainingAborted):
        return ABORTED, "aborted"
    if isinstance(err, KeyboardInterrupt):
        return 128 + 2, "interrupted"
    if isinstance(err, (ValueError, RewardError, OSError)):  # configuration, inputs, reward functions, files
        return USER_ERROR, "error"
    return None, ""


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.strerror and type(err).__str__ is OSError.__str__:
        text = err.strerror + (f": {err.filename}" if err.filename else "")
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def _run(args, argv=None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bar is enough
    args.command_line = "gspo " + " ".join(sys.argv[1:] if argv is None else argv)  # what lab.json records
    _COMMANDS[args.command](args)
    return 0


def _train(args) -> None:
    """`gspo train`: what gspo.Trainer.train runs; prints the summary as JSON."""
    from gspo.apps.api import train_and_plot

    overrides = args.overrides + ([f"resume_from_checkpoint={args.resume}"] if args.resume else [])
    cfg = load_config(TrainConfig, args.config, overrides)
    if cfg.launcher == "ray":  # this process places the run's processes on Ray and waits for them
        from gspo.apps.ray_launch import launch

        sys.exit(launch(cfg))
    summary = train_and_plot(cfg)
    print(json.dumps({"evals": summary["evals"] or "off (no held-out prompts)",  # eval_num_prompts=0, ...
                      "seconds": round(summary["seconds"], 1),
                      "model": summary["model"], "plots": summary["plots"]}, indent=2))


def _bench(args) -> None:
    from gspo.apps.bench import bench, format_bench

    result = bench(load_config(TrainConfig, args.config, args.overrides), steps=args.steps,
                   skip_first=args.skip_first, peak_seconds=args.peak_seconds)
    print(format_bench(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def _serve(args) -> None:
    from gspo.apps.serve import serve

    serve(load_config(TrainConfig, args.config, args.overrides), args.host, args.port)


def _sft(args) -> None:
    from gspo.sft import sft

    cfg = load_config(SFTConfig, args.config, args.overrides)
    print(json.dumps(sft(cfg), indent=2))


def _eval(args) -> None:
    """`gspo eval`: the scores of `evaluate` (gspo/data/evaluation.py) as JSON, with the config's rewards, sampling
    and evaluation settings. The data and rewards are checked before the model loads (preflight)."""
    from gspo.config import (
        DataSettings,
        EpisodeSettings,
        EvalSettings,
        ModelSettings,
        RewardSettings,
        SamplingSettings,
        TaskSettings,
        section,
    )
    from gspo.data.evaluation import Evaluation, evaluate
    from gspo.data.rows import stderr_line
    from gspo.data.source import preflight
    from gspo.models import seeded_model

    cfg = _eval_config(args)
    preflight(section(cfg, DataSettings), section(cfg, RewardSettings), section(cfg, TaskSettings),
              section(cfg, EpisodeSettings), note=stderr_line)
    _, model, tokenizer = seeded_model(section(cfg, ModelSettings))
    plan = Evaluation.of(section(cfg, EvalSettings), section(cfg, RewardSettings), section(cfg, SamplingSettings),
                         seed=cfg.seed, template_kwargs=cfg.chat_template_kwargs,
                         episodes=section(cfg, EpisodeSettings))
    data = dataclasses.replace(section(cfg, DataSettings), chat_template_kwargs=plan.template_kwargs)
    rows = _eval_rows(cfg, data, tokenizer, whole_file=args.dataset is not None, first=args.num_prompts)
    print(json.dumps(evaluate(model, tokenizer, rows, plan), indent=2))


def _eval_config(args) -> TrainConfig:
    """The TrainConfig `gspo eval` scores with: --config and key=value overrides, then its own options on top."""
    from gspo.config import make_config, to_dict

    if args.model is None and args.config is None:
        raise ValueError("give --model (a saved model directory, a preset or a packaged model) or --config (a run's "
                         "config, whose model is evaluated)")
    cfg = load_config(TrainConfig, args.config, args.overrides)
    values = {key: value for key, value in (
        ("eval_num_prompts", args.num_prompts), ("eval_k", args.k), ("eval_temperature", args.temperature),
        ("max_completion_length", args.max_completion_length), ("seed", args.seed)) if value is not None}
    if args.model is not None and args.model != cfg.model:  # model_overrides belong to the config's preset
        values.update(model=args.model, model_overrides=None)
    if args.dataset is not None or args.task is not None:  # the rows these name, instead of the config's
        values.update(task=args.task, dataset=args.dataset, eval_dataset=None, tasks=None)
    elif cfg.tasks:
        raise ValueError("the config trains several tasks (tasks); evaluate one of them: --task NAME or --dataset "
                         "FILE")
    return make_config(TrainConfig, {**to_dict(cfg, keep_secrets=True), **values})


def _eval_rows(cfg: TrainConfig, data, tokenizer, *, whole_file: bool, first: int | None) -> list[dict]:
    """The rows `gspo eval` scores, said in one line on stderr. `whole_file` (--dataset): every row of data.dataset,
    or its `first` rows (--num-prompts), none held out. Else the held-out rows the run evaluates: a task's test
    split, eval_dataset, or the eval_holdout split of dataset (`load_splits`), at most eval_num_prompts."""
    from gspo.data.rows import SplitLoader, check_rows, load_rows, stderr_line

    limits = (cfg.max_prompt_length, cfg.truncate_prompts)
    if whole_file:
        rows = load_rows(data.dataset, data.prompt_column, config=data.dataset_config,
                         split=data.dataset_train_split)
        n = len(rows) if first is None else min(first, len(rows))
        stderr_line(f"eval: {'every one' if n == len(rows) else f'the first {n}'} of the {len(rows)} rows of "
                    f"{data.dataset}")
        rows = check_rows(rows[:n], tokenizer, *limits, data.chat_template_kwargs)
    else:
        _, rows = SplitLoader(tokenizer, 0, cfg.eval_num_prompts, cfg.seed, *limits)(data)  # a split: said there
    if not rows:
        raise ValueError("nothing to evaluate (eval_num_prompts=0, or nothing held out); give --num-prompts, or "
                         "--dataset FILE to evaluate every row of a file")
    if not whole_file and (data.task is not None or data.eval_dataset is not None):
        stderr_line(f"eval: {len(rows)} held-out rows of "
                    f"{f'task {data.task} (its test split)' if data.task else data.eval_dataset}")
    return rows


def _plot(args) -> None:
    from gspo.report import plot_run

    for path in plot_run(args.run_dir):
        print(path)


def _demo(args) -> None:
    """`gspo demo`: the tiny model's demo, its tool-use variant (--tools) or a real model's (--model)."""
    if args.tools or args.agent:
        flag = "--agent" if args.agent else "--tools"
        if (args.model or args.lora or args.smoke or args.objective != "gspo" or args.rollout_correction != "none"
                or args.precision != "auto" or (args.tools and args.agent)):
            raise ValueError(f"{flag} runs its own tiny model with GSPO; leave out --model, --lora, --smoke, "
                             "--objective, --rollout-correction and --precision (and give --tools or --agent, not "
                             "both)")
        from gspo.apps.demo_tools import run_tool_demo

        default = "runs/demo-agent" if args.agent else "runs/demo-tools"
        run_tool_demo(default if args.output_dir == "runs/demo" else args.output_dir, seed=args.seed,
                      resume=args.resume, variants=("agent",) if args.agent else ("tool", "no_tool"))
    elif args.model:
        from gspo.apps.demo_real import run_real_demo

        output_dir = "runs/demo-real" if args.output_dir == "runs/demo" else args.output_dir
        run_real_demo(args.model, output_dir, seed=args.seed, objective=args.objective, lora=args.lora,
                      smoke=args.smoke, rollout_correction=args.rollout_correction, resume=args.resume,
                      precision=args.precision)
    else:
        if args.lora or args.smoke or args.rollout_correction != "none" or args.precision != "auto":
            raise ValueError("--lora, --smoke, --rollout-correction and --precision go with --model (the tiny demo "
                             "trains its own model fully, in float32)")
        from gspo.apps.demo import run_demo

        run_demo(args.output_dir, seed=args.seed, objective=args.objective, resume=args.resume)


def _lab(args) -> None:
    from gspo.apps.lab.report import write_report
    from gspo.apps.lab.runs import load_lab_config, run_lab

    cfg = load_lab_config(args.quick, args.config, args.overrides)
    if args.report_only:
        print(write_report(cfg.output_dir))
    else:
        run_lab(cfg, command=args.command_line, log=lambda line: print(line, flush=True))


_COMMANDS = {"train": _train, "bench": _bench, "serve": _serve, "sft": _sft, "eval": _eval, "plot": _plot,
             "demo": _demo, "lab": _lab}
"""`gspo <command>` -> the function that runs it (on the parsed arguments)."""

if __name__ == "__main__":
    sys.exit(main())

