"""The bookkeeping of `launch/smollm2_drafter.sh`'s training sittings (stdlib only).

    python launch/smollm2_sitting.py start-id DRAFTER          # a short id of a drafter's weights
    python launch/smollm2_sitting.py verdict RUN               # exit 0 if RUN beat its start
    python launch/smollm2_sitting.py record RUN --wall-s S --shipped 0|1 [--log FILE]
    python launch/smollm2_sitting.py table [--log FILE]        # the sittings as a markdown table

A sitting trains from the drafter the repository ships (`optim.init_from_drafter`) for a wall-clock
budget. Its run's metrics.jsonl opens with that drafter's held-out score (step 0) and closes with
the run's, on the same held-out batches: the run's drafter replaces the shipped one only when its
expected tau is higher. Each sitting appends one row to the sittings log, committed beside the data.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

LOG = "datasets/smollm2-135m/sittings.jsonl"


def start_id(drafter: str) -> str:
    """The first 12 hex digits of the sha256 of the drafter's weights file: a run is named after the
    drafter it starts from, so a new sitting continues it only while that drafter is still shipped."""
    with open(os.path.join(drafter, "drafter.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def held_out(run: str) -> tuple[dict, dict]:
    """(the step-0 record, the last evaluated record) of RUN's metrics.jsonl."""
    path = os.path.join(run, "metrics.jsonl")
    try:
        records = [json.loads(line) for line in open(path) if line.strip()]
    except FileNotFoundError:
        sys.exit(f"error: {path} does not exist (has the sitting trained?)")
    evaluated = [r for r in records if "eval_expected_tau" in r]
    if not evaluated or evaluated[0]["step"] != 0:
        sys.exit(f"error: {path} holds no step-0 evaluation of the starting drafter (data.eval_dir unset?)")
    return evaluated[0], evaluated[-1]


def machine() -> str:
    name = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"
    return f"{name}, {os.cpu_count()} cores, {isa}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python launch/smollm2_sitting.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("start-id").add_argument("drafter")
    sub.add_parser("verdict").add_argument("run")
    rec = sub.add_parser("record")
    rec.add_argument("run")
    rec.add_argument("--wall-s", type=float, required=True)
    rec.add_argument("--shipped", type=int, choices=(0, 1), required=True)
    rec.add_argument("--log", default=LOG)
    rec.add_argument("--lever", default="recipe", help="the arm's name (LEVER), 'recipe' for the plain recipe")
    rec.add_argument("--overrides", default="", help="the arm's extra train overrides (TRAIN_OVERRIDES)")
    table = sub.add_parser("table")
    table.add_argument("--log", default=LOG)
    args = p.parse_args(argv)

    if args.command == "start-id":
        print(start_id(args.drafter))
    elif args.command == "verdict":
        start, end = held_out(args.run)
        better = end["step"] > 0 and end["eval_expected_tau"] > start["eval_expected_tau"]
        print(f"held-out expected tau {start['eval_expected_tau']:.4f} at the start, {end['eval_expected_tau']:.4f} "
              f"at step {end['step']}: {'better' if better else 'not better'}")
        return 0 if better else 1
    elif args.command == "record":
        start, end = held_out(args.run)
        row = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                   machine=machine(), run=os.path.basename(os.path.normpath(args.run)), steps=end["step"],
                   wall_h=round(args.wall_s / 3600, 2), cpu_h=round(args.wall_s * (os.cpu_count() or 1) / 3600, 2),
                   tau_start=round(start["eval_expected_tau"], 4), tau_end=round(end["eval_expected_tau"], 4),
                   acceptance_end=[round(a, 3) for a in end.get("eval_acceptance_per_position", [])],
                   shipped=bool(args.shipped), lever=args.lever, overrides=args.overrides)
        os.makedirs(os.path.dirname(args.log) or ".", exist_ok=True)
        rows = [json.loads(line) for line in open(args.log) if line.strip()] if os.path.exists(args.log) else []
        if args.wall_s == 0 and rows and rows[-1]["run"] == row["run"]:
            # no training this time (BUDGET_S=0): the run's own row, recorded when it trained, gets the verdict
            rows[-1]["shipped"] = row["shipped"]
            row = rows[-1]
            with open(args.log + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            os.replace(args.log + ".tmp", args.log)
        else:
            with open(args.log, "a") as f:
                f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    else:
        rows = [json.loads(line) for line in open(args.log) if line.strip()] if os.path.exists(args.log) else []
        print("| date (UTC) | machine | run | lever | steps | wall h | CPU h | held-out tau: start -> end | "
              "acceptance per position at the end | shipped |")
        print("|---|---|---|---|---:|---:|---:|---|---|---|")
        for r in rows:
            lever = r.get("lever", "recipe") + (f" (`{r['overrides']}`)" if r.get("overrides") else "")
            print(f"| {r['date']} | {r['machine']} | {r['run']} | {lever} | {r['steps']} | {r['wall_h']} | {r['cpu_h']} | "
                  f"{r['tau_start']:.3f} -> {r['tau_end']:.3f} | {' '.join(f'{a:.2f}' for a in r['acceptance_end'])} "
                  f"| {'yes' if r['shipped'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
