"""The speculative engine's floor: how fast it decodes when it never drafts (every step a plain one).

    python benchmarks/bench_plain_floor.py [--drafter dspark_jax/shipped/dspark_smollm2-135m] \\
        [--batch-sizes 1,8] [--temperatures 0] [--max-new-tokens 128] [--repeats 3] [--name plain_floor]

When drafts do not pay, the `auto` scheduler's gate runs plain target steps (DESIGN.md 3.3b); the
engine can then be no faster than plain decoding, and must not be slower. This measures that
floor: the same batch of eval-split gsm8k prompts through plain decoding (`generate`) and through
the speculative engine with a gate that always picks plain steps, alternating, in one process;
decode and prefill timed apart (the engine's prefill also builds the drafter's context of the
prompt), XLA compilation excluded. Greedy outputs must be token for token the same (at T > 0 the two
draw from the same distributions with different random streams).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter folder (default: the target's shipped drafter)")
    ap.add_argument("--batch-sizes", type=common.int_list, default=[1, 8])
    ap.add_argument("--temperatures", type=common.float_list, default=[0.0], help="sampling temperatures (0 = greedy)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="plain_floor")
    args = ap.parse_args()

    import numpy as np

    from dspark_jax.checkpoints.registry import default_drafter_path, load_target
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.engine.fallback import PlainStepGate
    from dspark_jax.engine.generate import generate
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.models.sampling import SamplingConfig

    target = load_target(args.target)
    drafter = args.drafter or default_drafter_path(target.name)
    loaded = load_drafter(drafter, target.config, target.name)
    dparams = loaded.decoding_params(target)
    prompts = common.eval_prompts(target.tokenizer, ("gsm8k",), max(args.batch_sizes), 1024)
    rows, md = [], ["| batch | T | plain decode s | engine, plain steps only, decode s | engine / plain | plain prefill s | "
                    "engine prefill s | engine / plain | same tokens |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for batch, temperature in [(b, t) for b in args.batch_sizes for t in args.temperatures]:
        sampling = SamplingConfig(temperature)
        plain, engine, plain_prefill, engine_prefill, same = [], [], [], [], True
        for rep in range(args.repeats + 1):  # the first pair warms both up and is not counted
            never_drafts = PlainStepGate(round_s=float("inf"), plain_s=1e-3, tau=1.0, probe_every=10**9)
            runs = {}
            for side in ("plain", "engine") if rep % 2 == 0 else ("engine", "plain"):
                if side == "plain":
                    runs[side] = generate(target.params, target.config, prompts[:batch],
                                          max_new_tokens=args.max_new_tokens, sampling=sampling, stop_ids=(), seed=rep)
                else:
                    runs[side] = speculative_generate(
                        target.params, target.config, dparams, loaded.config, prompts[:batch],
                        max_new_tokens=args.max_new_tokens, cfg=SpecConfig(gamma=loaded.config.block_size,
                                                                           sampling=sampling, stop_ids=(),
                                                                           plain_steps=True),
                        gate=never_drafts, temperatures=loaded.sts_for(temperature), seed=rep)
            same &= sampling.greedy and runs["plain"].token_ids == runs["engine"].token_ids
            if rep:
                plain.append(runs["plain"].decode_s)
                engine.append(runs["engine"].decode_s)
                plain_prefill.append(runs["plain"].prefill_s)
                engine_prefill.append(runs["engine"].prefill_s)
        row = {"batch": batch, "temperature": temperature, "plain_decode_s": float(np.median(plain)),
               "engine_decode_s": float(np.median(engine)),
               "plain_prefill_s": float(np.median(plain_prefill)),
               "engine_prefill_s": float(np.median(engine_prefill)),
               "same_tokens": bool(same) if sampling.greedy else None}
        row["ratio"] = row["engine_decode_s"] / row["plain_decode_s"]
        row["prefill_ratio"] = row["engine_prefill_s"] / row["plain_prefill_s"]
        rows.append(row)
        md.append(f"| {batch} | {temperature:g} | {row['plain_decode_s']:.3f} | {row['engine_decode_s']:.3f} | {row['ratio']:.3f} | "
                  f"{row['plain_prefill_s']:.3f} | {row['engine_prefill_s']:.3f} | {row['prefill_ratio']:.3f} | "
                  f"{('yes' if same else 'NO') if sampling.greedy else '-'} |")
        print(md[-1], flush=True)
    md.append(f"\n{args.max_new_tokens} new tokens per row (no stop), eval-split gsm8k prompts, drafter "
              f"`{drafter}` (never run: the gate always picks plain steps); medians of {args.repeats} alternating "
              "pairs after one warm-up pair.\n")
    paths = common.write_results(args.name, {"rows": rows, "drafter": drafter, "max_new_tokens": args.max_new_tokens,
                                             "repeats": args.repeats}, "\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
