"""Lossless verification of a drafted block (DESIGN.md 1).

Draft token x_k (array index k-1) was drawn from q_k; the target's distribution for it, p_k, comes
from the verify pass at the position of x_{k-1} (array index k-1 too, since the verify input is
[x_0, x_1, ..., x_l]). Only the first `num_draft[b]` draft tokens of row b were scheduled.

* T = 0: accept while x_k == argmax p_k; the bonus is argmax p at the first mismatch (or after l).
* T > 0: accept x_k with probability min(1, p_k(x_k) / q_k(x_k)); at the first rejection emit a
  sample of normalize(max(0, p_k - q_k)); if all l pass, emit a sample of p_{l+1}.
Both distributions must be the PROCESSED ones (temperature / top-k / top-p applied identically).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _leading_true(ok: jax.Array) -> jax.Array:
    """Length of the run of True at the start of each row: [B, g] bool -> [B] int32."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_greedy(draft_tokens: jax.Array, target_logits: jax.Array, num_draft: jax.Array):
    """draft_tokens [B, g]; target_logits [B, g+1, V]; num_draft [B] -> (accepted [B], bonus [B])."""
    g = draft_tokens.shape[1]
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, g+1]
    scheduled = jnp.arange(g)[None, :] < num_draft[:, None]
    accepted = _leading_true((draft_tokens == best[:, :g]) & scheduled)
    bonus = jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0]
    return accepted, bonus


def verify_sampled(key: jax.Array, draft_tokens: jax.Array, draft_log_probs: jax.Array,
                   target_log_probs: jax.Array, num_draft: jax.Array):
    """Rejection sampling. draft_log_probs [B, g, V] (q), target_log_probs [B, g+1, V] (p)."""
    B, g = draft_tokens.shape
    k_accept, k_bonus = jax.random.split(key)
    pick = lambda lp: jnp.take_along_axis(lp[:, :g], draft_tokens[..., None], axis=-1)[..., 0]  # noqa: E731
    log_ratio = pick(target_log_probs) - pick(draft_log_probs)
    u = jax.random.uniform(k_accept, (B, g))
    scheduled = jnp.arange(g)[None, :] < num_draft[:, None]
    accepted = _leading_true((jnp.log(u) < log_ratio) & scheduled)

    rejected = accepted < num_draft
    p = jnp.exp(jnp.take_along_axis(target_log_probs, accepted[:, None, None], axis=1)[:, 0])
    q_index = jnp.minimum(accepted, g - 1)[:, None, None]
    q = jnp.exp(jnp.take_along_axis(draft_log_probs, q_index, axis=1)[:, 0])
    residual = jnp.where(rejected[:, None], jnp.maximum(p - q, 0.0), p)
    # A rejection implies p(x) < q(x) somewhere, so the residual has mass; guard rounding anyway.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 1e-12, residual, p)
    bonus = jax.random.categorical(k_bonus, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, bonus
