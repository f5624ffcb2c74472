"""The target decoder: one pure-functional implementation for every supported family.

Parameters are a dict pytree with per-layer weights stacked on a leading layer axis (the layer
loop is a `lax.scan`, so compile time does not grow with depth). There is one forward pass,
`forward`, over a KV cache with per-row lengths:

* prefill  = `forward` on an empty cache, each row with its own prompt length;
* extend   = `forward` where row b appends `num_new[b]` tokens at its own position (the verify
             pass of speculative decoding);
* decode   = `forward` with one new token per row.

Keys at cache positions >= a row's length are invisible, so rolling a row back is just lowering
its length. `forward` returns final-normed hidden states; `logits` applies the LM head only where
the caller needs it (prefill needs one position per row, not the whole prompt).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array
    lengths: jax.Array  # [batch] int32: committed tokens per row

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype), jnp.zeros((batch,), jnp.int32))


def param_shapes(cfg: ModelConfig) -> dict:
    """Shape of every parameter; the loaders check against this and nothing else."""
    L, d, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv), "wo": (L, q, d),
        "mlp_norm": (L, d), "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    if cfg.qkv_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    shapes = {"embed": (cfg.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return shapes


# Logical axis names of every parameter (see dspark_jax/sharding.py for the mesh mapping).
def param_logical_axes(cfg: ModelConfig) -> dict:
    layers = {
        "attn_norm": ("layers", "embed"), "wq": ("layers", "embed", "heads"),
        "wk": ("layers", "embed", "kv_heads"), "wv": ("layers", "embed", "kv_heads"),
        "wo": ("layers", "heads", "embed"), "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
        "bq": ("layers", "heads"), "bk": ("layers", "kv_heads"), "bv": ("layers", "kv_heads"),
        "q_norm": ("layers", None), "k_norm": ("layers", None),
    }
    shapes = param_shapes(cfg)
    axes = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab"),
            "layers": {k: layers[k] for k in shapes["layers"]}}
    return {k: axes[k] for k in shapes}


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random parameters (tests and benchmarks); norms start at one."""
    leaves, treedef = jax.tree.flatten(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]]
    out = []
    for path, shape, k in zip(paths, leaves, keys):
        if "norm" in path:
            out.append(jnp.ones(shape, cfg.dtype))
        else:
            out.append((scale * jax.random.normal(k, shape)).astype(cfg.dtype))
    return jax.tree.unflatten(treedef, out)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotary angles, [B, T, 1, head_dim/2]: computed once, shared by all layers."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(cfg.rope_inv_freq())
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention. x: [B, T, H, D]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Grouped-query attention. q: [B, T, H, D]; k, v: [B, S, Hkv, D]; visible: [B, T, S] bool."""
    B, T, H, D = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(B, T, kv_heads, H // kv_heads, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) / np.sqrt(D)
    scores = jnp.where(visible[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H * D).astype(q.dtype)


def project_qkv(lp: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    B, T, _ = x.shape
    q = x @ lp["wq"]
    k = x @ lp["wk"]
    v = x @ lp["wv"]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp(lp: dict, x: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def decoder_layer(lp: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array, attend):
    """One pre-norm decoder layer. `attend(lp, q, k, v) -> (out [B, T, H*D], aux)` supplies the
    attention of the caller's setting: a KV cache, packed training sequences, or the drafter's
    injected target context. Everything else about a layer lives here once."""
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(lp, cfg, h, cos, sin)
    out, aux = attend(lp, q, k, v)
    x = x + out @ lp["wo"]
    return x + mlp(lp, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)), aux


def run_layers(params: dict, cfg: ModelConfig, x: jax.Array, cos, sin, attend, carry, tap_layers):
    """Scan the stacked layers; also collect the residual stream after each tap layer.

    Tap layer l means "after the l-th decoder layer" (0 = the embeddings), i.e. Hugging Face's
    `hidden_states[l]`. Only the requested layers are kept (not all L of them).
    """
    taps = jnp.zeros((len(tap_layers),) + x.shape, x.dtype) if tap_layers else None
    slot_of = np.full(cfg.num_layers + 1, -1, np.int32)
    for slot, layer in enumerate(tap_layers):
        slot_of[layer] = slot
    slot_of = jnp.asarray(slot_of)

    def keep(taps, x, layer):
        if taps is None:
            return None
        slot = slot_of[layer]
        safe = jnp.maximum(slot, 0)
        value = jnp.where(slot >= 0, x, jax.lax.dynamic_index_in_dim(taps, safe, 0, keepdims=False))
        return jax.lax.dynamic_update_index_in_dim(taps, value, safe, 0)

    def body(state, lp):
        x, carry, taps, i = state
        x, carry = decoder_layer(lp, cfg, x, cos, sin, lambda lp, q, k, v: attend(lp, q, k, v, carry, i))
        return (x, carry, keep(taps, x, i + 1), i + 1), None

    (x, carry, taps, _), _ = jax.lax.scan(body, (x, carry, keep(taps, x, 0), jnp.int32(0)), params["layers"])
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), carry, taps


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    num_new: jax.Array,
    tap_layers: Sequence[int] = (),
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Append `num_new[b]` tokens (the first entries of `tokens[b]`) to row b of the cache.

    tokens: [B, T] int; entries past num_new[b] are padding (their outputs are meaningless).
    Returns (final-normed hidden states [B, T, d], updated cache, taps) where taps is
    [len(tap_layers), B, T, d], the residual stream after each listed layer (see `run_layers`),
    or None.
    """
    B, T = tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= positions[:, :, None]  # causal over the whole cache
    rows = jnp.arange(B)[:, None]

    def attend(lp, q, k_new, v_new, kv, i):
        k_all, v_all = kv
        # Scatter the new keys/values at each row's own positions; past the end is dropped.
        k_layer = k_all[i].at[rows, positions].set(k_new, mode="drop")
        v_layer = v_all[i].at[rows, positions].set(v_new, mode="drop")
        out = attention(q, k_layer, v_layer, visible)
        return out, (jax.lax.dynamic_update_index_in_dim(k_all, k_layer, i, 0),
                     jax.lax.dynamic_update_index_in_dim(v_all, v_layer, i, 0))

    cos, sin = rope_tables(cfg, positions)
    x = params["embed"][tokens].astype(cfg.dtype)
    hidden, (k_all, v_all), taps = run_layers(params, cfg, x, cos, sin, attend, (cache.k, cache.v), tap_layers)
    return hidden, KVCache(k_all, v_all, cache.lengths + num_new.astype(jnp.int32)), taps


def forward_packed(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    tap_layers: Sequence[int] = (),
) -> tuple[jax.Array, jax.Array | None]:
    """Full forward over rows that pack several sequences (training; no cache).

    tokens, positions, segment_ids: [B, S]. A token attends causally to earlier slots of its own
    segment only; RoPE uses its position within its own sequence. Returns (hidden, taps).
    """
    S = tokens.shape[1]
    slot = jnp.arange(S)
    visible = (slot[None, None, :] <= slot[None, :, None]) & (segment_ids[:, :, None] == segment_ids[:, None, :])

    def attend(lp, q, k, v, carry, i):
        return attention(q, k, v, visible), carry

    cos, sin = rope_tables(cfg, positions)
    x = params["embed"][tokens].astype(cfg.dtype)
    hidden, _, taps = run_layers(params, cfg, x, cos, sin, attend, None, tap_layers)
    return hidden, taps



def forward_flat(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: KVCache,
    tap_layers: Sequence[int] = (),
    width: int | None = None,
) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Verify step over FLATTENED tokens of all requests (DESIGN.md 3.4): cost follows the token
    bucket N, not R x (gamma+1).

    tokens, rows, positions: [N] int; valid: [N] bool. Entry n is a new token of request `rows[n]`
    at absolute position `positions[n]`; entries with valid=False are padding: their K/V writes are
    dropped and their outputs are meaningless. In each layer every valid token's K/V is written at
    (rows[n], positions[n]) before attention, and token n attends to row rows[n]'s cache at key
    positions <= positions[n] (so cache slots of that row below positions[n] must already hold the
    committed prefix or tokens of this same call). Valid entries must have distinct (row, position)
    pairs; positions >= max_len are dropped like in `forward`.

    `cache.lengths` is NOT changed: the caller commits by setting lengths after acceptance (entries
    past the committed length are invisible to `forward`, so rejected drafts need no cleanup).
    width (static): the most new tokens any one row has in this call (gamma + 1 for a verify step;
    default N). Returns (final-normed hidden [N, d], cache, taps [len(tap_layers), N, d] or None).
    """
    width = tokens.shape[0] if width is None else width
    R = cache.k.shape[1]
    rows = rows.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    # Padding is routed to row R (out of range) so mode="drop" discards its writes and gathers.
    write_rows = jnp.where(valid, rows, R)
    # Attention strategy: the dense layers (projections, MLP, LM head: nearly all the flops) run on
    # the N flat tokens, but attention runs in the padded per-request layout [R, width]: queries are
    # scattered to (row, slot), attend to their own row's cache exactly as in `forward`, and are
    # gathered back. Its cost is R x width x S, small next to the weights, and nothing of size
    # N x R x S (every token against every row) or N x S x Hkv x D (a per-token copy of the cache)
    # is ever materialised.
    slot = jnp.clip(positions - cache.lengths[rows], 0, width - 1)
    padded_pos = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None]  # [R, width]
    visible = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :] <= padded_pos[:, :, None]

    def attend(lp, q, k_new, v_new, kv, i):
        k_all, v_all = kv
        k_layer = k_all[i].at[write_rows, positions].set(k_new[0], mode="drop")  # [R, S, Hkv, D]
        v_layer = v_all[i].at[write_rows, positions].set(v_new[0], mode="drop")
        q_padded = jnp.zeros((R, width) + q.shape[2:], q.dtype).at[write_rows, slot].set(q[0], mode="drop")
        out = attention(q_padded, k_layer, v_layer, visible)  # [R, width, H*D]
        out = out.at[write_rows, slot].get(mode="fill", fill_value=0)[None]  # back to [1, N, H*D]
        return out, (jax.lax.dynamic_update_index_in_dim(k_all, k_layer, i, 0),
                     jax.lax.dynamic_update_index_in_dim(v_all, v_layer, i, 0))

    cos, sin = rope_tables(cfg, positions[None])  # the flat tokens as one [1, N] "row"
    x = params["embed"][tokens[None]].astype(cfg.dtype)
    hidden, (k_all, v_all), taps = run_layers(params, cfg, x, cos, sin, attend, (cache.k, cache.v), tap_layers)
    return hidden[0], KVCache(k_all, v_all, cache.lengths), (None if taps is None else taps[:, 0])


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The (frozen) LM head, in fp32: [..., d] -> [..., vocab]."""
    if cfg.tie_word_embeddings:  # contract against the [V, d] table directly: no transposed copy
        return jnp.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
