"""DSpark training objective (DESIGN.md 2.5) and the teacher-forced acceptance proxy.

Every term is a weighted MEAN over valid block slots with per-slot weights w_k = exp(-(k-1)/g), so
the loss scale does not depend on how many blocks a batch packs:
    L = w_ce * CE(q, x*) + w_tv * ||q - p||_1 + w_conf * BCE(c, c*),   c* = sum_v min(q, p)
q is the drafter's full semi-autoregressive distribution with the head fed the ground-truth
previous token; p is the target's distribution at the same position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.core.config_checks import setting, validate


@dataclasses.dataclass(frozen=True)
class LossWeights:
    ce: float = setting(0.1, ge=0)
    tv: float = setting(0.9, ge=0)
    conf: float = setting(1.0, ge=0)
    decay: float = setting(4.0, gt=0)  # g in w_k = exp(-(k-1)/g)

    def __post_init__(self):
        validate(self)

    @classmethod
    def dflash(cls, decay: float = 4.0) -> "LossWeights":
        return cls(ce=1.0, tv=0.0, conf=0.0, decay=decay)


def position_weights(block_size: int, decay: float) -> jax.Array:
    return jnp.exp(-jnp.arange(block_size, dtype=jnp.float32) / decay)


def acceptance_rate(draft_log_probs: jax.Array, target_log_probs: jax.Array) -> jax.Array:
    """alpha = sum_v min(q, p) = 1 - 0.5 ||q - p||_1: the chance a draft from q survives verification."""
    return jnp.sum(jnp.minimum(jnp.exp(draft_log_probs), jnp.exp(target_log_probs)), axis=-1)


def expected_accept_length(alpha: jax.Array, mask: jax.Array) -> jax.Array:
    """Teacher-forced tau proxy per block: 1 + sum_k prod_{i<=k} alpha_i (bonus included).

    alpha, mask: [..., gamma]; a masked slot ends the block (nothing past it can be accepted).
    """
    survive = jnp.cumprod(jnp.where(mask, alpha, 0.0), axis=-1)
    return 1.0 + jnp.sum(survive, axis=-1)


def slot_statistics(draft_logits: jax.Array, target_logits: jax.Array, labels: jax.Array) -> dict:
    """The per-slot reductions over the vocabulary the loss needs, [...]: nll of the label under q,
    tv = ||q - p||_1 and whether q's argmax is the label. draft_logits, target_logits [..., V]."""
    q_log = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_log = jax.lax.stop_gradient(jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1))
    label_log = jnp.take_along_axis(q_log, labels[..., None], axis=-1)[..., 0]
    # A label outside a draft vocabulary has q = 0 (log -inf): no CE for it, TV still counts it.
    return {"nll": jnp.where(jnp.isfinite(label_log), -label_log, 0.0),
            "tv": jnp.sum(jnp.abs(jnp.exp(q_log) - jnp.exp(p_log)), axis=-1),
            "correct": jnp.argmax(q_log, axis=-1) == labels}


def blockwise(fn, chunk: int, *arrays: jax.Array):
    """fn(*arrays) for arrays [B, NB, ...], computed at most `chunk` blocks at a time (the largest
    divisor of NB not above it) with rematerialisation: only one chunk's vocabulary-wide
    intermediates exist at once, forward and backward (the backward pass recomputes them). fn maps
    [B, c, ...] arrays to a pytree of [B, c, ...] arrays; chunk 0 (or >= NB) calls it once on
    everything. Chunks run along the blocks, so rows keep their sharding over the data axis."""
    NB = arrays[0].shape[1]
    if chunk <= 0 or chunk >= NB:
        return fn(*arrays)
    chunk = max(c for c in range(1, chunk + 1) if NB % c == 0)
    split = lambda a: jnp.moveaxis(a.reshape(a.shape[0], NB // chunk, chunk, *a.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), tuple(split(a) for a in arrays))
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[1], NB, *a.shape[3:]), out)


def dspark_loss(outputs: dict, weights: LossWeights) -> tuple[jax.Array, dict]:
    """outputs: draft_logits, target_logits [..., gamma, V]; labels, label_mask [..., gamma];
    confidence_logits [..., gamma] (optional). Returns (loss, metrics)."""
    return loss_from_statistics(slot_statistics(outputs["draft_logits"], outputs["target_logits"], outputs["labels"]),
                                outputs, weights)


def loss_from_statistics(stats: dict, outputs: dict, weights: LossWeights) -> tuple[jax.Array, dict]:
    """(loss, metrics) of `slot_statistics` [..., gamma] with outputs' label_mask and, optional,
    confidence_logits [..., gamma]."""
    mask = outputs["label_mask"].astype(jnp.float32)
    w = position_weights(mask.shape[-1], weights.decay) * mask
    denom = jnp.maximum(jnp.sum(w), 1e-6)
    alpha = 1.0 - 0.5 * stats["tv"]
    ce_loss = jnp.sum(w * stats["nll"]) / denom
    tv_loss = jnp.sum(w * stats["tv"]) / denom
    loss = weights.ce * ce_loss + weights.tv * tv_loss
    metrics = {"loss_ce": ce_loss, "loss_tv": tv_loss}
    if "confidence_logits" in outputs:
        c_star = jax.lax.stop_gradient(alpha)
        z = outputs["confidence_logits"].astype(jnp.float32)
        bce = -(c_star * jax.nn.log_sigmoid(z) + (1.0 - c_star) * jax.nn.log_sigmoid(-z))
        conf_loss = jnp.sum(w * bce) / denom
        loss = loss + weights.conf * conf_loss
        metrics["loss_conf"] = conf_loss
    count = jnp.maximum(jnp.sum(mask, axis=tuple(range(mask.ndim - 1))), 1.0)
    correct = stats["correct"] * mask
    metrics.update(loss=loss, accuracy_per_position=jnp.sum(correct, axis=tuple(range(mask.ndim - 1))) / count,
                   **chain_acceptance_metrics(alpha, mask))
    return loss, metrics


def chain_acceptance_metrics(alpha: jax.Array, mask: jax.Array) -> dict:
    """alpha, mask [..., gamma] per drafted chain (a DSpark block, or an Eagle3 TTT chain): mean
    acceptance per position over supervised slots, and the teacher-forced tau proxy per chain."""
    mask = mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask, axis=tuple(range(mask.ndim - 1))), 1.0)
    return {"acceptance_per_position": jnp.sum(alpha * mask, axis=tuple(range(mask.ndim - 1))) / count,
            "expected_tau": _block_mean(expected_accept_length(alpha, mask > 0), mask)}


def _block_mean(per_block: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over blocks that have at least one supervised slot."""
    has = jnp.any(mask > 0, axis=-1).astype(jnp.float32)
    return jnp.sum(per_block * has) / jnp.maximum(jnp.sum(has), 1.0)
