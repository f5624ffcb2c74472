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

from dspark_jax.core.cli import ArgumentParser, add_settings, run_cli, settings_from
from dspark_jax.distributed import gather, runtime
from dspark_jax.distributed.runtime import ProcessSettings
from dspark_jax.evaluation import sts_fit


@run_cli
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dspark_jax.calibrate", description=__doc__.split("\n")[0])
    add_settings(p, sts_fit.CalibrateSettings)
    add_settings(p, ProcessSettings)
    args = p.parse_args(argv)
    runtime.initialize(settings_from(ProcessSettings, args))  # before anything touches devices

    summary = sts_fit.calibrate_drafter(settings_from(sts_fit.CalibrateSettings, args))
    if gather.is_primary():
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
