"""benchmarks/bench_speedup.py: decode's defaults, and the speed goals judged per cell."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_speedup  # noqa: E402


def test_defaults_are_decode_s():
    args = bench_speedup.parse_args(["--drafter", "d"])
    assert (args.scheduler, args.plain_steps) == ("auto", "on")
    args = bench_speedup.parse_args(["--drafter", "d", "--scheduler", "fixed"])
    assert (args.scheduler, args.plain_steps) == ("fixed", "off")
    assert bench_speedup.parse_args(["--drafter", "d", "--scheduler", "fixed", "--plain-steps", "on"]).plain_steps == "on"


def test_goals_need_every_cell():
    def cell(batch, temperature, domain, speedup):
        return {"batch": batch, "temperature": temperature, "domain": domain, "speedup": speedup}

    rows = [cell(1, 0.0, "math", 1.6), cell(1, 0.0, "code", 1.49), cell(1, 0.0, "chat", 1.0),
            cell(8, 0.0, "math", 1.2), cell(8, 1.0, "chat", 0.96)]
    lines = bench_speedup.goal_lines(rows)
    assert len(lines) == 4  # no T = 1 batch-1 cell was measured: that goal is not reported
    assert lines[0].startswith("Goal >= 1.5x at batch 1, T = 0 on math / code: NOT met")
    assert lines[1].startswith("Goal >= 1x at batch 1, T = 0 on chat: met")
    # batch 8 on average: sqrt(1.2 x 0.96) = 1.07 meets it, but the 0.96x cell is under the floor
    assert lines[2].startswith("Goal >= 1x on average at batch 8 on math / code / chat: met (geometric mean 1.07x")
    assert lines[3] == "No cell below 0.97x: NOT met (chat batch 8 T=1 0.96x)."
    rows[1]["speedup"], rows[4]["speedup"] = 1.5, 0.97
    assert all(": met" in line for line in bench_speedup.goal_lines(rows))


def test_batch8_goal_is_the_mean():
    rows = [{"batch": 8, "temperature": t, "domain": "math", "speedup": s} for t, s in ((0.0, 1.01), (1.0, 0.98))]
    assert "NOT met" in bench_speedup.goal_lines(rows)[0]  # geometric mean 0.995x
    rows[1]["speedup"] = 0.995
    assert all(": met" in line for line in bench_speedup.goal_lines(rows))
