"""`python -m dspark_jax.plot_metrics RUN_DIR [--out DIR]`: PNG training curves of a run.

Reads RUN_DIR/metrics.jsonl (the trainer's log; RUN_DIR may also be the .jsonl file itself) and
writes loss.png, expected_tau.png, grad_norm.png, blocks_per_s.png and per_position.png (those
whose metrics were logged) to DIR (default RUN_DIR/plots), printing one path per line. A missing,
empty or corrupt log is one `error: ...` line and exit status 2. Works on a run that is still
training (a half-written last line is skipped).

With several RUN_DIRs (e.g. DSpark and DFlash trained on the same data and budget) it also writes
DIR/teacher_forced_acceptance.png: the last held-out (eval_) per-position acceptance
sum_v min(q, p) of each run, one line per run, and prints it as a Markdown table. DIR is then
required, and each run's own curves go to DIR/<run name>/. When the runs span several block sizes
(a gamma sweep) it also writes DIR/expected_tau_by_block_size.png: the last held-out expected tau
of each run against its gamma, one line per drafter family (from RUN_DIR/drafter/drafter.json:
DSpark with its head, DFlash, Eagle3), and prints that table too.
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark_jax.core import files
from dspark_jax.core.cli import ArgumentParser, run_cli
from dspark_jax.core.errors import UserError

METRICS_FILE = "metrics.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m dspark_jax.plot_metrics",
                       description="Plot the training curves of a run's metrics.jsonl as PNG files.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help=f"training run folder holding {METRICS_FILE} (or the file)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default: RUN_DIR/plots; required with several runs)")
    return p.parse_args(argv)


def metrics_path(run: str) -> tuple[str, str]:
    """(metrics.jsonl path, run folder) of a RUN_DIR argument (a local path or a gs:// URL)."""
    if files.is_dir(run):
        path = os.path.join(run, METRICS_FILE)
        if not files.exists(path):
            raise UserError(f"no {METRICS_FILE} in {run} (not a training run folder, or nothing logged yet)")
        return path, run
    if files.exists(run):
        return run, os.path.dirname(files.absolute(run))
    raise UserError(f"no such run folder: {run}")


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = [metrics_path(r) for r in args.run_dirs]
    if len(runs) > 1 and args.out is None:
        raise UserError("--out is required when comparing several runs")
    out_dir = args.out if args.out is not None else os.path.join(runs[0][1], "plots")
    if files.exists(out_dir) and not files.is_dir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not a folder")
    names = [os.path.basename(os.path.normpath(run_dir)) for _, run_dir in runs]
    if len(set(names)) != len(names):
        raise UserError(f"run folder names must differ to label them: {', '.join(names)}")

    from dspark_jax.evaluation.plots import (  # matplotlib only once the inputs are known good
        acceptance_curves, final_per_position, read_metrics, training_curves)

    curves = {}
    try:
        for (log_path, _), name in zip(runs, names):
            paths = training_curves(log_path, out_dir if len(runs) == 1 else os.path.join(out_dir, name))
            if not paths:
                raise UserError(f"{log_path} holds no plottable metrics (loss, expected_tau, grad_norm, ...)")
            print("\n".join(paths))
            found = final_per_position(read_metrics(log_path), "acceptance_per_position")
            if found is not None:
                curves[name] = found
        if len(runs) > 1:
            if len(curves) < len(runs):
                missing = sorted(set(names) - set(curves))
                raise UserError(f"no per-position acceptance logged in: {', '.join(missing)}")
            print(acceptance_curves({f"{n} ({key}, step {step})": v for n, (v, key, step) in curves.items()},
                                    os.path.join(out_dir, "teacher_forced_acceptance.png"),
                                    title="Teacher-forced acceptance per draft position",
                                    ylabel="sum_v min(q, p) at position k"))
    except OSError as e:
        raise UserError(f"cannot write plots to {out_dir}: {e.strerror or e}") from None
    if len(runs) > 1:
        block_size_sweep([run_dir for _, run_dir in runs], names, curves, out_dir)
        gamma = max(len(v) for v, _, _ in curves.values())
        print("\n| run | " + " | ".join(f"k={k}" for k in range(1, gamma + 1)) + " |")
        print("|---|" + "---|" * gamma)
        for name, (v, key, step) in curves.items():
            print(f"| {name} ({key}, step {step}) | " + " | ".join(f"{x:.3f}" for x in v) + " |")
    return 0


def drafter_family(run_dir: str, name: str) -> str:
    """DSpark (<head>) / DFlash / Eagle3 from the run's exported drafter.json, else the run's name."""
    import json

    try:
        d = json.loads(files.read_bytes(os.path.join(run_dir, "drafter", "drafter.json")))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return name
    if d.get("kind") == "eagle3":
        return "Eagle3"
    return "DFlash" if d.get("head", "none") == "none" else f"DSpark ({d['head']})"


def block_size_sweep(run_dirs: list[str], names: list[str], curves: dict, out_dir: str) -> None:
    """expected_tau_by_block_size.png and its table when the runs cover several block sizes."""
    from dspark_jax.evaluation.plots import read_metrics, tau_by_block_size

    if len({len(v) for v, _, _ in curves.values()}) < 2:
        return
    families: dict = {}
    for run_dir, name in zip(run_dirs, names):
        records = read_metrics(metrics_path(run_dir)[0])
        taus = [r[k] for k in ("eval_expected_tau", "expected_tau") for r in reversed(records) if k in r]
        if taus:
            families.setdefault(drafter_family(run_dir, name), []).append((len(curves[name][0]), float(taus[0])))
    print(tau_by_block_size(families, os.path.join(out_dir, "expected_tau_by_block_size.png")))
    gammas = sorted({g for points in families.values() for g, _ in points})
    print("\n| drafter | " + " | ".join(f"gamma={g}" for g in gammas) + " |")
    print("|---|" + "---|" * len(gammas))
    for family, points in families.items():
        got = dict(points)
        print(f"| {family} | " + " | ".join(f"{got[g]:.3f}" if g in got else "-" for g in gammas) + " |")


if __name__ == "__main__":
    sys.exit(main())
