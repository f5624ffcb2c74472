"""Offline generation throughput: continuous vs static batching, plain and speculative, in one run.

    python benchmarks/bench_offline.py [--prompts 64] [--max-new-tokens 128] [--max-batch 16] \\
        [--drafter default] [--scheduler auto] [--max-prompt-tokens 512] [--repeats 1] \\
        [--modes continuous,continuous-ungrouped,static] [--out benchmarks/results/offline.md]

--prompts EVAL-split prompts (dspark_jax/data/splits.py: never trained on; math / code / chat in
turn, chat template, at most --max-prompt-tokens each) are decoded in every configuration exactly
as `python -m dspark_jax.decode --prompts-file ... --max-batch N` decodes them (`offline.run_engine`,
the CLI's own code path), with the target's stop tokens on, so requests end at their own lengths:
which is where continuous batching (a finished request's slot refilled at once) and static batches
(each batch decoded until its longest request ends) differ. Configurations, for plain target
decoding (`--drafter none`) and speculative decoding with --drafter (default: the drafter shipped
for the target):

* continuous: `decode`'s default, prompts grouped by KV-cache length (shortest cache first);
* continuous-ungrouped: `--no-length-groups`, one cache sized for the longest prompt, input order
  (what the length groups buy);
* static: `--batching static`, batches of --max-batch prompts in input order (decode before
  continuous batching).

Timed: every prompt's prefill and decoding, XLA compilation excluded (reported separately);
aggregate tokens/s = generated tokens / that time. Every configuration first runs once untimed
(--no-warmup skips it): the first execution of a compiled program costs extra. With --repeats R
every configuration runs R times, interleaved, and the times pool. Greedy (T = 0): every configuration must produce the same
tokens, which is checked and reported. Writes <out>.md and <out>.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from dspark_jax.core.cli import run_cli
from dspark_jax.core.errors import UserError

MODES = ("continuous", "continuous-ungrouped", "static")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_offline.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="known target name, Hugging Face folder or .gguf file")
    p.add_argument("--drafter", default="default",
                   help="drafter for the speculative rows ('default' = the one shipped for the target; 'none' = "
                        "plain decoding only)")
    p.add_argument("--scheduler", default="auto", choices=["auto", *common.SCHEDULERS])
    p.add_argument("--gamma", type=int, default=None, help="draft tokens per round (default: the drafter's block)")
    p.add_argument("--prompts", type=int, default=64, help="eval-split prompts decoded in every configuration")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (after the chat template)")
    p.add_argument("--max-batch", type=int, default=16, help="request slots (continuous) / batch size (static)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--repeats", type=int, default=1, help="runs of every configuration, interleaved (times pool)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run every configuration once, untimed, first (the first execution of each compiled XLA "
                        "program costs extra: tens of ms each for a tiny model, which would favour the later runs)")
    p.add_argument("--profile-sps", action="store_true", help="re-profile the dspark schedulers' SPS tables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/offline.md",
                   help="results .md (the .json goes next to it)")
    args = p.parse_args(argv)
    args.modes = common.choose(args.modes, MODES, "mode")
    if args.prompts < 1 or args.max_new_tokens < 1 or args.max_batch < 1 or args.repeats < 1:
        raise UserError("need --prompts, --max-new-tokens, --max-batch and --repeats >= 1")
    return args


def eval_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """`count` chat-templated eval prompts, math / code / chat in turn."""
    return common.mixed_eval_prompts(tokenizer, count, max_prompt_tokens)


def decode_args(args, drafter: str, count: int):
    """The `decode` settings of one engine, from its flags, resolved as the CLI resolves them."""
    from dspark_jax import decode
    from dspark_jax.engine.decode_settings import resolve

    argv = ["--target", args.target, "--drafter", drafter, "--scheduler", args.scheduler, "--max-batch",
            str(args.max_batch), "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed), "--json",
            "--no-compare-ar"]
    if args.gamma:
        argv += ["--gamma", str(args.gamma)]
    if args.profile_sps:
        argv.append("--profile-sps")
    return resolve(decode.parse_args(argv)[0], count)[0]


def markdown(rows: list[dict], args, lossless: bool, prompt_lengths: list[int], slots: int) -> str:
    md = ["| engine | batching | aggregate tok/s | vs static | time (s) | tokens | mean tau | compile (s) |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = f"{r['vs_static']:.2f}x" if r.get("vs_static") else "-"
        tau = f"{r['mean_acceptance_length']:.2f}" if r.get("mean_acceptance_length") else "-"
        md.append(f"| {r['engine']} | {r['mode']} | {r['aggregate_tokens_per_s']:.1f} | {vs} | {r['wall_s']:.2f} | "
                  f"{r['tokens']} | {tau} | {r['compile_s']:.1f} |")
    engines = sorted({r["engine"] for r in rows})
    if "plain" in engines and len(engines) > 1:
        md += ["", "Speculative over plain, aggregate tokens/s, per batching mode:", ""]
        for mode in args.modes:
            got = {r["engine"]: r["aggregate_tokens_per_s"] for r in rows if r["mode"] == mode}
            md += [f"* {mode}: {got[e] / got['plain']:.2f}x ({e})" for e in engines if e != "plain"]
    warm = ", after an untimed one" if args.warmup else ""
    md.append(f"\nTarget {args.target}; {args.prompts} eval-split prompts (math / code / chat in turn, chat template, "
              f"{min(prompt_lengths)}-{max(prompt_lengths)} tokens, mean {sum(prompt_lengths) / len(prompt_lengths):.0f}); "
              f"up to {args.max_new_tokens} new tokens each, stop tokens on; greedy; --max-batch {slots}; "
              f"{args.repeats} run(s) of every configuration, interleaved{warm}. Timed: all prefills and decoding, XLA "
              "compilation excluded. continuous = decode's default (length groups), continuous-ungrouped = "
              "--no-length-groups, static = --batching static. Same tokens in every configuration (greedy): "
              f"{'yes' if lossless else 'NO'}.\n")
    return "\n".join(md)


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    from dspark_jax.data.prompt_files import PromptRecord
    from dspark_jax.engine import offline
    from dspark_jax.models.sampling import SamplingConfig

    engines = {"plain": decode_args(args, "none", args.prompts)}
    if args.drafter != "none":
        spec = decode_args(args, args.drafter, args.prompts)
        if spec.drafter != "none":
            engines[f"speculative ({spec.scheduler})"] = spec
    target = common.load_benchmark_target(args)
    prompts = eval_prompts(target.tokenizer, args.prompts, args.max_prompt_tokens)
    requests = [offline.Request(i, PromptRecord(f"eval prompt {i}", text=""), "", ids) for i, ids in enumerate(prompts)]
    runners = {name: (None if e.drafter == "none" else offline.load_speculative(e, target)) for name, e in engines.items()}
    sampling = SamplingConfig(0.0)
    pooled: dict = {}
    outputs: dict = {}
    compile_s: dict = {}
    configs = [(name, mode) for name in engines for mode in args.modes]
    passes = ([None] if args.warmup else []) + list(range(args.repeats))
    with tqdm(total=len(configs) * len(passes), unit="run", desc="offline") as bar:
        for rep in passes:
            turn = 0 if rep is None else rep % len(configs)
            for name, mode in configs[turn:] + configs[:turn]:
                e = dataclasses.replace(engines[name], batching="static" if mode == "static" else "continuous",
                                        length_groups=mode == "continuous")
                bar.set_postfix_str(f"{name} {mode}" + (" (warm-up)" if rep is None else ""))
                got = {}
                totals = offline.run_engine(e, target, runners[name], requests, sampling, args.seed,
                                           on_result=lambda r, ids, stats: got.__setitem__(r.index, ids))
                outputs.setdefault((name, mode), got)
                compile_s.setdefault((name, mode), totals["compile_s"])  # the first run compiles
                bar.update(1)
                if rep is None:
                    continue
                acc = pooled.setdefault((name, mode), {"wall_s": 0.0, "compile_s": 0.0, "tokens": 0, "rounds": 0,
                                                       "tau_sum": 0})
                for k in acc:
                    acc[k] += totals[k]
    rows = []
    for name, mode in configs:
        acc = pooled[(name, mode)]
        row = {"engine": name, "mode": mode, "aggregate_tokens_per_s": acc["tokens"] / acc["wall_s"],
               "wall_s": round(acc["wall_s"], 3), "tokens": acc["tokens"], "compile_s": round(compile_s[(name, mode)], 2)}
        if acc["rounds"]:
            row["mean_acceptance_length"] = acc["tau_sum"] / acc["rounds"]
        rows.append(row)
    for row in rows:
        static = next((r for r in rows if r["engine"] == row["engine"] and r["mode"] == "static"), None)
        if static is not None and row["mode"] != "static":
            row["vs_static"] = row["aggregate_tokens_per_s"] / static["aggregate_tokens_per_s"]
        tqdm.write(f"{row['engine']} {row['mode']}: {row['aggregate_tokens_per_s']:.1f} tok/s aggregate")
    reference = next(iter(outputs.values()))
    lossless = all(o == reference for o in outputs.values())
    lengths = [len(p) for p in prompts]
    common.write_benchmark(args, ("target", "drafter", "dtype", "scheduler", "gamma", "prompts", "max_new_tokens",
                                  "max_prompt_tokens", "max_batch", "repeats", "warmup", "seed"), rows,
                           markdown(rows, args, lossless, lengths, engines["plain"].max_batch), lossless=lossless,
                           engines={name: {"drafter": e.drafter, "scheduler": e.scheduler if e.drafter != "none" else None,
                                           "gamma": e.gamma} for name, e in engines.items()},
                           prompt_tokens={"min": min(lengths), "max": max(lengths),
                                          "mean": sum(lengths) / len(lengths)})
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main())
