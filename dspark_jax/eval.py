"""Evaluate and compare drafters by speculative decoding with fixed-length verification (DESIGN.md 5).

    python -m dspark_jax.eval --drafters dspark=runs/dspark/drafter,dflash=runs/dflash/drafter --out runs/eval

Every round verifies all gamma draft tokens (scheduler "fixed"), so the numbers measure draft
quality, not a verification policy. Prompts are the EVAL split of the benchmark sets (never
training prompts) plus any `--bench NAME=PATH[:DOMAIN]` JSONL file, chat-templated; every drafter
sees the same prompts with the same seeds. Per drafter, benchmark, domain and overall: tau (mean
accepted + 1 per round, bonus included), position-wise conditional acceptance, verified and
accepted draft tokens; with a confidence head also per-position calibration (ECE, ROC-AUC; raw and
after the drafter's stored STS temperatures) and the static-threshold sweep. Writes
OUT/eval.json (every number), OUT/eval.md (tables) and PNG plots, and prints the comparison table
(the paper's Table 1 layout: tau and relative gain over the baseline drafter).
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, flag, run_cli, setting_flag
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather, runtime
from dspark_jax.evaluation import benchmark
from dspark_jax.evaluation import report as report_files
from dspark_jax.evaluation.benchmark import DEFAULT_SETS, DEFAULT_THRESHOLDS, OTHER


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET
    from dspark_jax.engine.speculative import SpecConfig
    from dspark_jax.engine.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.eval", description=__doc__.split("\n")[0])
    p.add_argument("--drafters", required=True,
                   help="comma-separated drafter folders, each optionally labelled NAME=DIR")
    p.add_argument("--baseline", default=None, help="drafter the relative gains refer to (default: the first)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="known name, Hugging Face folder or .gguf file")
    p.add_argument("--sets", default=None,
                   help=f"prompt sets, domains or 'all' (EVAL split); default {DEFAULT_SETS}, "
                        "or none when --bench is given; 'none' for none")
    p.add_argument("--bench", action="append", default=[], metavar="NAME=PATH[:DOMAIN]",
                   help='extra benchmark: a {"turns": [...]} JSONL file (all of it; domain math, code, chat '
                        f"or {OTHER}, default {OTHER}); repeatable")
    p.add_argument("--limit", type=POSITIVE_INT, default=20, help="prompts per benchmark (the first N)")
    p.add_argument("--gamma", type=setting_flag(SpecConfig, "gamma"), default=None,
                   help="draft tokens per round (default: each drafter's block)")
    p.add_argument("--max-new-tokens", type=flag(int, ge=2), default=256)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=1.0,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights' dtype; bfloat16 keeps fp32 activations on a CPU and is much faster "
                        "for verify passes and batches on CPUs with AMX or AVX512-BF16 (docs/results.md section 9)")
    p.add_argument("--thresholds", default=",".join(map(str, DEFAULT_THRESHOLDS)),
                   help="prefix-survival thresholds of the static-threshold sweep")
    p.add_argument("--bins", type=POSITIVE_INT, default=10, help="equal-width bins for ECE and reliability diagrams")
    p.add_argument("--out", required=True, help="results folder (eval.json, eval.md, *.png)")
    p.add_argument("--no-progress", action="store_true")
    runtime.add_distributed_flags(p)
    args = p.parse_args(argv)
    try:
        args.thresholds = [float(h) for h in args.thresholds.split(",") if h.strip()]
    except ValueError:
        raise UserError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    if not args.thresholds or not all(0 <= h <= 1 for h in args.thresholds):
        raise UserError("--thresholds must be numbers in [0, 1]")
    return args


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.initialize(args)  # before anything touches devices
    report, benches = benchmark.evaluate(args)
    plots = gather.on_primary(lambda: report_files.write_report(report, benches, args.out))
    if not gather.is_primary():
        return 0
    print("\n".join(report_files.table1(report, benches)))
    print(f"\nwrote {os.path.join(args.out, 'eval.json')}, {os.path.join(args.out, 'eval.md')} "
          f"and {len(plots)} plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
