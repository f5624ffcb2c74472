"""Where the test suite's time goes, per file, from pytest's `--durations=0` report (stdlib only).

    python -m pytest --durations=0 -q > suite.log; python tests/durations.py suite.log [--top 15]

Prints a markdown table: per test file, its tests, seconds in calls and in set-up / teardown (module
and session fixtures land in the set-up of the first test that needs them), and the slowest call;
then the suite's total and the slowest single items.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

LINE = re.compile(r"^\s*([0-9.]+)s (call|setup|teardown)\s+(\S+)")


def parse(text: str) -> list[tuple[float, str, str]]:
    """(seconds, phase, node id) of every line of the durations report."""
    return [(float(m[1]), m[2], m[3]) for m in map(LINE.match, text.splitlines()) if m]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--top", type=int, default=15, help="also list this many slowest items")
    args = p.parse_args(argv)
    items = parse(open(args.log, errors="replace").read())
    if not items:
        sys.exit(f"error: no --durations lines in {args.log}")
    per_file = collections.defaultdict(lambda: {"tests": set(), "call": 0.0, "fixtures": 0.0, "slowest": (0.0, "")})
    for seconds, phase, node in items:
        row = per_file[node.split("::")[0]]
        row["tests"].add(node)
        if phase == "call":
            row["call"] += seconds
            row["slowest"] = max(row["slowest"], (seconds, node.split("::", 1)[-1]))
        else:
            row["fixtures"] += seconds
    total = sum(s for s, _, _ in items)
    print("| file | tests | calls s | set-up + teardown s | total s | share | slowest call |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, row in sorted(per_file.items(), key=lambda kv: -(kv[1]["call"] + kv[1]["fixtures"])):
        spent = row["call"] + row["fixtures"]
        slow_s, slow_name = row["slowest"]
        print(f"| {name} | {len(row['tests'])} | {row['call']:.0f} | {row['fixtures']:.0f} | {spent:.0f} | "
              f"{100 * spent / total:.1f}% | {slow_name[:70]} ({slow_s:.0f} s) |")
    print(f"\n{len({n for _, _, n in items})} tests, {total:.0f} s in calls and fixtures ({total / 60:.1f} min)")
    if args.top:
        print(f"\nSlowest {args.top}:\n")
        for seconds, phase, node in sorted(items, reverse=True)[:args.top]:
            print(f"- {seconds:.1f} s {phase} {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
