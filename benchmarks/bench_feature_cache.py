"""What a feature cache build costs per token with the target's weights in each dtype, and how far the
features move (`data.feature_cache_dtype`, docs/training.md).

    python benchmarks/bench_feature_cache.py [--target smollm2-135m] [--taps 1,7,14,20,27] [--rows 8]
        [--seq-len 512] [--repeats 3]

One batch of --rows packed rows of --seq-len tokens (two examples per row, random tokens) through the
build's target pass (`pipeline.target_features`, the run's float32 activations) with the target's
weights in float32 and in bfloat16: median seconds per batch, tokens per second, and the relative
L2 difference of the bf16-weight features from the fp32-weight ones, taps and final hidden state
apart (the cache stores both as bf16, whose rounding alone is ~0.2% relative).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import int_list, write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--taps", type=int_list, default=[1, 7, 14, 20, 27], help="tap layers (the shipped drafter's)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="feature_cache_dtype")
    args = ap.parse_args()

    import jax
    import numpy as np

    from dspark_jax.checkpoints import registry
    from dspark_jax.data.pipeline import target_features
    from dspark_jax.training.trainer import target_feature_inputs

    rng = np.random.default_rng(0)
    half = args.seq_len // 2
    batch = dict(tokens=rng.integers(10, 40000, (args.rows, args.seq_len)).astype(np.int32),
                 positions=np.tile(np.arange(args.seq_len, dtype=np.int32) % half, (args.rows, 1)),
                 segment_ids=np.tile(np.repeat(np.arange(1, 3, dtype=np.int32), half), (args.rows, 1)))
    target = registry.load_target(args.target, dtype="float32")
    tokens = args.rows * args.seq_len
    rows, features = [], {}
    for dtype in ("float32", "bfloat16"):
        params, cfg = target_feature_inputs(target.params, target.config, dtype)  # what the build runs
        run = jax.jit(lambda p, b: target_features(p, cfg, b, tuple(args.taps)))  # noqa: B023
        features[dtype] = [np.asarray(a, np.float32) for a in jax.block_until_ready(run(params, batch))]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(params, batch))
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        rows.append({"weights": dtype, "s_per_batch": s, "tokens_per_s": tokens / s})
    for name, a, b in zip(("taps", "final hidden"), features["float32"], features["bfloat16"]):
        rows[1][f"rel_diff_{name.replace(' ', '_')}"] = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    speedup = rows[0]["s_per_batch"] / rows[1]["s_per_batch"]
    md = ("| target weights | s per batch | tokens/s | rel. diff, taps | rel. diff, final hidden |\n"
          "|---|---:|---:|---:|---:|\n")
    for r in rows:
        diffs = (f"{100 * r['rel_diff_taps']:.2f}% | {100 * r['rel_diff_final_hidden']:.2f}%"
                 if "rel_diff_taps" in r else "- | -")
        md += f"| {r['weights']} | {r['s_per_batch']:.2f} | {r['tokens_per_s']:.0f} | {diffs} |\n"
    md += (f"\n{args.target}, {args.rows} rows x {args.seq_len} tokens per batch, taps {args.taps}, float32 "
           f"activations, medians of {args.repeats} after a warm-up: bf16 weights build at {speedup:.2f}x the fp32 tokens/s. "
           "Nothing else ran on the machine.\n")
    write_results(args.name, {"settings": vars(args), "rows": rows, "speedup": speedup}, md)
    print(md)


if __name__ == "__main__":
    main()
