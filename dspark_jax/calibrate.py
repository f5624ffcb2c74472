"""Fit Sequential Temperature Scaling (DESIGN.md 2.6) for a DSpark drafter's confidence head.

    python -m dspark_jax.calibrate --drafter runs/dspark_smollm2-135m/drafter [--sets gsm8k,humaneval,...]

Runs speculative decoding with FULL-length verification (every round verifies all gamma draft
tokens) on held-out prompts (the eval split: never training prompts), records each round's raw
confidence logits and accepted length, fits per-position temperatures left to right, stores them
in the drafter checkpoint, and writes a report (JSON) plus reliability diagrams (PNG): ECE and
ROC-AUC per position before and after. Half the rounds fit the temperatures, the other half
measure them, so the "after" numbers are out of sample.

Several processes (the multi-process flags, `dspark_jax.distributed.runtime`), each started with
the same command, share the decoding: batch b on process b % N with its one-process prompts and
seed, the rounds gathered back in batch order; process 0 alone fits, writes and prints.
"""

from __future__ import annotations

import json
import sys

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, flag, run_cli, setting_flag
from dspark_jax.distributed import gather, runtime
from dspark_jax.evaluation import sts_fit


@run_cli
def main(argv: list[str] | None = None) -> int:
    from dspark_jax.engine.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder (updated in place)")
    p.add_argument("--target", default=None, help="target (default: the one recorded in the drafter)")
    p.add_argument("--sets", default="gsm8k,math500,humaneval,mbpp,arena-hard-v2",
                   help="prompt sets; their EVAL split is used")
    p.add_argument("--limit", type=POSITIVE_INT, default=16,
                   help="prompts per set: the LAST N of its eval split (`eval` takes the first N, so "
                        "calibration and evaluation prompts stay disjoint while 2N <= the split size)")
    p.add_argument("--save-to", default=None,
                   help="write the calibrated drafter to this folder instead of updating --drafter in place")
    p.add_argument("--storage-dtype", default=None, choices=["float32", "bfloat16"],
                   help="weight storage of the written drafter (default: as loaded; bfloat16 halves the size)")
    p.add_argument("--max-new-tokens", type=flag(int, ge=2), default=128)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=1.0)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--out", default=None, help="report folder (default: DRAFTER/calibration)")
    p.add_argument("--no-progress", action="store_true")
    runtime.add_distributed_flags(p)
    args = p.parse_args(argv)
    runtime.initialize(args)  # before anything touches devices

    summary = sts_fit.calibrate_drafter(args)
    if gather.is_primary():
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
