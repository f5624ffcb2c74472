"""The engine's view of a drafter: start from a prompt, propose a block, commit verified tokens.

DSpark / DFlash and Eagle3 keep different context caches; this module is the only place that
knows how each one maps the engine's events onto its own cache:

* DSpark / DFlash cache the projected target features of committed tokens (positions < anchor).
* Eagle3 caches pairs (feature at t, token at t+1) for t < anchor - 1 and carries the features of
  position anchor - 1 separately (`last_feature`): the first draft step runs that pair.

Engine events: `start` after the target prefilled the prompt (taps of every prompt token),
`propose` at the anchor, `commit` after verification with the taps of the verify pass
([x_0, x_1..x_l], of which the first `committed[b]` tokens were kept).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.drafters import dspark, eagle3
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.models.config import ModelConfig
from dspark_jax.engine.generate import unflatten
from dspark_jax.models.sampling import SamplingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    cache: dspark.DrafterCache | eagle3.Eagle3Cache
    last_feature: jax.Array  # [B, m*d] taps at anchor - 1 (Eagle3); [B, 0] for DSpark


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tokens: jax.Array  # [B, gamma]
    log_probs: jax.Array  # [B, gamma, V] processed distributions the tokens were drawn from
    confidence_logits: jax.Array | None  # [B, gamma] (DSpark with a confidence head)


def _taps_at(taps: jax.Array, index: jax.Array) -> jax.Array:
    """taps [B, T, F] at per-row index [B] -> [B, F]."""
    return jnp.take_along_axis(taps, index[:, None, None], axis=1)[:, 0]


def start(dparams, dcfg: DrafterConfig, target_params, tokens, lengths, taps, max_len: int, dtype) -> DraftState:
    """After the prompt prefill: tokens [B, W] (right-padded), lengths [B], taps [B, W, m*d]."""
    B = tokens.shape[0]
    if dcfg.kind == "eagle3":
        cache = eagle3.init_eagle3_cache(dcfg, B, max_len, dtype=dtype)
        next_tokens = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        cache = eagle3.eagle3_append_context(dparams, dcfg, target_params, cache, taps, next_tokens, lengths - 1)
        return DraftState(cache, _taps_at(taps, lengths - 1))
    cache = dspark.append_context(dparams, dcfg, dspark.init_drafter_cache(dcfg, B, max_len, dtype=dtype), taps, lengths)
    return DraftState(cache, jnp.zeros((B, 0), taps.dtype))


def start_flat(dparams, dcfg: DrafterConfig, target_params, tokens, lengths, flat, flat_taps, max_len: int,
               dtype) -> DraftState:
    """`start` from a flattened prefill: flat_taps [N, m*d] of the tokens of `flat` (a FlatPrompts).
    DSpark / DFlash project only the N real tokens; Eagle3 runs its layers over the padded rows."""
    if dcfg.kind == "eagle3":
        taps = unflatten(flat_taps, flat, tokens.shape[0], tokens.shape[1])
        return start(dparams, dcfg, target_params, tokens, lengths, taps, max_len, dtype)
    cache = dspark.init_drafter_cache(dcfg, tokens.shape[0], max_len, dtype=dtype)
    cache = dspark.context_from_flat(dparams, dcfg, cache, flat_taps, flat.rows, flat.positions, flat.valid, lengths)
    return DraftState(cache, jnp.zeros((tokens.shape[0], 0), flat_taps.dtype))


def propose(dparams, dcfg: DrafterConfig, target_params, tcfg: ModelConfig, state: DraftState, anchor, key,
            sampling: SamplingConfig, gamma: int) -> Draft:
    if dcfg.kind == "eagle3":
        tokens, log_probs, _ = eagle3.eagle3_propose(dparams, dcfg, target_params, tcfg, state.cache, anchor,
                                                     state.last_feature, key, sampling, gamma)
        return Draft(tokens, log_probs, None)
    p = dspark.propose(dparams, dcfg, target_params, tcfg, state.cache, anchor, key, sampling)
    conf = None if p.confidence_logits is None else p.confidence_logits[:, :gamma]
    return Draft(p.tokens[:, :gamma], p.log_probs[:, :gamma], conf)


def commit(dparams, dcfg: DrafterConfig, target_params, state: DraftState, verify_tokens, taps, committed,
           active) -> DraftState:
    """verify_tokens [B, g+1] = [x_0, x_1..x_g] and their taps [B, g+1, m*d]; row b kept the first
    committed[b] of them (0 for inactive rows)."""
    if dcfg.kind == "eagle3":
        # Pairs for positions anchor-1 .. anchor+a-1: features [last_feature, taps of x_0..x_{a-1}]
        # with next tokens x_0..x_a; the taps of x_a become the new last_feature.
        features = jnp.concatenate([state.last_feature[:, None], taps[:, :-1]], axis=1)
        cache = eagle3.eagle3_append_context(dparams, dcfg, target_params, state.cache, features, verify_tokens,
                                             committed)
        last = jnp.where(active[:, None], _taps_at(taps, jnp.maximum(committed - 1, 0)), state.last_feature)
        return DraftState(cache, last)
    return DraftState(dspark.append_context(dparams, dcfg, state.cache, taps, committed), state.last_feature)
