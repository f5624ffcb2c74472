"""`python -m dspark_jax.plot_metrics RUN_DIR [--out DIR]`: PNG training curves of a run.

Reads RUN_DIR/metrics.jsonl (the trainer's log; RUN_DIR may also be the .jsonl file itself) and
writes loss.png, expected_tau.png, grad_norm.png, blocks_per_s.png and per_position.png (those
whose metrics were logged) to DIR (default RUN_DIR/plots), printing one path per line. A missing,
empty or corrupt log is one `error: ...` line and exit status 2. Works on a run that is still
training (a half-written last line is skipped).
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark_jax.cli import run_cli
from dspark_jax.errors import UserError

METRICS_FILE = "metrics.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.plot_metrics",
                                description="Plot the training curves of a run's metrics.jsonl as PNG files.")
    p.add_argument("run_dir", metavar="RUN_DIR", help=f"training run folder holding {METRICS_FILE} (or the file)")
    p.add_argument("--out", metavar="DIR", default=None, help="output folder (default: RUN_DIR/plots)")
    return p.parse_args(argv)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.path.isfile(args.run_dir):
        log_path, run_dir = args.run_dir, os.path.dirname(os.path.abspath(args.run_dir))
    elif os.path.isdir(args.run_dir):
        log_path, run_dir = os.path.join(args.run_dir, METRICS_FILE), args.run_dir
        if not os.path.exists(log_path):
            raise UserError(f"no {METRICS_FILE} in {args.run_dir} (not a training run folder, or nothing logged yet)")
    else:
        raise UserError(f"no such run folder: {args.run_dir}")
    out_dir = args.out if args.out is not None else os.path.join(run_dir, "plots")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not a folder")

    from dspark_jax.evaluation.plots import training_curves  # matplotlib only once the inputs are known good

    try:
        paths = training_curves(log_path, out_dir)
    except OSError as e:
        raise UserError(f"cannot write plots to {out_dir}: {e.strerror or e}") from None
    if not paths:
        raise UserError(f"{log_path} holds no plottable metrics (loss, expected_tau, grad_norm, ...)")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
