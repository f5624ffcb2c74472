"""The runs behind `python -m dspark_jax.simulate`: drafter statistics and hardware curves from the
settings, a simulation, a recording of real rounds, a validation against a measured benchmark.

Each run takes its command's settings (`settings.py`: values, checked when built) and the command
line it was started with (`argv`, for the "command" of the results files).
"""

from __future__ import annotations

from typing import Sequence

from dspark_jax.core.errors import UserError
from dspark_jax.serving.settings import (DEFAULT_CONCURRENCY, CurveSettings, RecordSettings, RunSettings,
                                         StatsSettings, ValidateSettings)


def load_stats(stats: StatsSettings, seed: int, single: bool = True):
    """The RoundPool(s) the statistics settings name (synthetic ones drawn with `seed`)."""
    from dspark_jax.serving import rounds as R

    pools = []
    if stats.rounds_file:
        pools.append(R.load_pool(stats.rounds_file))
    if stats.eval_stats:
        pools.append(R.pool_from_eval(stats.eval_stats, drafter=stats.eval_drafter, group=stats.eval_group,
                                      model=stats.eval_model, n=stats.pool_size, seed=seed, kappa=stats.kappa))
    if stats.acceptance_rates:
        rates = list(stats.acceptance_rates)
        pools.append(R.rates_pool(rates, 2.0 if stats.kappa is None else stats.kappa, stats.pool_size,
                                  seed, {"kind": "what-if:rates", "rates": rates}))
    if not pools:
        raise UserError("give drafter statistics: --rounds-file, --eval-stats or --acceptance-rates")
    if single and len(pools) > 1:
        raise UserError("give only one of --rounds-file, --eval-stats, --acceptance-rates")
    return pools


def build_curve(hw: CurveSettings, gamma: int):
    """The hardware curve the settings name, for `gamma` draft tokens a round."""
    from dspark_jax.serving import hardware as H

    if sum(map(bool, (hw.sps_table, hw.bench_curve))) > 1:
        raise UserError("give only one of --sps-table and --bench-curve")
    if hw.sps_table:
        return H.SPSTableCurve.from_files(hw.sps_table, gamma)
    if hw.bench_curve:
        from dspark_jax.serving.rounds import load_json

        curve = H.MeasuredRoundCurve.from_bench(load_json(hw.bench_curve, "bench_serving JSON"), hw.bench_curve)
        if curve.gamma != gamma:
            raise UserError(f"{hw.bench_curve} was measured at gamma {curve.gamma}, not {gamma}")
        return curve
    target = H.target_from_hf_config(hw.target_config) if hw.target_config else hw.target
    roof = H.roofline_by_name(
        hw.accelerator, target, drafter=H.DrafterShape(hw.drafter_layers, hw.markov_rank, hw.taps), gamma=gamma,
        kv_len=hw.kv_len, chips=hw.chips, verify_overhead_s=hw.verify_overhead_ms / 1e3,
        draft_overhead_s=hw.draft_overhead_ms / 1e3, bandwidth_efficiency=hw.bandwidth_efficiency,
        flops_efficiency=hw.flops_efficiency)
    return H.RooflineCurve(roof, hw.buckets)


def run_simulation(s: RunSettings, argv: Sequence[str] | None, progress=None) -> list[str]:
    """Simulate every policy at every concurrency; write the results files; return their paths."""
    from dspark_jax.serving.report import write_simulation
    from dspark_jax.serving.simulator import SimConfig, simulate

    pool = load_stats(s.stats, s.seed)[0]
    if s.gamma is not None:
        pool = pool.truncated(s.gamma)
    curve = build_curve(s.curve, pool.gamma)
    concurrency = list(s.concurrency) or (list(curve.concurrencies) if curve.concurrencies else
                                          list(DEFAULT_CONCURRENCY))
    cfg = SimConfig(policies=s.policies, threshold=s.threshold, slot_rounds=s.slot_rounds, warmup=s.warmup,
                    request_rounds=s.request_rounds, seed=s.seed)

    rows = simulate(pool, curve, concurrency, cfg, progress)
    settings = {"policies": list(cfg.policies), "concurrency": list(concurrency), "gamma": pool.gamma,
                "threshold": cfg.threshold, "slot_rounds": cfg.slot_rounds, "min_rounds": cfg.min_rounds,
                "max_rounds": cfg.max_rounds, "warmup": cfg.warmup, "request_rounds": cfg.request_rounds,
                "sampling": "replay" if cfg.replays(pool) else "iid",
                "seed": cfg.seed}
    result = {"settings": settings, "hardware": curve.describe(), "stats": pool.source,
              "pool": {"rounds": len(pool.accepted), "requests": len(pool.requests), "full_tau": pool.full_tau()},
              "label": f"\n{s.label}" if s.label else "", "rows": rows}
    return write_simulation(s.out, argv, result)


def record(s: RecordSettings, argv: Sequence[str] | None) -> dict:
    """Real decoding with full-length verification; the round records, written to s.out."""
    from dspark_jax.serving.rounds import record_rounds, write_json

    rec = record_rounds(drafter=s.drafter, target=s.target, prompts=s.prompts,
                        max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                        max_prompt_tokens=s.max_prompt_tokens, batch_size=s.batch_size, seed=s.seed)
    from dspark_jax.serving.report import meta

    rec.update({k: v for k, v in meta(argv).items() if k in ("command", "machine")})
    write_json(s.out, rec, indent=None)
    return rec


def validate_bench(s: ValidateSettings, argv: Sequence[str] | None) -> tuple[list[dict], tuple[str, str]]:
    """Simulate a measured bench_serving run's cells; the results and the files written."""
    from dspark_jax.serving import hardware as H
    from dspark_jax.serving.report import header, meta, out_paths, write_text
    from dspark_jax.serving.rounds import load_json, write_json
    from dspark_jax.serving.validation import TIMING_NOISE, bench_settings, validate, validation_markdown

    bench = load_json(s.bench, "bench_serving JSON")
    gamma = int(bench_settings(bench, s.bench)["gamma"])
    pools = load_stats(s.stats, s.seed, single=False)
    curve = H.SPSTableCurve.from_files(s.sps_table, gamma) if s.sps_table else None
    noise = TIMING_NOISE if s.timing_noise is None else s.timing_noise
    results = [validate(bench, pool, curve=curve, episodes=s.episodes, seed=s.seed, bench_path=s.bench,
                        timing_noise=noise) for pool in pools]
    m = meta(argv)
    md_path, json_path, _ = out_paths(s.out)
    write_json(json_path, {**m, "results": results})
    write_text(md_path, validation_markdown(header(m), results))
    return results, (md_path, json_path)
