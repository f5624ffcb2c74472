"""Cost of DSpark's sequential head: one full speculative round (draft + verify) with the Markov head
and confidence head vs the same drafter with both off (DFlash), for gamma in 4..16.

    python benchmarks/bench_head_cost.py [--batch-sizes 1,8] [--gammas 4,8,12,16] [--rounds 8]

Target SmolLM2-135M; drafters are randomly initialised (the cost does not depend on the weights),
2 layers, Markov rank 64. Each round verifies all gamma tokens (fixed policy) so both sides do the
same target work. Rounds are timed after compilation; the two variants alternate per repeat so
machine noise hits both alike. The paper's target is <= ~1-2% of a round at batch 128 on an
accelerator; this records the CPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results  # noqa: E402


HEADS = {"dspark": dict(head="markov", markov_rank=64, confidence=True),  # Markov head (r = 64) + confidence head
         "dflash": dict(head="none", markov_rank=0, confidence=False)}  # the same drafter without both


def head_variant(target, gamma: int, head: dict):
    """The 2-layer drafter config for `target` with block size `gamma` and the given head settings."""
    from dspark_jax.training.config import TrainConfig

    return TrainConfig(target="smollm2-135m", drafter=dict(
        kind="dspark", num_layers=2, block_size=gamma, mask_token_id=16, **head)).drafter_config(
            target.config, target.name)


def time_round_variants(target, prompt, batch: int, gamma: int, variants: dict, rounds: int,
                        max_new_tokens: int = 4096) -> dict:
    """Seconds of one speculative round (fixed policy: every row verifies all gamma tokens) for each
    variant {name: (drafter config, drafter params)}, `rounds` times each after compilation, the
    variants alternating per repeat so machine noise hits them alike. Every round starts from a
    fresh prefill of `batch` copies of `prompt` (one warm-up round first)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine.speculative import SpecConfig, spec_prefill, spec_round
    from dspark_jax.engine.generate import compiled, pad_prompts

    tcfg = target.config
    programs, timings = {}, {}
    for name, (dcfg, dparams) in variants.items():
        cfg = SpecConfig(gamma=gamma)
        tokens, lengths, max_len = pad_prompts(tcfg, [prompt] * batch, max_new_tokens, slack=gamma + 1)
        pre_args = (target.params, dparams, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32),
                    jnp.full((batch,), max_new_tokens, jnp.int32), jax.random.key(0))
        statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
        run_prefill = compiled(spec_prefill, pre_args, dict(statics, max_len=max(max_len, 512)))
        run_round = compiled(spec_round, (target.params, dparams, run_prefill.out_info, None), statics)
        programs[name] = (run_prefill, run_round, pre_args, dparams)
        timings[name] = []
    for _ in range(rounds):
        for name, (run_prefill, run_round, pre_args, dparams) in programs.items():
            state = run_prefill(*pre_args)
            state, _ = run_round(target.params, dparams, state, None)  # warm the buffers
            jax.block_until_ready(state)
            t = time.perf_counter()
            state, stats = run_round(target.params, dparams, state, None)
            jax.block_until_ready(stats)
            timings[name].append(time.perf_counter() - t)
    return timings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--gammas", default="4,8,12,16")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()

    import jax

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.drafters.dspark import init_drafter_params

    target = load_target("smollm2-135m")
    prompt = target.tokenizer.chat_prompt_ids("Write a Python function that checks whether a number is prime.")
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        for gamma in [int(g) for g in args.gammas.split(",")]:
            variants = {}
            for name, head in HEADS.items():
                dcfg = head_variant(target, gamma, head)
                variants[name] = (dcfg, init_drafter_params(dcfg, jax.random.key(0)))
            timings = time_round_variants(target, prompt, B, gamma, variants, args.rounds)
            with_head, without = (statistics.median(timings[n]) for n in ("dspark", "dflash"))
            row = {"batch": B, "gamma": gamma, "round_ms_dspark": 1e3 * with_head, "round_ms_dflash": 1e3 * without,
                   "head_share": (with_head - without) / with_head}
            rows.append(row)
            print(json.dumps(row), flush=True)
    md = ["| batch | gamma | round with head (ms) | round without (ms) | head share of the round |",
          "|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['batch']} | {r['gamma']} | {r['round_ms_dspark']:.1f} | {r['round_ms_dflash']:.1f} | "
                  f"{100 * r['head_share']:+.1f}% |")
    md.append("\nOne speculative round (2-layer drafter backbone + head scan + target verify of all gamma tokens "
              "+ commit) on SmolLM2-135M, median over rounds. 'Head' = Markov head (r = 64) + confidence head; "
              "without = the same drafter as DFlash. Negative shares are noise.\n")
    paths = write_results("head_cost", {"rows": rows}, "\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
