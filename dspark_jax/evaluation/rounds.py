"""Full-length decoding rounds of a drafter on a set of prompts: what eval and calibrate measure.

Every round verifies all gamma draft tokens (policy "fixed"), so a round's accepted length and
confidence logits describe the drafter, not a verification policy (DESIGN.md 5).

The prompts are decoded in batches of `batch_size`, batch b with seed + its first prompt index. In
a multi-process run (`dspark_jax.distributed.runtime`) the batches are shared out whole: batch b is
decoded by process b % processes, with the prompts and seed it has in a one-process run, and every
process receives every batch's rounds back in batch order, so the pooled rounds (and every number
computed from them) are those of a one-process run.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import numpy as np

from dspark_jax.distributed import gather


class Rounds(NamedTuple):
    """Every full-length round (active rows only, in prompt-batch order) of a set of prompts."""

    confidence_logits: np.ndarray  # float [N, gamma] raw confidence logits (zeros without a head)
    accepted: np.ndarray  # int [N] draft tokens accepted (tau = accepted + 1)
    num_draft: np.ndarray  # int [N] draft tokens verified (gamma: verification is full length)
    generated_tokens: int  # tokens emitted over all prompts


def no_rounds(gamma: int) -> Rounds:
    return Rounds(np.zeros((0, gamma), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64), 0)


def collect_rounds(target, loaded, prompts: list[str], *, max_new_tokens: int, temperature: float,
                   batch_size: int, seed: int, progress: bool, gamma: int | None = None) -> Rounds:
    """Speculative decoding of chat-templated `prompts` in batches (seed + first prompt index per
    batch) with the "fixed" policy: every round verifies all gamma (default: block size) drafts.

    Every process of a multi-process run calls this with the same arguments: each decodes its share
    of the batches (batch b: process b % processes) and all return the rounds of every batch. A
    UserError on one process is raised on all."""
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.models.sampling import SamplingConfig

    tok = target.tokenizer
    gamma = gamma or loaded.config.block_size
    starts = list(range(0, len(prompts), batch_size))  # batch b begins at prompt b * batch_size

    def decode_mine() -> dict[int, Rounds]:
        dparams = loaded.decoding_params(target)
        cfg = SpecConfig(gamma=gamma, sampling=SamplingConfig(temperature), policy="fixed",
                         stop_ids=tuple(tok.eos_token_ids))
        mine = {}
        for start in gather.share(starts):
            encoded = [tok.chat_prompt_ids(p) for p in prompts[start: start + batch_size]]
            result = speculative_generate(target.params, target.config, dparams, loaded.config, encoded,
                                          max_new_tokens=max_new_tokens, cfg=cfg, seed=seed + start,
                                          progress=progress and gather.is_primary())
            parts = [no_rounds(gamma)]
            for r in result.rounds:
                active = r["active"]
                parts.append(Rounds(r["confidence_logits"][active, :gamma], r["accepted"][active],
                                    r["num_draft"][active], 0))
            rounds = pool_rounds(parts)
            mine[start] = rounds._replace(generated_tokens=sum(len(ids) for ids in result.token_ids))
        return mine

    every = gather_batches(gather.everywhere(decode_mine))
    if sorted(every) != starts:
        raise RuntimeError(f"the processes returned the rounds of batches {sorted(every)} for the batches "
                           f"{starts} (a broken split of the work)")
    return pool_rounds([no_rounds(gamma)] + [every[s] for s in starts])


def gather_batches(mine: dict[int, Rounds]) -> dict[int, Rounds]:
    """Every process's {first prompt index: Rounds} on every process (one process: `mine` as it is).
    A batch that two processes report is an error."""
    if gather.process_count() == 1:
        return dict(mine)
    every: dict[int, Rounds] = {}
    for data in gather.allgather_bytes(_pack(mine)):
        for start, rounds in _unpack(data).items():
            if start in every:
                raise RuntimeError(f"two processes decoded the batch at prompt {start} (a broken split of the work)")
            every[start] = rounds
    return every


def _pack(batches: dict[int, Rounds]) -> bytes:
    """Rounds by batch as .npz bytes (exact: the arrays keep their dtypes)."""
    arrays = {}
    for start, r in batches.items():
        arrays.update({f"{start}.{field}": np.asarray(getattr(r, field)) for field in Rounds._fields})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _unpack(data: bytes) -> dict[int, Rounds]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        starts = sorted({int(key.partition(".")[0]) for key in npz.files})
        return {s: Rounds(*(npz[f"{s}.{field}"] for field in Rounds._fields[:3]),
                          int(npz[f"{s}.generated_tokens"])) for s in starts}


def pool_rounds(parts) -> Rounds:
    """One Rounds record of several (rounds concatenated, generated tokens summed)."""
    return Rounds(np.concatenate([r.confidence_logits for r in parts]), np.concatenate([r.accepted for r in parts]),
                  np.concatenate([r.num_draft for r in parts]), sum(r.generated_tokens for r in parts))
