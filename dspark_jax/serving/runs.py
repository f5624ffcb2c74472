"""The runs behind `python -m dspark_jax.simulate`: drafter statistics and hardware curves from the
flags, a simulation, a recording of real rounds, a validation against a measured benchmark.

`args` is the command's settings (its argparse namespace, `simulate.parse_args`).
"""

from __future__ import annotations

from dspark_jax.core.errors import UserError

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def load_stats(args, single: bool = True):
    """The RoundPool(s) the flags name."""
    from dspark_jax.serving import rounds as R

    if args.pool_size < 100:
        raise UserError("--pool-size must be >= 100")
    pools = []
    if args.rounds_file:
        pools.append(R.load_pool(args.rounds_file))
    if args.eval_stats:
        pools.append(R.pool_from_eval(args.eval_stats, drafter=args.eval_drafter, group=args.eval_group,
                                      model=args.eval_model, n=args.pool_size, seed=args.seed, kappa=args.kappa))
    if getattr(args, "acceptance_rates", None):
        pools.append(R.rates_pool(args.acceptance_rates, 2.0 if args.kappa is None else args.kappa, args.pool_size,
                                  args.seed, {"kind": "what-if:rates", "rates": args.acceptance_rates}))
    if not pools:
        raise UserError("give drafter statistics: --rounds-file, --eval-stats or --acceptance-rates")
    if single and len(pools) > 1:
        raise UserError("give only one of --rounds-file, --eval-stats, --acceptance-rates")
    return pools


def build_curve(args, gamma: int):
    from dspark_jax.serving import hardware as H

    if sum(map(bool, (args.sps_table, args.bench_curve))) > 1:
        raise UserError("give only one of --sps-table and --bench-curve")
    if args.sps_table:
        return H.SPSTableCurve.from_files(args.sps_table, gamma)
    if args.bench_curve:
        from dspark_jax.serving.rounds import load_json

        curve = H.MeasuredRoundCurve.from_bench(load_json(args.bench_curve, "bench_serving JSON"), args.bench_curve)
        if curve.gamma != gamma:
            raise UserError(f"{args.bench_curve} was measured at gamma {curve.gamma}, not {gamma}")
        return curve
    target = H.target_from_hf_config(args.target_config) if args.target_config else args.target
    roof = H.roofline_by_name(
        args.accelerator, target, drafter=H.DrafterShape(args.drafter_layers, args.markov_rank, args.taps), gamma=gamma,
        kv_len=args.kv_len, chips=args.chips, verify_overhead_s=args.verify_overhead_ms / 1e3,
        draft_overhead_s=args.draft_overhead_ms / 1e3, bandwidth_efficiency=args.bandwidth_efficiency,
        flops_efficiency=args.flops_efficiency)
    if min(args.drafter_layers, args.taps) < 1 or args.markov_rank < 0:
        raise UserError("--drafter-layers and --taps must be >= 1, --markov-rank >= 0")
    return H.RooflineCurve(roof, args.buckets)


def run_simulation(args, argv, progress=None) -> list[str]:
    """Simulate every policy at every concurrency; write the results files; return their paths."""
    from dspark_jax.serving.report import write_simulation
    from dspark_jax.serving.simulator import SimConfig, simulate

    pool = load_stats(args)[0]
    if args.gamma is not None:
        pool = pool.truncated(args.gamma)
    curve = build_curve(args, pool.gamma)
    concurrency = args.concurrency or (list(curve.concurrencies) if curve.concurrencies else
                                       list(DEFAULT_CONCURRENCY))
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    cfg = SimConfig(policies=policies, threshold=args.threshold, slot_rounds=args.slot_rounds, warmup=args.warmup,
                    request_rounds=args.request_rounds, seed=args.seed)

    rows = simulate(pool, curve, concurrency, cfg, progress)
    settings = {"policies": list(policies), "concurrency": list(concurrency), "gamma": pool.gamma,
                "threshold": cfg.threshold, "slot_rounds": cfg.slot_rounds, "min_rounds": cfg.min_rounds,
                "max_rounds": cfg.max_rounds, "warmup": cfg.warmup, "request_rounds": cfg.request_rounds,
                "sampling": "replay" if cfg.replays(pool) else "iid",
                "seed": cfg.seed}
    result = {"settings": settings, "hardware": curve.describe(), "stats": pool.source,
              "pool": {"rounds": len(pool.accepted), "requests": len(pool.requests), "full_tau": pool.full_tau()},
              "label": f"\n{args.label}" if args.label else "", "rows": rows}
    return write_simulation(args.out, argv, result)


def record(args, argv) -> dict:
    """Real decoding with full-length verification; the round records, written to args.out."""
    from dspark_jax.serving.rounds import record_rounds, write_json

    rec = record_rounds(drafter=args.drafter, target=args.target, prompts=args.prompts,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, seed=args.seed)
    from dspark_jax.serving.report import meta

    rec.update({k: v for k, v in meta(argv).items() if k in ("command", "machine")})
    write_json(args.out, rec, indent=None)
    return rec
def validate_bench(args, argv) -> tuple[list[dict], tuple[str, str]]:
    """Simulate a measured bench_serving run's cells; the results and the files written."""
    from dspark_jax.serving import hardware as H
    from dspark_jax.serving.report import header, meta, out_paths, write_text
    from dspark_jax.serving.rounds import load_json, write_json
    from dspark_jax.serving.validation import TIMING_NOISE, bench_settings, validate, validation_markdown

    bench = load_json(args.bench, "bench_serving JSON")
    gamma = int(bench_settings(bench, args.bench)["gamma"])
    pools = load_stats(args, single=False)
    curve = H.SPSTableCurve.from_files(args.sps_table, gamma) if args.sps_table else None
    noise = TIMING_NOISE if args.timing_noise is None else args.timing_noise
    results = [validate(bench, pool, curve=curve, episodes=args.episodes, seed=args.seed, bench_path=args.bench,
                        timing_noise=noise) for pool in pools]
    m = meta(argv)
    md_path, json_path, _ = out_paths(args.out)
    write_json(json_path, {**m, "results": results})
    write_text(md_path, validation_markdown(header(m), results))
    return results, (md_path, json_path)
