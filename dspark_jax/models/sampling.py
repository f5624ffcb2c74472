"""Logit processing and token sampling, shared by plain generation and speculative verification.

Lossless speculative decoding needs the draft and target distributions processed identically
(temperature, then top-k, then top-p), so both go through `processed_log_probs`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.core.config_checks import setting, validate


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = setting(0.0, ge=0)  # 0 = greedy
    top_k: int = setting(0, ge=0)  # 0 = off
    top_p: float = setting(1.0, gt=0, le=1)  # 1 = off

    def __post_init__(self):
        validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def processed_log_probs(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities after temperature, top-k and top-p (masked entries are -inf). [..., V]."""
    logits = logits.astype(jnp.float32)
    if cfg.greedy:
        return jax.nn.log_softmax(logits, axis=-1)
    logits = logits / cfg.temperature
    V = logits.shape[-1]
    if not (0 < cfg.top_k < V or cfg.top_p < 1.0):
        return jax.nn.log_softmax(logits, axis=-1)
    ranked, _ = _ranked(logits, cfg)
    logits = jnp.where(logits < _cutoff(logits, ranked, cfg), -jnp.inf, logits)
    return jax.nn.log_softmax(logits, axis=-1)


def _ranked(logits: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array | None]:
    """The candidates top-k / top-p choose from, best first: (values, vocabulary ids) of the top k,
    or (every value sorted, None) when only top-p is on."""
    if 0 < cfg.top_k < logits.shape[-1]:
        # top_k returns the k best already sorted, so top-p can work on k values instead of
        # sorting the whole vocabulary every step (the sort dominated sampled decoding on CPU).
        # The barrier keeps XLA:CPU from folding the slices below into the top-k, which turns it
        # into a whole-vocabulary sort per use (measured at batch 16: 135 ms a step, 1 ms with it).
        return jax.lax.optimization_barrier(jax.lax.top_k(logits, cfg.top_k))
    return jnp.sort(logits, axis=-1)[..., ::-1], None


def _cutoff(logits: jax.Array, ranked: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """The smallest (tempered) logit that top-k then top-p keep, [..., 1]: tokens below it are out."""
    if cfg.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token).
        # Normalised over every token top-k kept, ties at its cutoff included (not just the k ranked).
        probs = jnp.exp(ranked - jax.nn.logsumexp(jnp.where(logits < ranked[..., -1:], -jnp.inf, logits), -1, keepdims=True))
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before < cfg.top_p, axis=-1, keepdims=True)
        return jnp.take_along_axis(ranked, keep - 1, axis=-1)
    return ranked[..., -1:]


def gumbel(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard Gumbel noise of `shape`, from one key, or from one key per leading index (a key
    array of shape shape[:key.ndim]): then each row's draws depend on its own key alone, whatever
    else is in the batch."""
    if key.ndim == 0:
        return jax.random.gumbel(key, shape)
    rows = key.reshape(-1)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, shape[key.ndim:]))(rows)
    return noise.reshape(shape)


def sample(key: jax.Array, logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """One token per leading index: argmax when greedy, else a draw from the processed distribution
    (`key`: one key, or one per leading index, see `gumbel`).

    With top-k on, the draw is made among the k candidates (Gumbel noise for k values, not for the
    whole vocabulary: most of a sampled step's cost at a 49k vocabulary, 36 -> 8 ms at batch 32);
    a row where a tie at the cutoff keeps a token outside them draws over the vocabulary instead,
    so the draw is always from `processed_log_probs` exactly."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / cfg.temperature
    V = logits.shape[-1]

    def over_vocabulary(cutoff):
        kept = logits if cutoff is None else jnp.where(logits < cutoff, -jnp.inf, logits)
        return jnp.argmax(kept + gumbel(key, logits.shape), axis=-1).astype(jnp.int32)

    if not (0 < cfg.top_k < V or cfg.top_p < 1.0):
        return over_vocabulary(None)
    ranked, ids = _ranked(logits, cfg)
    cutoff = _cutoff(logits, ranked, cfg)
    if ids is None:
        return over_vocabulary(cutoff)

    def over_candidates():
        choice = jnp.argmax(jnp.where(ranked < cutoff, -jnp.inf, ranked) + gumbel(key, ranked.shape), axis=-1)
        return jnp.take_along_axis(ids, choice[..., None], axis=-1)[..., 0].astype(jnp.int32)

    # Every kept token is a candidate unless a tie at the k-th value keeps more than k. Rows that
    # hold them all draw among the candidates even when another row needs the vocabulary, so a
    # row's token never depends on the rest of the batch.
    fits = jnp.sum(logits >= cutoff, -1) == jnp.sum(ranked >= cutoff, -1)
    drawn = over_candidates()
    return jax.lax.cond(jnp.all(fits), lambda: drawn, lambda: jnp.where(fits, drawn, over_vocabulary(cutoff)))
