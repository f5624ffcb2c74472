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

from dspark_jax.core.cli import ArgumentParser, run_cli
from dspark_jax.core.errors import UserError
from dspark_jax.serving import runs

COMMANDS = ("run", "record", "validate")
DEFAULT_CONCURRENCY = ",".join(map(str, runs.DEFAULT_CONCURRENCY))


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
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


def cmd_run(args, argv) -> int:
    def progress(c, rows):
        if not args.quiet:
            print(f"C={c:<5d} " + "  ".join(f"{r['policy']} {r['aggregate_tokens_per_s']:.1f} tok/s "
                                           f"(tau {r['tau']:.2f}, budget {r['verify_budget']:.2f})" for r in rows),
                  flush=True)

    for path in runs.run_simulation(args, argv, progress):
        print("wrote", path)
    return 0


def cmd_record(args, argv) -> int:
    rec = runs.record(args, argv)
    print(f"recorded {rec['rounds']} rounds of {rec['prompts']} requests (full-length tau {rec['full_tau']:.3f}); "
          f"wrote {args.out}")
    return 0


def cmd_validate(args, argv) -> int:
    results, paths = runs.validate_bench(args, argv)
    for res in results:
        print(f"{res['pool']['source'].get('kind')}: " + ", ".join(
            f"{c['scheduler']} C={c['concurrency']} {c['measured_aggregate_tokens_per_s']:.1f} vs "
            f"{c['simulated_aggregate_tokens_per_s']:.1f} ({100 * c['aggregate_rel_error']:+.0f}%)"
            for c in res["cells"]))
    print("wrote", *paths)
    return 0


@run_cli
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd, args = parse_args(argv)
    return {"run": cmd_run, "record": cmd_record, "validate": cmd_validate}[cmd](args, argv)


if __name__ == "__main__":
    sys.exit(main())
