"""`gspo <command>`: train, sft, eval, plot, demo."""

from __future__ import annotations

import argparse
import json
import sys

from gspo.config import SFTConfig, TrainConfig, config_help


def _config_parser(sub, name: str, cls, summary: str):
    p = sub.add_parser(name, help=summary, description=summary, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="config fields (YAML keys and key=value overrides):\n" + config_help(cls))
    p.add_argument("--config", help="YAML file whose keys are config field names")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides; they win over the YAML file")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gspo", description="Stable RL post-training: GSPO, GRPO, MoE routing replay.")
    sub = parser.add_subparsers(dest="command", required=True)
    _config_parser(sub, "train", TrainConfig, "RL training (GSPO by default) of a causal LM")
    _config_parser(sub, "sft", SFTConfig, "cold-start supervised fine-tuning on prompt/answer pairs")
    p = sub.add_parser("eval", help="held-out accuracy of a saved model on a built-in task or dataset")
    p.add_argument("--model", required=True, help="saved model directory or preset")
    p.add_argument("--task", default="add3", help="built-in task (default add3)")
    p.add_argument("--dataset", default=None, help="local dataset instead of a task (needs an answer column)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--k", type=int, default=4, help="samples per prompt for mean@k / pass@k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("plot", help="draw PNG plots from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p = sub.add_parser("demo", help="cold-start SFT, then GSPO, then held-out evaluation and plots, on CPU")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--objective", default="gspo", help="gspo (default) or grpo, ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except ValueError as err:  # configuration and input errors: one clear line, no traceback
        print(f"gspo {args.command}: error: {err}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from transformers.utils import logging as hf_logging

    from gspo.config import load_config

    hf_logging.disable_progress_bar()  # our own progress bar is enough

    if args.command == "train":
        from gspo.report import plot_run
        from gspo.trainer import train

        cfg = load_config(TrainConfig, args.config, args.overrides)
        summary = train(cfg)
        plots = plot_run(cfg.output_dir)
        print(json.dumps({"evals": summary["evals"], "seconds": round(summary["seconds"], 1),
                          "model": f"{cfg.output_dir}/model", "plots": [str(p) for p in plots]}, indent=2))
    elif args.command == "sft":
        from gspo.sft import sft

        cfg = load_config(SFTConfig, args.config, args.overrides)
        print(json.dumps(sft(cfg), indent=2))
    elif args.command == "eval":
        from gspo.config import make_config
        from gspo.data import load_splits
        from gspo.evaluation import evaluate
        from gspo.trainer import seeded_model

        cfg = make_config(TrainConfig, {"model": args.model, "task": None if args.dataset else args.task,
                                        "dataset": args.dataset, "eval_num_prompts": args.num_prompts,
                                        "eval_k": args.k, "eval_temperature": args.temperature,
                                        "max_completion_length": args.max_completion_length, "seed": args.seed})
        _, model, tokenizer = seeded_model(cfg)
        _, rows = load_splits(cfg, tokenizer, num_train=0)
        print(json.dumps(evaluate(model, tokenizer, rows, cfg), indent=2))
    elif args.command == "plot":
        from gspo.report import plot_run

        for path in plot_run(args.run_dir):
            print(path)
    elif args.command == "demo":
        from gspo.demo import run_demo

        run_demo(args.output_dir, seed=args.seed, objective=args.objective)
    return 0


if __name__ == "__main__":
    sys.exit(main())
