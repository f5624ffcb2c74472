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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--gammas", default="4,8,12,16")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.drafters.dspark import init_drafter_params
    from dspark_jax.engine.speculative import SpecConfig, spec_prefill, spec_round
    from dspark_jax.generate import compiled, pad_prompts
    from dspark_jax.training.config import TrainConfig

    target = load_target("smollm2-135m")
    tcfg = target.config
    prompt = target.tokenizer.chat_prompt_ids("Write a Python function that checks whether a number is prime.")
    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        for gamma in [int(g) for g in args.gammas.split(",")]:
            timings = {}
            programs = {}
            for name, head in (("dspark", dict(head="markov", markov_rank=64, confidence=True)),
                               ("dflash", dict(head="none", markov_rank=0, confidence=False))):
                dcfg = TrainConfig(target="smollm2-135m", drafter=dict(
                    kind="dspark", num_layers=2, block_size=gamma, mask_token_id=16, **head)).drafter_config(
                        tcfg, target.name)
                dparams = init_drafter_params(dcfg, jax.random.key(0))
                cfg = SpecConfig(gamma=gamma)
                tokens, lengths, max_len = pad_prompts(tcfg, [prompt] * B, 4096, slack=gamma + 1)
                pre_args = (target.params, dparams, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32),
                            jnp.full((B,), 4096, jnp.int32), jax.random.key(0))
                statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
                run_prefill = compiled(spec_prefill, pre_args, dict(statics, max_len=max(max_len, 512)))
                run_round = compiled(spec_round, (target.params, dparams, run_prefill.out_info, None), statics)
                programs[name] = (run_prefill, run_round, pre_args, dparams)
                timings[name] = []
            for _ in range(args.rounds):
                for name, (run_prefill, run_round, pre_args, dparams) in programs.items():
                    state = run_prefill(*pre_args)
                    state, _ = run_round(target.params, dparams, state, None)  # warm the buffers
                    jax.block_until_ready(state)
                    t = time.perf_counter()
                    state, stats = run_round(target.params, dparams, state, None)
                    jax.block_until_ready(stats)
                    timings[name].append(time.perf_counter() - t)
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
