"""Datagen throughput: response tokens per second of `python -m dspark_jax.datagen` at each batch size.

    python benchmarks/bench_datagen.py [--batch-sizes 16,32] [--limit 40] [--max-new-tokens 256] [--xla-dot]
        [--dtypes float32,bfloat16] [--temperature 0]

The same prompts (--limit per set of gsm8k, humaneval and arena-hard-v2, train split, in datagen's
own plan) are generated with datagen's default sampling (T 0.7, top-p 0.8, top-k 20) and its
continuous batching (--batch-size rows) into a temporary folder per batch size, after the same run
once untimed (it compiles every program), for each weight dtype (`--dtypes`; datagen's `--dtype`);
`--temperature 0` times greedy datagen instead; tokens/s = response tokens / wall time of the timed run
(prefills, decode, shard writes). The responses do not depend on the batch size, so every row
generates the same tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import products_note, write_results  # noqa: E402

SETS = ("gsm8k", "humaneval", "arena-hard-v2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="16,32")
    ap.add_argument("--limit", type=int, default=40, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--name", default="datagen", help="results file name")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--xla-dot", action="store_true",
                    help="fp32 few-row products and decode attention through XLA's ops instead of our CPU kernels")
    ap.add_argument("--dtypes", default="float32", help="comma-separated weight dtypes (datagen's --dtype)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy datagen")
    args = ap.parse_args()
    if args.xla_dot:
        os.environ["DSPARK_CPU_KERNELS"] = "0"  # read when the first program is traced

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.training.datagen import generate_dataset

    rows = []
    for dtype in args.dtypes.split(","):
        target = load_target("smollm2-135m", dtype=dtype)
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            settings = dict(limit=args.limit, max_new_tokens=args.max_new_tokens, batch_size=batch, progress=False,
                            temperature=args.temperature)
            with tempfile.TemporaryDirectory() as warm, tempfile.TemporaryDirectory() as out:
                generate_dataset(target, SETS, "train", warm, **settings)  # compiles every batch's programs
                t0 = time.perf_counter()
                m = generate_dataset(target, SETS, "train", out, **settings)
                wall = time.perf_counter() - t0
            row = {"dtype": dtype, "batch": batch, "examples": m["num_examples"],
                   "response_tokens": m["response_tokens"], "wall_s": wall,
                   "response_tokens_per_s": m["response_tokens"] / wall}
            rows.append(row)
            print(row, flush=True)
    md = ["| weights | batch | examples | response tokens | wall s | response tokens/s |",
          "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['dtype']} | {r['batch']} | {r['examples']} | {r['response_tokens']} | {r['wall_s']:.1f} | {r['response_tokens_per_s']:.1f} |"
           for r in rows]
    sampling = ("greedy" if args.temperature == 0 else
                f"datagen's sampling (T {args.temperature:g}, top-p 0.8, top-k 20)")
    md.append(f"\nSmolLM2-135M-Instruct (fp32 activations), {sampling}, up to {args.max_new_tokens} "
              f"new tokens, {args.limit} train-split prompts each of {', '.join(SETS)}; continuous batching (a finished "
              "row takes the next prompt at once).\n")
    md.append(products_note(args.xla_dot))
    paths = write_results(args.name, {"rows": rows}, "\n".join(md), **({"directory": args.out} if args.out else {}))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
