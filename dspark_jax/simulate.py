"""Serving at scale, simulated: `python -m dspark_jax.simulate [run|record|validate] ...`.

    # steady-state serving at concurrency 1..1024, every scheduler, on a roofline of Qwen3-8B on an H200
    python -m dspark_jax.simulate --rounds-file benchmarks/results/simulate_rounds_shipped_t0.json \\
        --accelerator h200 --target qwen3-8b --out benchmarks/results/simulate_h200_qwen3-8b.md
    # the same with measured SPS tables (one per concurrency, as `decode` profiles them)
    python -m dspark_jax.simulate --eval-stats docs/results/shipped/eval_t0/eval.json --sps-table T1.json --sps-table T4.json
    # record drafter statistics: real decoding, full-length verification, bench_serving's prompts
    python -m dspark_jax.simulate record --drafter default --prompts 64 --max-new-tokens 48 --out rounds.json
    # compare with a measured bench_serving run
    python -m dspark_jax.simulate validate --bench benchmarks/results/serving_shipped.json --rounds-file rounds.json

The simulator replays the engine's scheduler functions (dspark_jax/engine/scheduler.py) round by
round against a hardware curve; docs/decoding.md ("Serving simulator") explains the model and
its approximations.
"""

from __future__ import annotations

import argparse
import sys

from dspark_jax.core.cli import run_cli
from dspark_jax.core.errors import UserError

COMMANDS = ("run", "record", "validate")
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,256,512,1024"


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are UserErrors (one `error: ...` line, exit status 2)."""

    def error(self, message: str):
        raise UserError(message)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def _floats(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not out or any(not 0 <= x <= 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected rates in [0, 1], got {text!r}")
    return out


def _add_stats(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafter statistics (one of)")
    g.add_argument("--rounds-file", help="round records from `simulate record` (resampled)")
    g.add_argument("--eval-stats", help="eval.json of `python -m dspark_jax.eval` (synthetic rounds)")
    g.add_argument("--acceptance-rates", type=_floats,
                   help="what-if: per-position conditional acceptance rates, comma-separated (Beta confidences)")
    g.add_argument("--eval-drafter", default=None, help="drafter label inside eval.json (default: the first)")
    g.add_argument("--eval-group", default="overall", help="overall, domain:NAME or bench:NAME")
    g.add_argument("--eval-model", default="reliability", choices=["reliability", "beta"],
                   help="synthetic model for eval.json: reliability diagrams + copula, or Beta confidences")
    g.add_argument("--kappa", type=float, default=None,
                   help="Beta concentration of the confidences (beta model; default: fitted to eval's threshold "
                        "sweep, 2.0 for --acceptance-rates)")
    g.add_argument("--pool-size", type=int, default=20000, help="synthetic rounds to draw")


def _add_hardware(p: argparse.ArgumentParser) -> None:
    from dspark_jax.serving.hardware import ACCELERATORS, TARGETS

    g = p.add_argument_group("hardware curve (default: roofline)")
    g.add_argument("--sps-table", action="append", default=[],
                   help="measured SPS table JSON (sps.py format), one per concurrency; repeatable")
    g.add_argument("--bench-curve", help="round times reconstructed from a bench_serving JSON")
    g.add_argument("--accelerator", default="h200", choices=list(ACCELERATORS))
    g.add_argument("--target", default="qwen3-8b", choices=list(TARGETS))
    g.add_argument("--target-config", help="Hugging Face config.json of the target (instead of --target)")
    g.add_argument("--kv-len", type=int, default=1024, help="mean context length per request (tokens)")
    g.add_argument("--chips", type=int, default=1, help="chips (ideal tensor parallelism, no communication cost)")
    g.add_argument("--verify-overhead-ms", type=float, default=0.5, help="fixed cost per target pass (assumed)")
    g.add_argument("--draft-overhead-ms", type=float, default=0.5, help="fixed cost per drafter pass (assumed)")
    g.add_argument("--bandwidth-efficiency", type=float, default=1.0)
    g.add_argument("--flops-efficiency", type=float, default=1.0)
    g.add_argument("--drafter-layers", type=int, default=5)
    g.add_argument("--markov-rank", type=int, default=256)
    g.add_argument("--taps", type=int, default=5)
    g.add_argument("--buckets", default="pow2", help="verify token buckets: pow2 (the engine's) or step:N")


def parse_args(argv: list[str]) -> tuple[str, argparse.Namespace]:
    cmd = argv[0] if argv and argv[0] in COMMANDS else "run"
    rest = argv[1:] if argv and argv[0] in COMMANDS else argv
    prog = f"python -m dspark_jax.simulate {cmd}"
    p = _Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if cmd == "record":
        p.add_argument("--drafter", default="default", help="drafter folder ('default' = the shipped one)")
        p.add_argument("--target", default="smollm2-135m")
        p.add_argument("--prompts", type=int, default=64, help="bench_serving prompts to decode (its first N)")
        p.add_argument("--max-new-tokens", type=int, default=48)
        p.add_argument("--max-prompt-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--batch-size", type=int, default=16)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", required=True, help="round-records JSON to write")
        args = p.parse_args(rest)
        if args.prompts < 1 or args.max_new_tokens < 2 or args.batch_size < 1 or args.temperature < 0:
            raise UserError("need --prompts >= 1, --max-new-tokens >= 2, --batch-size >= 1, --temperature >= 0")
        return cmd, args
    _add_stats(p)
    p.add_argument("--seed", type=int, default=0)
    if cmd == "validate":
        p.add_argument("--bench", required=True, help="bench_serving results JSON to compare with")
        p.add_argument("--sps-table", action="append", default=[],
                       help="SPS tables profiled on the benchmark's machine (default: round times from the bench JSON)")
        p.add_argument("--episodes", type=int, default=200, help="simulated bench-length runs per cell")
        p.add_argument("--timing-noise", type=float, default=None, help="relative timing noise of a cell (0.10)")
        p.add_argument("--out", default="benchmarks/results/simulate_validation.md")
        args = p.parse_args(rest)
        if args.episodes < 2:
            raise UserError("--episodes must be >= 2")
        return cmd, args
    _add_hardware(p)
    p.add_argument("--concurrency", type=_ints, default=None,
                   help=f"comma-separated (default {DEFAULT_CONCURRENCY}; a measured curve: its own)")
    p.add_argument("--policies", default="fixed,mtp1,threshold,dspark,dspark-async")
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per round (default: the statistics')")
    p.add_argument("--slot-rounds", type=int, default=32768, help="slot-rounds simulated per concurrency")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--request-rounds", type=int, default=24, help="rounds a slot serves one request (refill period)")
    p.add_argument("--label", default="", help="suffix for plot titles")
    p.add_argument("--out", default="benchmarks/results/simulate.md", help="results .md (.json and .png beside it)")
    p.add_argument("--quiet", action="store_true")
    return cmd, p.parse_args(rest)


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


def cmd_run(args, argv) -> int:
    from dspark_jax.serving.report import write_simulation
    from dspark_jax.serving.simulator import SimConfig, simulate

    pool = load_stats(args)[0]
    if args.gamma is not None:
        pool = pool.truncated(args.gamma)
    curve = build_curve(args, pool.gamma)
    concurrency = args.concurrency or (list(curve.concurrencies) if curve.concurrencies else
                                       _ints(DEFAULT_CONCURRENCY))
    policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    cfg = SimConfig(policies=policies, threshold=args.threshold, slot_rounds=args.slot_rounds, warmup=args.warmup,
                    request_rounds=args.request_rounds, seed=args.seed)

    def progress(c, rows):
        if not args.quiet:
            print(f"C={c:<5d} " + "  ".join(f"{r['policy']} {r['aggregate_tokens_per_s']:.1f} tok/s "
                                           f"(tau {r['tau']:.2f}, budget {r['verify_budget']:.2f})" for r in rows),
                  flush=True)

    rows = simulate(pool, curve, concurrency, cfg, progress)
    settings = {"policies": list(policies), "concurrency": list(concurrency), "gamma": pool.gamma,
                "threshold": cfg.threshold, "slot_rounds": cfg.slot_rounds, "min_rounds": cfg.min_rounds,
                "max_rounds": cfg.max_rounds, "warmup": cfg.warmup, "request_rounds": cfg.request_rounds,
                "sampling": "replay" if cfg.replays(pool) else "iid",
                "seed": cfg.seed}
    result = {"settings": settings, "hardware": curve.describe(), "stats": pool.source,
              "pool": {"rounds": len(pool.accepted), "requests": len(pool.requests), "full_tau": pool.full_tau()},
              "label": f"\n{args.label}" if args.label else "", "rows": rows}
    for path in write_simulation(args.out, argv, result):
        print("wrote", path)
    return 0


def cmd_record(args, argv) -> int:
    from dspark_jax.serving.rounds import record_rounds, write_json

    rec = record_rounds(drafter=args.drafter, target=args.target, prompts=args.prompts,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, seed=args.seed)
    from dspark_jax.serving.report import meta

    rec.update({k: v for k, v in meta(argv).items() if k in ("command", "machine")})
    write_json(args.out, rec, indent=None)
    print(f"recorded {rec['rounds']} rounds of {rec['prompts']} requests (full-length tau {rec['full_tau']:.3f}); "
          f"wrote {args.out}")
    return 0


def cmd_validate(args, argv) -> int:
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
    for res in results:
        print(f"{res['pool']['source'].get('kind')}: " + ", ".join(
            f"{c['scheduler']} C={c['concurrency']} {c['measured_aggregate_tokens_per_s']:.1f} vs "
            f"{c['simulated_aggregate_tokens_per_s']:.1f} ({100 * c['aggregate_rel_error']:+.0f}%)"
            for c in res["cells"]))
    print("wrote", md_path, json_path)
    return 0


@run_cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd, args = parse_args(argv)
    return {"run": cmd_run, "record": cmd_record, "validate": cmd_validate}[cmd](args, argv)


if __name__ == "__main__":
    sys.exit(main())
