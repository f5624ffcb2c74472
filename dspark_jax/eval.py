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

import os
import sys

from dspark_jax.core.cli import ArgumentParser, add_settings, run_cli, settings_from
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather, runtime
from dspark_jax.distributed.runtime import ProcessSettings
from dspark_jax.evaluation import benchmark
from dspark_jax.evaluation import report as report_files
from dspark_jax.evaluation.benchmark import DEFAULT_THRESHOLDS, EvalSettings


def parse_args(argv: list[str] | None) -> tuple[EvalSettings, ProcessSettings]:
    """The evaluation's settings from the command line (each flag's type, range, default and help are
    its EvalSettings field's) and how this process joins a multi-process run."""
    p = ArgumentParser(prog="python -m dspark_jax.eval", description=__doc__.split("\n")[0])
    sweep = ",".join(map(str, DEFAULT_THRESHOLDS))  # one comma-separated flag, not a repeated one
    add_settings(p, EvalSettings, thresholds=dict(action="store", type=str, default=sweep))
    add_settings(p, ProcessSettings)
    args = p.parse_args(argv)
    try:
        thresholds = [float(h) for h in args.thresholds.split(",") if h.strip()]
    except ValueError:
        raise UserError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    if not thresholds or not all(0 <= h <= 1 for h in thresholds):
        raise UserError("--thresholds must be numbers in [0, 1]")
    return settings_from(EvalSettings, args, thresholds=thresholds), settings_from(ProcessSettings, args)


@run_cli
def main(argv: list[str] | None = None) -> int:
    settings, processes = parse_args(argv)
    runtime.initialize(processes)  # before anything touches devices
    report, benches = benchmark.evaluate(settings)
    plots = gather.on_primary(lambda: report_files.write_report(report, benches, settings.out))
    if not gather.is_primary():
        return 0
    print("\n".join(report_files.table1(report, benches)))
    print(f"\nwrote {os.path.join(settings.out, 'eval.json')}, {os.path.join(settings.out, 'eval.md')} "
          f"and {len(plots)} plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
