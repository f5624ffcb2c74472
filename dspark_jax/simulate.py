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

from dspark_jax.core.cli import ArgumentParser, add_settings, run_cli, settings_from
from dspark_jax.serving import runs
from dspark_jax.serving.settings import CurveSettings, RecordSettings, RunSettings, StatsSettings, ValidateSettings

COMMANDS = ("run", "record", "validate")


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


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _comma_list(parse) -> dict:  # a tuple field set by one comma-separated flag
    return {"type": parse, "action": "store"}


def parse_args(argv: list[str]):
    """(the command, its settings) from the command line."""
    cmd = argv[0] if argv and argv[0] in COMMANDS else "run"
    rest = argv[1:] if argv and argv[0] in COMMANDS else argv
    prog = f"python -m dspark_jax.simulate {cmd}"
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    if cmd == "record":
        add_settings(p, RecordSettings, out={"required": True})
        return cmd, settings_from(RecordSettings, p.parse_args(rest))
    add_settings(p.add_argument_group("drafter statistics (one of)"), StatsSettings,
                  acceptance_rates=_comma_list(_floats))
    if cmd == "validate":
        add_settings(p, ValidateSettings, bench={"required": True})
        args = p.parse_args(rest)
        return cmd, settings_from(ValidateSettings, args, stats=settings_from(StatsSettings, args))
    from dspark_jax.serving.hardware import ACCELERATORS, TARGETS

    add_settings(p.add_argument_group("hardware curve (default: roofline)"), CurveSettings,
                  accelerator={"choices": list(ACCELERATORS)}, target={"choices": list(TARGETS)})
    add_settings(p, RunSettings, concurrency=_comma_list(_ints), policies=_comma_list(_names))
    args = p.parse_args(rest)
    return cmd, settings_from(RunSettings, args, stats=settings_from(StatsSettings, args),
                              curve=settings_from(CurveSettings, args))


def cmd_run(settings: RunSettings, argv) -> int:
    def progress(c, rows):
        if not settings.quiet:
            print(f"C={c:<5d} " + "  ".join(f"{r['policy']} {r['aggregate_tokens_per_s']:.1f} tok/s "
                                           f"(tau {r['tau']:.2f}, budget {r['verify_budget']:.2f})" for r in rows),
                  flush=True)

    for path in runs.run_simulation(settings, argv, progress):
        print("wrote", path)
    return 0


def cmd_record(settings: RecordSettings, argv) -> int:
    rec = runs.record(settings, argv)
    print(f"recorded {rec['rounds']} rounds of {rec['prompts']} requests (full-length tau {rec['full_tau']:.3f}); "
          f"wrote {settings.out}")
    return 0


def cmd_validate(settings: ValidateSettings, argv) -> int:
    results, paths = runs.validate_bench(settings, argv)
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
    cmd, settings = parse_args(argv)
    return {"run": cmd_run, "record": cmd_record, "validate": cmd_validate}[cmd](settings, argv)


if __name__ == "__main__":
    sys.exit(main())
