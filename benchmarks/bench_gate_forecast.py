"""How well the plain-step gate can foresee the next round's tau: each predictor it could run on
the rounds so far, scored by its squared error on the next round's committed tokens.

    python benchmarks/bench_gate_forecast.py --drafter dspark_jax/shipped/dspark_smollm2-135m \\
        [--limit 6] [--max-new-tokens 128] [--temperature 0] [--out benchmarks/results/gate_forecast.md]

Every round runs (plain steps off), one eval-split prompt at a time (math = gsm8k + math500, code =
humaneval + mbpp, chat = arena-hard-v2; chat template), with decode's scheduler for batch 1. Per
round: tau (tokens committed, bonus included) and the confidence head's forecast of it (1 + the
calibrated prefix survival of the drafts verified: `RoundStats.forecast`). The
predictors: running means (exponential, weight w on the newest) of the committed tokens, as the
gate kept before, or of the forecasts, as it keeps now, carried from one prompt to the next as
decode's engine keeps its gate. The mean squared error is over every round but the first, beside
the variance of tau (what the best constant, known in hindsight, would score).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from dspark_jax.core.cli import run_cli

PREDICTORS = {"committed tokens, w 0.1 (the gate before)": ("tokens", 0.1),
              "committed tokens, w 0.3": ("tokens", 0.3),
              "head forecast, w 0.3 (the gate now)": ("forecast", 0.3),
              "head forecast, w 0.5": ("forecast", 0.5),
              "head forecast of the last round alone": ("forecast", 1.0)}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/bench_gate_forecast.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", default=",".join(common.DOMAINS))
    p.add_argument("--limit", type=int, default=6, help="prompts per domain (eval split)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    common.add_speculative_args(p, out="benchmarks/results/gate_forecast.md")
    args = p.parse_args(argv)
    args.domains = common.choose(args.domains, common.DOMAINS, "domain")
    return args


def record(runner, prompts, temperature: float) -> list[list[tuple[float, float]]]:
    """Per prompt, its rounds' (tau, forecast)."""
    from dspark_jax.models.sampling import SamplingConfig

    out = []
    for i, prompt in enumerate(prompts):
        result = runner([prompt], SamplingConfig(temperature), i)
        out.append([(float(r["accepted"][0]) + 1, float(r["forecast"][0])) for r in result.rounds])
    return out


def score(prompts: list[list[tuple[float, float]]]) -> dict:
    """Each predictor's mean squared error on the next round's tau, running over the prompts in
    turn (as decode's engine keeps its gate from one request to the next)."""
    import numpy as np

    rounds = [r for prompt in prompts for r in prompt]
    errors = {name: [] for name in PREDICTORS}
    running = {}
    for (tau, forecast), (next_tau, _) in zip(rounds, rounds[1:]):
        for name, (source, w) in PREDICTORS.items():
            x = tau if source == "tokens" else forecast
            running[name] = x if name not in running else (1 - w) * running[name] + w * x
            errors[name].append((running[name] - next_tau) ** 2)
    taus = np.array([t for t, _ in rounds])
    forecasts = np.array([f for _, f in rounds])
    return {"rounds": int(taus.size), "tau": float(taus.mean()), "forecast": float(forecasts.mean()),
            "tau_variance": float(taus.var()), "correlation": float(np.corrcoef(taus, forecasts)[0, 1]),
            "mse": {name: float(np.mean(e)) for name, e in errors.items()}}


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = common.load_benchmark_target(args)
    runner = common.speculative_runner(args, target, scheduler="auto", batch_size=1)
    rows = []
    for domain in args.domains:
        prompts = common.eval_prompts(target.tokenizer, common.DOMAINS[domain], args.limit, args.max_prompt_tokens)
        rows.append({"domain": domain, **score(record(runner, prompts, args.temperature))})
        print(domain, rows[-1], flush=True)
    lines = ["| predictor of the next round's tau: mean squared error | " + " | ".join(r["domain"] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for name in PREDICTORS:
        lines.append(f"| {name} | " + " | ".join(f"{r['mse'][name]:.3f}" for r in rows) + " |")
    lines.append("| variance of tau (the best constant, in hindsight) | " + " | ".join(f"{r['tau_variance']:.3f}" for r in rows) + " |")
    lines += ["", "| domain | rounds | tau | forecast | correlation, round by round |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['domain']} | {r['rounds']} | {r['tau']:.2f} | {r['forecast']:.2f} | {r['correlation']:.2f} |"
              for r in rows]
    markdown = "\n".join(lines) + (
        f"\n\nTarget {args.target}, drafter `{args.drafter}`, T = {args.temperature:g}, decode's scheduler for batch 1, "
        f"plain steps off, {args.limit} eval-split prompts per domain, up to {args.max_new_tokens} new tokens. "
        "w: the weight of the newest round in the running mean.\n")
    common.write_benchmark(args, ("target", "drafter", "limit", "max_new_tokens", "temperature"), rows, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
