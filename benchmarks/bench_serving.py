"""Serving throughput vs concurrency for each verification scheduler (DSpark paper, Figures 7 and 8).

    python benchmarks/bench_serving.py --drafter runs/dspark_smollm2-135m/drafter \\
        [--concurrency 1,2,4,8,16,32,64] [--schedulers fixed,mtp1,threshold,dspark,dspark-async] \\
        [--rounds 1] [--max-new-tokens 64] [--temperature 0] [--out benchmarks/results/serving.md]

For each concurrency C, C request slots decode together in the speculative engine (the run of
`python -m dspark_jax.decode --drafter ...` with batch C); stop tokens are ignored, so no slot falls
idle before its --max-new-tokens budget. Throughput is measured over the rounds in which all C slots
decode and none finishes: the steady state of a server whose slots are always refilled
(`speculative_serve`), without timing the refills' prefills, which on a CPU would weigh as much as
the decoding being compared, and without the batch's tail (slots that finished idle while the
slowest requests catch up: a cost of static batching that falls hardest on the schedulers whose
requests progress unevenly). The whole-batch figure is reported next to it. The
same C prompts (EVAL split, math / code / chat round robin, chat template, at most
--max-prompt-tokens each) go through every scheduler; with --rounds N each scheduler serves N such
batches (fresh prompts each time, schedulers alternating in turn) and the numbers pool them. Timed:
the decode rounds only (XLA compilation and the prompt prefill are reported separately in the JSON).

The dspark schedulers plan with the SPS table `decode` profiles for batch C (one per concurrency:
the token buckets are 1, 2, 4, ... up to C x (gamma + 1)), kept under .dspark_cache/ and reused.

Reported per (scheduler, C): aggregate tokens/s (decode tokens of all slots / decode time),
per-user tokens/s (aggregate / C), mean tau (tokens committed per request and round, bonus
included), the mean verify budget (draft tokens verified per request and round, over active
rows) and the mean tokens per verify pass. Writes <out>.md, <out>.json, <out>_throughput.png
(aggregate vs per-user tokens/s, one curve per scheduler) and <out>_budget.png (verify budget vs C).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from dspark_jax.core.cli import run_cli
from dspark_jax.core.errors import UserError

NEEDS_CONFIDENCE = ("threshold", "dspark", "dspark-async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_serving.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=common.int_list, default=[1, 2, 4, 8, 16, 32, 64],
                   help="request slots decoding together, comma-separated")
    p.add_argument("--schedulers", default=",".join(common.SCHEDULERS),
                   help=f"comma-separated subset of {','.join(common.SCHEDULERS)}")
    p.add_argument("--rounds", type=int, default=1,
                   help="batches of C fresh prompts each scheduler serves per concurrency (pooled)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens every slot decodes")
    p.add_argument("--max-prompt-tokens", type=int, default=128,
                   help="skip longer prompts (after the chat template; bounds the untimed prefill)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    common.add_speculative_args(p, out="benchmarks/results/serving.md")
    args = p.parse_args(argv)
    args.schedulers = common.choose(args.schedulers, common.SCHEDULERS, "scheduler")
    if not args.concurrency or min(args.concurrency) < 1 or args.rounds < 1 or args.max_new_tokens < 2:
        raise UserError("need concurrency >= 1, --rounds >= 1 and --max-new-tokens >= 2")
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    return args


def serving_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """`count` eval prompts, math / code / chat in turn."""
    return common.mixed_eval_prompts(tokenizer, count, max_prompt_tokens)


def summarize(results, concurrency: int, eos_ids) -> dict:
    """Pool the SpecResults of one (scheduler, concurrency).

    Throughput, tau and budgets come from the rounds in which every slot decodes and none finishes
    (a refilled server's steady state); a batch's tail, where finished slots idle while the slowest
    ones catch up, is reported separately as `batch_tokens_per_s` (everything, tail included)."""
    import numpy as np

    rounds = [(r, nxt) for res in results for r, nxt in zip(res.rounds, res.rounds[1:] + [None])]
    steady = [r for r, nxt in rounds if r["active"].all() and nxt is not None and nxt["active"].all()]
    if not steady:
        raise UserError(f"no round with all {concurrency} slots busy: raise --max-new-tokens")
    active = np.stack([r["active"] for r, _ in rounds])
    num_draft = np.stack([r["num_draft"] for r in steady])
    accepted = np.stack([r["accepted"] for r in steady])
    steady_s = sum(r["seconds"] for r in steady)
    decode_s = sum(res.decode_s for res in results)
    tokens = sum(len(ids) - 1 for res in results for ids in res.token_ids)  # the first comes from the prefill
    aggregate = float((accepted + 1).sum() / steady_s)
    rows = [ids for res in results for ids in res.token_ids]
    return {"aggregate_tokens_per_s": aggregate, "per_user_tokens_per_s": aggregate / concurrency,
            "batch_tokens_per_s": tokens / decode_s,
            "tau": float((accepted + 1).mean()), "verify_budget": float(num_draft.mean()),
            "verify_tokens_per_round": float((num_draft + 1).sum(1).mean()),
            "steady_rounds": len(steady), "steady_s": round(steady_s, 3),
            "active_share": float(active.mean()), "rounds": len(rounds), "decode_tokens": tokens,
            "decode_s": round(decode_s, 3), "prefill_s": round(sum(res.prefill_s for res in results), 3),
            "compile_s": round(sum(res.compile_s for res in results), 2),
            "rows_with_eos": sum(any(t in eos_ids for t in ids) for ids in rows)}


def plot(rows: list[dict], schedulers: list[str], gamma: int, throughput_png: str, budget_png: str) -> None:
    from dspark_jax.evaluation.plots import _new_figure, _save

    def figure(x: str, y: str, xlabel: str, ylabel: str, title: str, path: str, decorate) -> None:
        fig = _new_figure(7, 5)
        ax = fig.subplots()
        for s in schedulers:
            mine = [r for r in rows if r["scheduler"] == s]
            ax.plot([r[x] for r in mine], [r[y] for r in mine], marker="o", label=s)
            decorate(ax, mine)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        _save(fig, path)

    def label_concurrency(ax, mine):
        for r in mine:
            ax.annotate(str(r["concurrency"]), (r["per_user_tokens_per_s"], r["aggregate_tokens_per_s"]),
                        textcoords="offset points", xytext=(4, 3), fontsize=7)

    def concurrency_axis(ax, mine):
        ax.axhline(gamma, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["concurrency"] for r in mine], [str(r["concurrency"]) for r in mine])
        ax.minorticks_off()

    figure("per_user_tokens_per_s", "aggregate_tokens_per_s", "per-user tokens/s", "aggregate tokens/s",
           "Throughput vs per-user speed (labels: concurrency)", throughput_png, label_concurrency)
    figure("concurrency", "verify_budget", "concurrency (request slots)", "draft tokens verified per request per round",
           f"Mean verify budget vs concurrency (dashed: gamma = {gamma})", budget_png, concurrency_axis)


def markdown(rows: list[dict], args, gamma: int, pngs: tuple[str, str]) -> str:
    md = [("| scheduler | C | aggregate tok/s | per-user tok/s | tau | verify budget / request / round | "
           "verify tokens / round | steady rounds | whole batch tok/s (tail included) |"),
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['scheduler']} | {r['concurrency']} | {r['aggregate_tokens_per_s']:.1f} | "
                  f"{r['per_user_tokens_per_s']:.2f} | {r['tau']:.2f} | {r['verify_budget']:.2f} | "
                  f"{r['verify_tokens_per_round']:.1f} | {r['steady_rounds']} of {r['rounds']} | "
                  f"{r['batch_tokens_per_s']:.1f} |")
    md += ["\nAggregate tokens/s by concurrency:\n", "| C | " + " | ".join(args.schedulers) + " |",
           "|---:|" + "---:|" * len(args.schedulers)]
    for c in args.concurrency:
        got = {r["scheduler"]: r["aggregate_tokens_per_s"] for r in rows if r["concurrency"] == c}
        md.append(f"| {c} | " + " | ".join(f"{got[s]:.1f}" for s in args.schedulers) + " |")
    md.append(f"\nTarget {args.target}, drafter `{args.drafter}`, gamma {gamma}, T = {args.temperature:g}, "
              f"{args.max_new_tokens} tokens per request (stop tokens ignored so every slot stays busy), "
              f"{args.rounds} batch(es) of C eval-split prompts (math / code / chat, <= {args.max_prompt_tokens} "
              "tokens) per cell. Timed: decode rounds only (prefill and XLA compilation excluded, in the JSON). "
              "Aggregate tok/s, tau and budgets are over the steady rounds (every slot decoding, none finishing: "
              "a refilled server's steady state); the last column times the whole batch, whose tail idles "
              "finished slots while the slowest catch up. "
              "tau = tokens per request and round, bonus included; verify budget = draft tokens verified per "
              "request and round (gamma for fixed, 1 for mtp1); the dspark schedulers plan with the SPS "
              f"table profiled for each C. threshold = {args.threshold}. Rows that emitted a stop token (and "
              f"decoded on): {sum(r['rows_with_eos'] for r in rows)} of "
              f"{sum(r['concurrency'] * args.rounds for r in rows)}.\n")
    md += [f"![aggregate vs per-user tokens/s]({os.path.basename(pngs[0])})\n",
           f"![verify budget vs concurrency]({os.path.basename(pngs[1])})\n"]
    return "\n".join(md)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.models.sampling import SamplingConfig

    target = common.load_benchmark_target(args)
    dcfg = load_drafter(args.drafter, target.config, target.name).config
    gamma = args.gamma or dcfg.block_size
    if not dcfg.confidence and set(args.schedulers) & set(NEEDS_CONFIDENCE):
        raise UserError(f"schedulers {', '.join(NEEDS_CONFIDENCE)} need a drafter with a confidence head; "
                        "pass --schedulers fixed,mtp1")
    # The engine as `decode --drafter` builds it, but with no stop tokens: every slot stays busy.
    busy = dataclasses.replace(target, tokenizer=types.SimpleNamespace(eos_token_ids=()))
    sampling = SamplingConfig(args.temperature)
    prompts = serving_prompts(target.tokenizer, max(args.concurrency) * args.rounds, args.max_prompt_tokens)
    rows = []
    with tqdm(total=len(args.concurrency) * len(args.schedulers) * args.rounds, unit="batch", desc="serving") as bar:
        for c in args.concurrency:
            bar.set_postfix_str(f"C={c}: SPS table")
            runners, profiled = {}, False
            for s in args.schedulers:
                runners[s] = common.speculative_runner(args, busy, scheduler=s, batch_size=c,
                                                       profile_sps=args.profile_sps and not profiled)
                profiled |= s.startswith("dspark")
            results = {s: [] for s in args.schedulers}
            for r in range(args.rounds):
                batch = prompts[r * c: (r + 1) * c]
                order = args.schedulers[r % len(args.schedulers):] + args.schedulers[: r % len(args.schedulers)]
                for s in order:
                    bar.set_postfix_str(f"C={c} {s}")
                    results[s].append(runners[s](batch, sampling, args.seed + r))
                    bar.update(1)
            for s in args.schedulers:
                row = {"scheduler": s, "concurrency": c,
                       **summarize(results[s], c, set(target.tokenizer.eos_token_ids))}
                rows.append(row)
                tqdm.write(f"{s} C={c}: {row['aggregate_tokens_per_s']:.1f} tok/s aggregate, "
                           f"{row['per_user_tokens_per_s']:.2f} per user, tau {row['tau']:.2f}, "
                           f"budget {row['verify_budget']:.2f}")
    _, _, pngs = common.output_paths(args.out, "_throughput", "_budget")
    plot(rows, args.schedulers, gamma, *pngs)
    common.write_benchmark(args, ("target", "drafter", "dtype", "rounds", "max_new_tokens", "max_prompt_tokens",
                                  "temperature", "threshold", "seed"), rows, markdown(rows, args, gamma, pngs),
                           gamma=gamma)
    return 0


if __name__ == "__main__":
    sys.exit(main())
