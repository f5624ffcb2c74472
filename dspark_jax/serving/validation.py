"""Check the simulator against a measured `benchmarks/bench_serving.py` run.

For every measured cell (scheduler, C) the simulator replays the same situation: C slots serving
the bench's first C prompts (slot i = request i of the round records, which `simulate record`
takes from the same prompt list), the scheduler's real function with the bench's threshold and
gamma, as many rounds as the bench measured in its steady state, each episode starting from the
engine's initial scheduler state. Many such episodes give the simulated mean and the spread a
bench-length run has from sampling alone (which rounds a short run happens to see).

The round cost comes, by default, from the same bench JSON (`MeasuredRoundCurve`: round times of
the cells whose verify size is known exactly), so for those "anchor" cells only tau is predicted
and the throughput error is the tau error; the other cells (threshold, dspark, dspark-async in
general) are predicted end to end: their verify lengths, tau and round cost. With --sps-table the
SPS tables of the benchmark's machine time the rounds instead (they must be profiled on the same
machine as the benchmark; `.dspark_cache/` of that run).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dspark_jax.core.errors import UserError
from dspark_jax.serving.hardware import HardwareCurve, MeasuredRoundCurve
from dspark_jax.serving.rounds import RoundPool
from dspark_jax.serving.simulator import POLICIES, SimConfig, run_concurrency, summarize

TIMING_NOISE = 0.10  # relative run-to-run timing noise of a bench_serving cell on the 2-core CPU:
# docs/results.md section 6 reports ~5-15% per cell between runs of the same measurement.


def bench_settings(bench: dict, path: str = "") -> dict:
    try:
        s = bench["settings"]
        rows = bench["rows"]
        int(s["gamma"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{path or 'bench JSON'} is not a bench_serving results JSON (settings.gamma, rows)") from None
    for r in rows:
        if r.get("scheduler") not in POLICIES:
            raise UserError(f"{path}: unknown scheduler {r.get('scheduler')!r}")
        if "steady_rounds" not in r:
            raise UserError(f"{path}: rows lack steady-state fields (steady_rounds, steady_s): measured by an older "
                            "bench_serving; re-run it")
    return s


def _cell_runs(pool: RoundPool, curve: HardwareCurve, c: int, policies, threshold: float, rounds: int,
               episodes: int, seed: int) -> dict[str, dict]:
    """Traces of the three sampling models at one concurrency (replay ones only for recorded pools)."""
    base = dict(policies=policies, threshold=threshold, warmup=0, pin_requests=True, seed=seed)
    runs = {"iid": run_concurrency(pool, curve, c, SimConfig(sampling="iid", episodes=episodes, **base),
                                   rounds=rounds, episodes=episodes)}
    if pool.position is not None:  # deterministic given the records: one episode each
        for name, shift in (("replay", True), ("replay_nearest", False)):
            runs[name] = run_concurrency(pool, curve, c, SimConfig(sampling="replay", replay_shift=shift, **base),
                                         rounds=rounds, episodes=1)
    return runs


def validate(bench: dict, pool: RoundPool, *, curve: HardwareCurve | None = None, episodes: int = 200,
             seed: int = 0, bench_path: str = "", timing_noise: float = TIMING_NOISE) -> dict[str, Any]:
    """Every measured cell next to the simulator's predictions (module docstring).

    Models: "replay" (recorded pools: slot i replays request i, drafting the remainder of the
    recorded round it is inside; the prediction), "replay_nearest" (the recorded round as is: the
    optimistic bracket), "iid" (request i's rounds drawn at random; its spread over `episodes`
    bench-length runs is the sampling noise of a run that short, and for synthetic pools its mean
    is the prediction)."""
    s = bench_settings(bench, bench_path)
    gamma = int(s["gamma"])
    if pool.gamma != gamma:
        pool = pool.truncated(gamma)
    curve = curve or MeasuredRoundCurve.from_bench(bench, bench_path)
    if curve.gamma != gamma:
        raise UserError(f"the hardware curve is for gamma {curve.gamma}, the benchmark for {gamma}")
    src = pool.source
    if src.get("kind") == "records":
        for key in ("temperature", "max_new_tokens"):
            if key in s and src.get(key) is not None and float(src[key]) != float(s[key]):
                raise UserError(f"the round records were made with {key} {src[key]}, the benchmark with {s[key]}")
    by_c: dict[int, list[dict]] = {}
    for r in bench["rows"]:
        by_c.setdefault(int(r["concurrency"]), []).append(r)
    n_req = len(pool.requests)
    cells = []
    for c, measured in sorted(by_c.items()):
        recorded = src.get("kind") == "records"
        if recorded and n_req < c:
            raise UserError(f"the round pool holds {n_req} requests; the benchmark's C = {c} served {c} prompts "
                            f"(record at least {c} prompts)")
        sub = pool.subset_requests(pool.requests[:c]) if recorded else pool
        policies = tuple(dict.fromkeys(r["scheduler"] for r in measured))
        R = max(int(r["steady_rounds"]) for r in measured)
        runs = _cell_runs(sub, curve, c, policies, float(s.get("threshold", 0.5)), R, episodes, seed)
        anchors = curve.anchor_cells(c) if isinstance(curve, MeasuredRoundCurve) else set()
        for r in measured:
            p, rp = r["scheduler"], int(r["steady_rounds"])
            sims = {name: summarize(tr[p], 0, rp) for name, tr in runs.items()}
            main = sims.get("replay", sims["iid"])
            iid = sims["iid"]
            sd_rel = iid["episode_sd"] / iid["aggregate_tokens_per_s"]
            err = main["aggregate_tokens_per_s"] / r["aggregate_tokens_per_s"] - 1
            band = timing_noise + 2 * sd_rel
            lo = min(x["aggregate_tokens_per_s"] for x in sims.values() if x is not iid or "replay" not in sims)
            hi = max(x["aggregate_tokens_per_s"] for x in sims.values() if x is not iid or "replay" not in sims)
            cell = {
                "scheduler": p, "concurrency": c, "steady_rounds": rp, "time_anchor": p in anchors,
                "model": "replay" if "replay" in sims else "iid",
                "measured_aggregate_tokens_per_s": r["aggregate_tokens_per_s"],
                "simulated_aggregate_tokens_per_s": main["aggregate_tokens_per_s"],
                "aggregate_rel_error": err, "aggregate_band": band, "aggregate_within_noise": abs(err) <= band,
                "bracket": [lo, hi],
                "in_bracket": lo * (1 - timing_noise) <= r["aggregate_tokens_per_s"] <= hi * (1 + timing_noise),
                "iid_sd_bench_length": iid["episode_sd"],
                "measured_tau": r["tau"], "simulated_tau": main["tau"], "iid_tau_sd": iid["tau_sd_episodes"],
                "tau_rel_error": main["tau"] / r["tau"] - 1,
                "tau_within_2sd": abs(main["tau"] - r["tau"]) <= 2 * iid["tau_sd_episodes"] + 1e-9,
                "measured_verify_budget": r["verify_budget"], "simulated_verify_budget": main["verify_budget"],
                "measured_verify_tokens_per_round": r["verify_tokens_per_round"],
                "simulated_verify_tokens_per_round": main["verify_tokens_per_round"],
                "measured_round_ms": 1e3 * r["steady_s"] / r["steady_rounds"], "simulated_round_ms": main["round_ms"],
            }
            for name, x in sims.items():
                cell[f"{name}_aggregate_tokens_per_s"] = x["aggregate_tokens_per_s"]
                cell[f"{name}_tau"] = x["tau"]
                cell[f"{name}_verify_budget"] = x["verify_budget"]
            cells.append(cell)
    return {"bench": bench_path, "bench_command": bench.get("command"), "bench_date": bench.get("date"),
            "bench_machine": bench.get("machine"), "bench_settings": s, "episodes": episodes, "seed": seed,
            "timing_noise": timing_noise, "hardware": curve.describe(),
            "pool": {"source": src, "rounds": len(pool.accepted), "requests": n_req, "full_tau": pool.full_tau()},
            "cells": cells, "summary": summary(cells)}


def summary(cells: Sequence[dict]) -> dict[str, Any]:
    def stats(sel):
        errs = [abs(c["aggregate_rel_error"]) for c in sel]
        return {"cells": len(sel), "within_noise": sum(c["aggregate_within_noise"] for c in sel),
                "tau_within_2sd": sum(c["tau_within_2sd"] for c in sel),
                "mean_abs_error": float(np.mean(errs)) if errs else None,
                "max_abs_error": float(np.max(errs)) if errs else None}

    # does the simulator rank the policies as the measurement does (per C: the best and the worst)?
    ranks = []
    for c in sorted({x["concurrency"] for x in cells}):
        mine = [x for x in cells if x["concurrency"] == c]
        best_m = max(mine, key=lambda x: x["measured_aggregate_tokens_per_s"])["scheduler"]
        best_s = max(mine, key=lambda x: x["simulated_aggregate_tokens_per_s"])["scheduler"]
        worst_m = min(mine, key=lambda x: x["measured_aggregate_tokens_per_s"])["scheduler"]
        worst_s = min(mine, key=lambda x: x["simulated_aggregate_tokens_per_s"])["scheduler"]
        ranks.append({"concurrency": c, "best_measured": best_m, "best_simulated": best_s,
                      "worst_measured": worst_m, "worst_simulated": worst_s})
    bias = {p: float(np.mean([c["aggregate_rel_error"] for c in cells if c["scheduler"] == p]))
            for p in dict.fromkeys(c["scheduler"] for c in cells)}
    return {"all": stats(cells), "predicted_end_to_end": stats([c for c in cells if not c["time_anchor"]]),
            "time_anchors": stats([c for c in cells if c["time_anchor"]]), "ranking": ranks,
            "mean_signed_error_by_policy": bias}


def validation_markdown(head: str, results: Sequence[dict]) -> str:
    md = [head.rstrip("\n"), ""]
    for res in results:
        b = res["bench_machine"] or {}
        src = res["pool"]["source"]
        md += [f"## Against `{res['bench']}`", "",
               f"Measured: `{res['bench_command']}` on {b.get('cpu')}, {b.get('cores')} cores, JAX {b.get('jax')}, "
               f"{res['bench_date']}.  ",
               f"Drafter statistics: {src.get('kind')} `{src.get('path')}` ({res['pool']['rounds']} rounds of "
               f"{res['pool']['requests']} requests, full-length tau {res['pool']['full_tau']:.2f}).  ",
               f"Simulated: {res['episodes']} episodes per cell, each as long as the bench's steady state, slot i = "
               f"request i, seed {res['seed']}; hardware curve `{res['hardware']['kind']}`.", ""]
        if res["hardware"]["kind"] == "measured-rounds":
            md += ["Round-cost anchors (steady s / rounds of the cells whose verify size is known): " + "; ".join(
                f"C = {c}: " + ", ".join(f"{p['tokens']:.0f} tok {1e3 * p['round_s']:.1f} ms ({p['cell']})" for p in pts)
                for c, pts in res["hardware"]["points"].items()) + ". Cells marked * are anchors: their round time is "
                "the measured one, so only tau is predicted there.", ""]
        replay = any(c["model"] == "replay" for c in res["cells"])
        if replay:
            md += ["Simulated columns: **replay** (the prediction: slot i replays recorded request i; a slot "
                   "inside a recorded round drafts its remainder), *nearest* (the recorded round as is: "
                   "optimistic for policies that verify less than the block), *iid* (request i's rounds at random; "
                   "mean and sd over bench-length runs = the sampling noise of a run this short).", ""]
        md += ["| scheduler | C | tok/s measured | replay | nearest | iid mean (sd) | error | within noise | "
               "tau meas. / sim. | budget meas. / sim. | verify tok/round meas. / sim. | round ms meas. / sim. |",
               "|---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|"]
        for c in res["cells"]:
            rep = c.get("replay_aggregate_tokens_per_s")
            near = c.get("replay_nearest_aggregate_tokens_per_s")
            md.append(
                f"| {c['scheduler']}{'*' if c['time_anchor'] else ''} | {c['concurrency']} | "
                f"{c['measured_aggregate_tokens_per_s']:.1f} | {'-' if rep is None else f'**{rep:.1f}**'} | "
                f"{'-' if near is None else f'{near:.1f}'} | {c['iid_aggregate_tokens_per_s']:.1f} "
                f"({c['iid_sd_bench_length']:.1f}) | {100 * c['aggregate_rel_error']:+.1f}% | "
                f"{'yes' if c['aggregate_within_noise'] else '**no**'} (±{100 * c['aggregate_band']:.0f}%) | "
                f"{c['measured_tau']:.2f} / {c['simulated_tau']:.2f} | "
                f"{c['measured_verify_budget']:.2f} / {c['simulated_verify_budget']:.2f} | "
                f"{c['measured_verify_tokens_per_round']:.1f} / {c['simulated_verify_tokens_per_round']:.1f} | "
                f"{c['measured_round_ms']:.1f} / {c['simulated_round_ms']:.1f} |")
        sm = res["summary"]
        a, e = sm["all"], sm["predicted_end_to_end"]
        md += ["", f"Error = {'replay' if replay else 'iid mean'} vs measured. Noise band per cell: "
               f"±({100 * res['timing_noise']:.0f}% timing noise between runs, docs/results.md section 6) + 2 sd of "
               "the iid throughput over bench-length runs (which rounds a run that short happens to see). "
               + (f"Measured within [min, max] of replay and nearest (± the timing noise) in "
                  f"{sum(c['in_bracket'] for c in res['cells'])} of {len(res['cells'])} cells." if replay else ""), "",
               f"**Summary.** Throughput within the noise band in {a['within_noise']} of {a['cells']} cells "
               f"(mean |error| {100 * a['mean_abs_error']:.1f}%, max {100 * a['max_abs_error']:.1f}%); in "
               f"{e['within_noise']} of {e['cells']} cells predicted end to end (not time anchors; mean |error| "
               f"{_pct(e['mean_abs_error'])}, max {_pct(e['max_abs_error'])}). tau within 2 sd in "
               f"{a['tau_within_2sd']} of {a['cells']} cells.", "",
               verdict(res), "",
               "Best / worst policy per concurrency, measured vs simulated: " + "; ".join(
                   f"C = {r['concurrency']}: best {r['best_measured']} / {r['best_simulated']}, worst "
                   f"{r['worst_measured']} / {r['worst_simulated']}" for r in sm["ranking"]) + ".", ""]
    return "\n".join(md)


def verdict(res: dict) -> str:
    """A verdict paragraph computed from the cells (the caveats are those of the method)."""
    cells, tn = res["cells"], res["timing_noise"]
    inside = [c for c in cells if abs(c["aggregate_rel_error"]) <= tn]
    outside = [c for c in cells if abs(c["aggregate_rel_error"]) > tn]
    big = max(res["cells"], key=lambda c: c["concurrency"])["concurrency"]
    large = [c for c in cells if c["concurrency"] == big and not c["time_anchor"]]
    bias = res["summary"]["mean_signed_error_by_policy"]
    text = (f"**Verdict.** Simulated throughput is within the timing noise alone (±{100 * tn:.0f}%) of the "
            f"measurement in {len(inside)} of {len(cells)} cells"
            + (": outside it " + ", ".join(f"{c['scheduler']} at C = {c['concurrency']} "
                                          f"({100 * c['aggregate_rel_error']:+.0f}%)" for c in outside) if outside else "")
            + ". Mean signed error per policy: " + ", ".join(f"{p} {100 * b:+.1f}%" for p, b in bias.items()) + ". ")
    if large:
        text += (f"At the largest concurrency (C = {big}), the cells predicted end to end: "
                 + ", ".join(f"{c['scheduler']} {100 * c['aggregate_rel_error']:+.1f}%" for c in large) + ". ")
    replay = any(c["model"] == "replay" for c in cells)
    if not replay:
        fixed = [c for c in cells if c["scheduler"] == "fixed"]
        text += (f"These statistics do not come from the benchmark's requests (full-length tau {res['pool']['full_tau']:.2f}"
                 + (f" against the benchmark's fixed-policy tau {min(c['measured_tau'] for c in fixed):.2f}-"
                    f"{max(c['measured_tau'] for c in fixed):.2f}" if fixed else "")
                 + "): most of the error is the workload, not the simulator. ")
    text += ("Caveats: cells marked * share their round time with the measurement (only tau is predicted there"
             + (", and for `fixed` the replay is the recorded run itself" if replay else "")
             + "); a cell at small C is 1-4 requests over fewer "
             "than 30 rounds, so a single measurement is itself uncertain by the iid sd shown; the dspark "
             "schedulers plan here with an SPS table rebuilt from the measured round times, not the table the "
             "benchmark profiled (not stored), so their verify budgets can differ where that table was flat or "
             "jagged.")
    return text


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
