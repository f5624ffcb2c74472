"""Fit Sequential Temperature Scaling (DESIGN.md 2.6) for a DSpark drafter's confidence head.

    python -m dspark_jax.calibrate --drafter runs/dspark_smollm2-135m/drafter [--sets gsm8k,humaneval,...]

Runs speculative decoding with FULL-length verification (every round verifies all gamma draft
tokens) on held-out prompts (the eval split: never training prompts), records each round's raw
confidence logits and accepted length, fits per-position temperatures left to right, stores them
in the drafter checkpoint, and writes a report (JSON) plus reliability diagrams (PNG): ECE and
ROC-AUC per position before and after. Half the rounds fit the temperatures, the other half
measure them, so the "after" numbers are out of sample.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NamedTuple

import numpy as np

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, flag, run_cli, setting_flag
from dspark_jax.core.errors import UserError


class Rounds(NamedTuple):
    """Every full-length round (active rows only, in prompt-batch order) of a set of prompts."""

    confidence_logits: np.ndarray  # float [N, gamma] raw confidence logits (zeros without a head)
    accepted: np.ndarray  # int [N] draft tokens accepted (tau = accepted + 1)
    num_draft: np.ndarray  # int [N] draft tokens verified (gamma: verification is full length)
    generated_tokens: int  # tokens emitted over all prompts


def collect_rounds(target, loaded, prompts: list[str], *, max_new_tokens: int, temperature: float,
                   batch_size: int, seed: int, progress: bool, gamma: int | None = None) -> Rounds:
    """Speculative decoding of chat-templated `prompts` in batches (seed + first prompt index per
    batch) with the "fixed" policy: every round verifies all gamma (default: block size) drafts."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.engine.sampling import SamplingConfig

    tok = target.tokenizer
    gamma = gamma or loaded.config.block_size
    dparams = jax.tree.map(lambda a: jnp.asarray(a, target.config.dtype), loaded.params)
    cfg = SpecConfig(gamma=gamma, sampling=SamplingConfig(temperature), policy="fixed",
                     stop_ids=tuple(tok.eos_token_ids))
    logits, accepted, drafted = [np.zeros((0, gamma), np.float32)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    generated = 0
    encoded = [tok.chat_prompt_ids(p) for p in prompts]
    for start in range(0, len(encoded), batch_size):
        result = speculative_generate(target.params, target.config, dparams, loaded.config,
                                      encoded[start: start + batch_size], max_new_tokens=max_new_tokens,
                                      cfg=cfg, seed=seed + start, progress=progress)
        generated += sum(len(ids) for ids in result.token_ids)
        for r in result.rounds:
            logits.append(r["confidence_logits"][r["active"], :gamma])
            accepted.append(r["accepted"][r["active"]])
            drafted.append(r["num_draft"][r["active"]])
    return Rounds(np.concatenate(logits), np.concatenate(accepted), np.concatenate(drafted), generated)



@run_cli
def main(argv: list[str] | None = None) -> int:
    from dspark_jax.engine.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--drafter", required=True, help="drafter checkpoint folder (updated in place)")
    p.add_argument("--target", default=None, help="target (default: the one recorded in the drafter)")
    p.add_argument("--sets", default="gsm8k,math500,humaneval,mbpp,arena-hard-v2",
                   help="prompt sets; their EVAL split is used")
    p.add_argument("--limit", type=POSITIVE_INT, default=16,
                   help="prompts per set: the LAST N of its eval split (`eval` takes the first N, so "
                        "calibration and evaluation prompts stay disjoint while 2N <= the split size)")
    p.add_argument("--save-to", default=None,
                   help="write the calibrated drafter to this folder instead of updating --drafter in place")
    p.add_argument("--storage-dtype", default=None, choices=["float32", "bfloat16"],
                   help="weight storage of the written drafter (default: as loaded; bfloat16 halves the size)")
    p.add_argument("--max-new-tokens", type=flag(int, ge=2), default=128)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=1.0)
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--out", default=None, help="report folder (default: DRAFTER/calibration)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.data.splits import get_split, parse_sets
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config, save_drafter
    from dspark_jax.evaluation.calibration import (
        calibration_report,
        fit_sts,
        to_jsonable,
    )
    from dspark_jax.evaluation.plots import reliability_diagram

    # Everything checkable without the target is checked before it loads: the drafter's JSON, the sets.
    if not read_drafter_config(args.drafter).confidence:
        raise UserError("this drafter has no confidence head: nothing to calibrate")
    prompts = [q for name in parse_sets(args.sets) for q in get_split(name, "eval")[-args.limit:]]
    loaded = load_drafter(args.drafter)
    target = load_target(args.target or loaded.config.target_name)
    loaded.config.check_target(target.config, target.name)
    logits, accepted, _, _ = collect_rounds(target, loaded, prompts, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature, batch_size=args.batch_size,
                                            seed=args.seed, progress=not args.no_progress)
    if len(accepted) < 20:
        raise UserError(f"only {len(accepted)} decoding rounds were recorded: use more prompts or tokens")
    order = np.random.default_rng(args.seed).permutation(len(accepted))
    fit_idx, test_idx = order[: len(order) // 2], order[len(order) // 2:]
    held_out_temps = fit_sts(logits[fit_idx], accepted[fit_idx])
    report = calibration_report(logits[test_idx], accepted[test_idx], held_out_temps)
    temperatures = fit_sts(logits, accepted)  # the stored temperatures use every round
    out = args.out or os.path.join(args.drafter, "calibration")
    os.makedirs(out, exist_ok=True)
    summary = {"drafter": args.drafter, "target": target.name, "rounds": len(accepted),
               "prompts": len(prompts), "sets": args.sets, "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "temperatures": temperatures, "held_out_report": report}
    with open(os.path.join(out, "report.json.tmp"), "w") as f:
        json.dump(to_jsonable(summary), f, indent=1)
    os.replace(os.path.join(out, "report.json.tmp"), os.path.join(out, "report.json"))
    png = reliability_diagram(report, os.path.join(out, "reliability.png"),
                              title=f"STS calibration ({len(test_idx)} held-out rounds)")
    metadata = dict(loaded.metadata, calibration=to_jsonable({k: summary[k] for k in (
        "rounds", "prompts", "sets", "temperature", "max_new_tokens")}))
    save_drafter(args.save_to or args.drafter, loaded.config, loaded.params, sts_temperatures=temperatures,
                 metadata=metadata, dtype=args.storage_dtype or loaded.storage_dtype)
    print(json.dumps(to_jsonable({"rounds": len(accepted), "temperatures": temperatures,
                                  "ece_raw": report["ece_raw"], "ece_sts": report["ece_sts"],
                                  "auc_sts": report["auc_sts"], "report": os.path.join(out, "report.json"),
                                  "plot": png})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
