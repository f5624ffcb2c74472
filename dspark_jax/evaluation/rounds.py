"""Full-length decoding rounds of a drafter on a set of prompts: what eval and calibrate measure.

Every round verifies all gamma draft tokens (policy "fixed"), so a round's accepted length and
confidence logits describe the drafter, not a verification policy (DESIGN.md 5).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


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


def pool_rounds(parts) -> Rounds:
    """One Rounds record of several (rounds concatenated, generated tokens summed)."""
    return Rounds(np.concatenate([r.confidence_logits for r in parts]), np.concatenate([r.accepted for r in parts]),
                  np.concatenate([r.num_draft for r in parts]), sum(r.generated_tokens for r in parts))
