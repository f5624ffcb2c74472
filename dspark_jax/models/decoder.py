"""The target decoder: one pure-functional implementation for every supported family.

Parameters are a dict pytree. The decoder layers come in one of two layouts, a property of how the
params were built (`with_layout`), run by the same layer function and giving identical logits:

* "stacked": every layer weight stacked on a leading layer axis, the layer loop a `lax.scan` —
  compile time does not grow with depth (what accelerators want);
* "per_layer": a tuple of per-layer dicts, the layer loop unrolled in Python, q/k/v and gate/up
  fused and every matrix stored [out, in] (`FUSED`, `TRANSPOSED`) — on XLA CPU slicing a layer
  out of the stack inside the scan costs a copy of its weights per step and the scan's carried KV
  cache is copied per layer, so this layout decodes ~1.6x faster there.

The KV cache follows the params' layout (`init_cache`). It keeps values heads-major, [.., kv_heads,
max_len, head_dim], and keys transposed, [.., kv_heads, head_dim, max_len]: the two layouts in which
the query-key and probability-value products stream the cache with unit stride (on XLA CPU the
query-key product over keys stored [max_len, head_dim] ran at 8 GB/s, over [head_dim, max_len] at
20 GB/s: a decode step at batch 32 spends most of its attention time there).
There is one forward pass, `forward`, over a KV cache with per-row lengths:

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

from dspark_jax.core.platform import traced_for_cpu
from dspark_jax.models import cpu_kernels
from dspark_jax.models.config import ModelConfig


LAYOUTS = ("stacked", "per_layer")
PACKED_ATTENTION_BLOCK = 128  # tokens per query / key block of `forward_packed`'s attention


def default_layout() -> str:
    """The faster layout for the platform being traced for (see the module docstring)."""
    return "per_layer" if traced_for_cpu() else "stacked"


def layout_of(params: dict) -> str:
    return "per_layer" if isinstance(params["layers"], (tuple, list)) else "stacked"


# The per-layer layout also (a) fuses the projections that read the same input into one matrix and
# (b) stores every matrix transposed, [out, in] (a name ending in "_t"): fewer, wider matrix-vector
# products whose rows are contiguous stream the weights at close to the memory bandwidth on a CPU
# (measured: a [1536 -> 576] product at 20 GB/s as [in, out], 28 GB/s as [out, in]).
FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up")}
TRANSPOSED = ("wqkv", "wo", "w_gate_up", "w_down")


def _fused_widths(cfg: ModelConfig) -> dict:
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"wqkv": (q, kv, kv), "bqkv": (q, kv, kv), "w_gate_up": (f, f)}


def with_layout(params: dict, cfg: ModelConfig, layout: str) -> dict:
    """The same parameters with their decoder layers in `layout` ("stacked" or "per_layer")."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layer layout {layout!r} (one of {', '.join(LAYOUTS)})")
    if layout_of(params) == layout:
        return params
    layers = params["layers"]
    if layout == "per_layer":
        def one(i):
            lp = {k: w[i] for k, w in layers.items()}
            for fused, parts in FUSED.items():
                if parts[0] in lp:
                    lp[fused] = jnp.concatenate([lp.pop(p) for p in parts], axis=-1)
            for name in TRANSPOSED:
                lp[name + "_t"] = jnp.asarray(lp.pop(name).T)
            return lp
        return {**params, "layers": tuple(one(i) for i in range(cfg.num_layers))}
    widths = _fused_widths(cfg)

    def unfused(lp):
        lp = dict(lp)
        for name in TRANSPOSED:
            lp[name] = lp.pop(name + "_t").T
        for fused, parts in FUSED.items():
            if fused in lp:
                lp.update(zip(parts, jnp.split(lp.pop(fused), np.cumsum(widths[fused])[:-1], axis=-1)))
        return lp

    split = [unfused(lp) for lp in layers]
    return {**params, "layers": {k: jnp.stack([lp[k] for lp in split]) for k in split[0]}}


def activation_dtype(weight_dtype) -> str:
    """The activations' (and KV cache's) dtype for weights stored in `weight_dtype`: the same,
    except on a CPU, where bf16 arithmetic outside matrix products is emulated (a decode step in
    bf16 throughout measured 5x the fp32 one) and bf16 weights go with fp32 activations."""
    return "float32" if traced_for_cpu() else jnp.dtype(weight_dtype).name


def _moved_as_bits(a) -> bool:
    # XLA:CPU widens bf16 slices, dynamic slices and gathers to fp32 first, converting the WHOLE
    # array (a stacked drafter's weights every call: ~10 ms of its 26 ms pass, measured); moved as
    # uint16 bits they are not converted.
    return jnp.dtype(a.dtype).itemsize == 2 and jnp.issubdtype(a.dtype, jnp.floating) and traced_for_cpu()


def _as_bits(a: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(a, jnp.uint16) if _moved_as_bits(a) else a


def as_bits(tree):
    """`tree` with its 16-bit float arrays viewed as uint16, to be sliced or scanned over; undo
    with `from_bits(bits, tree)`."""
    return jax.tree.map(_as_bits, tree)


@jax.custom_vjp
def _bits_view(bits: jax.Array, like: jax.Array) -> jax.Array:
    """`bits` read as `like`'s dtype. The gradient goes to `like` (the same values, moved as a float
    array): through the uint16 bits it would be zero. Without a gradient `like` is dead code."""
    return jax.lax.bitcast_convert_type(bits, like.dtype)


_bits_view.defvjp(lambda bits, like: (_bits_view(bits, like), None), lambda _, g: (None, g))


def from_bits(bits, like):
    """The inverse of `as_bits`: `like` is the original tree, moved (sliced, scanned, gathered)
    the same way, so that gradients reach it (`_bits_view`)."""
    return jax.tree.map(lambda b, a: _bits_view(b, a) if b.dtype != a.dtype else b, bits, like)


def take_rows(table: jax.Array, index: jax.Array) -> jax.Array:
    """table[index] along axis 0 (an embedding lookup), without widening a bf16 table (`as_bits`)."""
    table = jnp.asarray(table)
    return from_bits(jnp.take(_as_bits(table), index, axis=0), jnp.take(table, index, axis=0))


# Specs of a weight stored [out, in] (rows contiguous): what the fp32 few-row CPU kernel computes.
_ROWS_OF_W = ("...i,oi->...o", "...d,vd->...v")


def weight_einsum(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """einsum(spec, x, w) of activations x against a weight w ("...i,oi->...o"-style specs), in the
    weight's dtype, accumulated and returned in `out_dtype` (default: the activations' dtype).

    Weights may be stored narrower than the activations (bf16 weights, fp32 activations: what
    `--dtype bfloat16` means on a CPU). On CPUs with AMX or AVX512-BF16 a bf16 product of 2-32 rows
    costs about what one fp32 row does, but XLA:CPU runs a one-row bf16 product through a slow
    generic loop (~6x a two-row one, measured), so a single row is computed as two, one dropped.
    fp32 products of up to 32 rows against a weight stored [out, in] run our CPU kernel
    (`cpu_kernels`), which streams the weight once for all rows.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if spec.replace(" ", "") in _ROWS_OF_W and out_dtype == jnp.float32 and cpu_kernels.usable(x, w):
        return cpu_kernels.matmul_t(x, w)
    one_row = w.dtype != out_dtype and x.size == x.shape[-1] and traced_for_cpu()
    xw = jnp.stack([x, x]) if one_row else x
    out = jnp.einsum(spec, xw.astype(w.dtype), w, preferred_element_type=out_dtype)
    return out[0] if one_row else out


def linear(lp: dict, name: str, x: jax.Array) -> jax.Array:
    """x @ W for the layer weight `name`, stored [in, out] or, in the per-layer layout, as name_t
    [out, in]."""
    if name + "_t" in lp:
        return weight_einsum("...i,oi->...o", x, lp[name + "_t"])
    return weight_einsum("...i,io->...o", x, lp[name])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    # stacked layout: a leading layer axis; per-layer layout: a tuple with one array per layer.
    k: jax.Array | tuple[jax.Array, ...]  # [(layers,) batch, kv_heads, head_dim, max_len] (transposed)
    v: jax.Array | tuple[jax.Array, ...]  # [(layers,) batch, kv_heads, max_len, head_dim]
    lengths: jax.Array  # [batch] int32: committed tokens per row

    @property
    def max_len(self) -> int:
        return (self.v[0] if isinstance(self.v, tuple) else self.v).shape[-2]

    @property
    def batch_axis(self) -> int:
        return 0 if isinstance(self.k, tuple) else 1


def keys_transposed() -> bool:
    """Whether the KV cache holds keys transposed, [B, Hkv, D, S], where values are [B, Hkv, S, D].
    On a CPU our decode-attention kernel reads keys so (a query's scores are products of contiguous
    rows); traced for another platform keys are laid out like values: with transposed keys the TPU
    compiler transposed each layer's whole cache (twice a layer and step) to write one token's keys."""
    return traced_for_cpu()


def key_seq_axis() -> int:
    """The sequence axis of a layer's cached keys [B, Hkv, ., .]."""
    return 3 if keys_transposed() else 2


def cached_keys(x: jax.Array) -> jax.Array:
    """Keys [B, T, Hkv, D] (as projected) -> as the cache holds them."""
    return transposed_keys(x) if keys_transposed() else heads_major(x)


def key_index(rows, positions) -> tuple:
    """The index of cached keys [B, Hkv, ., .] at (rows, positions): keys [..., Hkv, D] go there."""
    return (rows, slice(None), slice(None), positions) if keys_transposed() else (rows, slice(None), positions)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, layout: str = "stacked") -> KVCache:
    k_shape = (batch, cfg.num_kv_heads) + ((cfg.head_dim, max_len) if keys_transposed() else (max_len, cfg.head_dim))
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if layout == "per_layer":
        k = tuple(jnp.zeros(k_shape, cfg.dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(v_shape, cfg.dtype) for _ in range(cfg.num_layers))
    else:
        k, v = jnp.zeros((cfg.num_layers,) + k_shape, cfg.dtype), jnp.zeros((cfg.num_layers,) + v_shape, cfg.dtype)
    return KVCache(k, v, jnp.zeros((batch,), jnp.int32))


def cache_for(params: dict, cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An empty cache in the layout of `params`."""
    return init_cache(cfg, batch, max_len, layout_of(params))


def layer_get(kv, i):
    """Layer i of a cache's keys (or values): a tuple entry (Python int i) or a stack slice."""
    return kv[i] if isinstance(kv, tuple) else jax.lax.dynamic_index_in_dim(kv, i, 0, keepdims=False)


def layer_set(kv, i, value):
    if isinstance(kv, tuple):
        return kv[:i] + (value,) + kv[i + 1:]
    return jax.lax.dynamic_update_index_in_dim(kv, value, i, 0)


def layer_write(kv, i, index: tuple, value):
    """kv with `value` written at `index` of layer i (writes past the end dropped). A stack takes
    the write in place, at (i, *index): slicing the layer out, writing into it and setting it back
    makes the TPU compiler copy the layer's whole cache twice per layer and step."""
    if isinstance(kv, tuple):
        return layer_set(kv, i, kv[i].at[index].set(value, mode="drop"))
    return kv.at[(i,) + index].set(value, mode="drop")


def param_shapes(cfg: ModelConfig, layout: str = "stacked") -> dict:
    """Shape of every parameter (in `layout`); the loaders check against this and nothing else."""
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
    if cfg.post_norms:
        layers.update(attn_post_norm=(L, d), mlp_post_norm=(L, d))
    shapes = {"embed": (cfg.vocab_size, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    return spec_in_layout(shapes, cfg, layout, "shapes")


def spec_in_layout(spec: dict, cfg: ModelConfig, layout: str, kind: str) -> dict:
    """A per-parameter tree of tuples written for the stacked layout (kind "shapes" or "axes"),
    rewritten for `layout`: per layer, the leading layer entry goes, fused projections replace their
    parts (the fused axis is concatenated, hence unsharded), matrices are transposed, and the dict
    repeats."""
    if layout == "stacked":
        return spec
    one = {k: v[1:] for k, v in spec["layers"].items()}
    for fused, parts in FUSED.items():
        if parts[0] in one:
            members = [one.pop(p) for p in parts]
            last = sum(m[-1] for m in members) if kind == "shapes" else None
            one[fused] = members[0][:-1] + (last,)
    for name in TRANSPOSED:
        one[name + "_t"] = one.pop(name)[::-1]
    return {**spec, "layers": tuple(dict(one) for _ in range(cfg.num_layers))}


# Logical axis names of every parameter (see dspark_jax/distributed/sharding.py for the mesh mapping).
def param_logical_axes(cfg: ModelConfig, layout: str = "stacked") -> dict:
    layers = {
        "attn_norm": ("layers", "embed"), "wq": ("layers", "embed", "heads"),
        "wk": ("layers", "embed", "kv_heads"), "wv": ("layers", "embed", "kv_heads"),
        "wo": ("layers", "heads", "embed"), "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
        "bq": ("layers", "heads"), "bk": ("layers", "kv_heads"), "bv": ("layers", "kv_heads"),
        "q_norm": ("layers", None), "k_norm": ("layers", None),
        "attn_post_norm": ("layers", "embed"), "mlp_post_norm": ("layers", "embed"),
    }
    shapes = param_shapes(cfg)
    axes = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("embed", "vocab"),
            "layers": {k: layers[k] for k in shapes["layers"]}}
    return spec_in_layout({k: axes[k] for k in shapes}, cfg, layout, "axes")


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
    """cos, sin of the rotary angles, [B, T, 1, head_dim/2]: computed once, shared by all layers.
    Where sliding-window layers rotate with their own base (`cfg.local_rope`), both tables come
    stacked, [2, B, T, 1, head_dim/2] (full layers', local layers'); `layer_rope` picks."""
    def table(inv_freq):
        angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
        return _materialized(lambda a: (jnp.cos(a)[:, :, None, :], jnp.sin(a)[:, :, None, :]), angles)

    if not cfg.local_rope:
        return table(cfg.rope_inv_freq())
    (cos, sin), (cos_l, sin_l) = table(cfg.rope_inv_freq()), table(cfg.rope_inv_freq(local=True))
    return jnp.stack([cos, cos_l]), jnp.stack([sin, sin_l])


def _materialized(fn, x):
    """fn(x), computed once into arrays of its own on a CPU. XLA:CPU fuses an elementwise producer
    into each of its consumers and evaluates it per consumer element: the rotary tables' cos and
    sin ran in every layer's q and k rotation, per head (60 cos and 60 sin per SmolLM2 pass; a
    fifth of an 8-token verify pass's elementwise time). A conditional's results are buffers that
    no fusion reaches into; both branches are fn, so the (runtime) predicate changes nothing.
    Elsewhere, fn(x) as it is: XLA's GPU and TPU fusions recompute such producers cheaply."""
    if not traced_for_cpu():
        return fn(x)
    return jax.lax.cond(x.reshape(-1)[0] == x.reshape(-1)[0], fn, fn, x)


def layer_pick(cfg: ModelConfig, i, full, local):
    """`local` for a sliding-window layer i, else `full`; i is a Python int (per-layer layout) or
    traced (the scan), where the choice becomes a select."""
    if isinstance(i, int):
        return local if cfg.sliding_layers[i] else full
    sliding = jnp.asarray(cfg.sliding_layers)[i]
    return jax.tree.map(lambda f, loc: jnp.where(sliding, loc, f), full, local)


def layer_rope(cfg: ModelConfig, cos: jax.Array, sin: jax.Array, i):
    """Layer i's (cos, sin) from `rope_tables`."""
    if not cfg.local_rope:
        return cos, sin
    return layer_pick(cfg, i, (cos[0], sin[0]), (cos[1], sin[1]))


def layer_window(cfg: ModelConfig, i):
    """Layer i's attention window (keys in (t - window, t]), or None for a model without local
    layers; full layers of a model with local ones get a window no position reaches."""
    if not any(cfg.sliding_layers):
        return None
    return layer_pick(cfg, i, jnp.int32(2**30), jnp.int32(cfg.sliding_window))


def embed(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Token embeddings, scaled by `cfg.embed_scale` in the table's dtype (as Gemma does)."""
    x = jnp.asarray(params["embed"])[tokens].astype(cfg.dtype)
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    return x


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding, half-split convention. x: [B, T, H, D]."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def grouped_queries(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, H, D] -> [B, kv_heads, T*G, D]: the T x G queries of a KV head as one matrix (rows
    ordered (t, g)), so both attention products are plain batched matmuls over (batch, kv head)."""
    B, T, H, D = q.shape
    G = H // kv_heads
    return q.reshape(B, T, kv_heads, G, D).transpose(0, 2, 1, 3, 4).reshape(B, kv_heads, T * G, D)


def ungrouped(out: jax.Array, T: int) -> jax.Array:
    """The inverse of `grouped_queries` for the attention output: -> [B, T, H*D]."""
    B, kv_heads, TG, D = out.shape
    G = TG // T
    return out.reshape(B, kv_heads, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, kv_heads * G * D)


def key_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q [..., Q, D] . cached keys [..., D, S] or [..., S, D] (`keys_transposed`) -> fp32 [..., Q, S]."""
    return jnp.einsum("...qd,...ds->...qs" if keys_transposed() else "...qd,...sd->...qs", q, k,
                      preferred_element_type=jnp.float32)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float | None = None) -> jax.Array:
    """Grouped-query attention. q: [B, T, H, D]; k: [B, Hkv, D, S] (`keys_transposed`) or [B, Hkv,
    S, D] and v: [B, Hkv, S, D], as the cache holds them; visible: [B, T, S] bool; scale: of the
    scores (default head_dim ** -0.5)."""
    B, T, H, D = q.shape
    kv_heads = k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    scores = key_scores(grouped_queries(q, kv_heads), k) * scale
    mask = jnp.repeat(visible, H // kv_heads, axis=1)[:, None]  # rows ordered (t, g) like q's
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v, preferred_element_type=jnp.float32)
    return ungrouped(out, T).astype(q.dtype)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, scale: float | None = None,
                    window=None) -> jax.Array:
    """Causal attention of queries at absolute `q_positions` [B, T] over a KV cache k (see
    `attention`), v [B, Hkv, S, D]: a key at position s is visible to a query at position t iff s <= t (and, with
    a `window`, t - window < s).

    On a CPU, fp32 decode steps and verify passes run our kernel (`cpu_kernels.decode_attention`),
    which reads each row's visible keys only. Otherwise one row reads keys only as far as its
    furthest query (`chunked_attention`); several rows take one masked pass over the whole cache,
    since on XLA CPU slicing chunks out of a batch of caches costs more than the keys it skips
    (measured: 6.7 vs 3.2 ms a layer at 32 rows)."""
    if cpu_kernels.attention_usable(q, k, v):
        return cpu_kernels.decode_attention(q, k, v, q_positions, q.shape[-1] ** -0.5 if scale is None else scale,
                                            window)
    if q.shape[0] == 1:
        return chunked_attention(q, k, v, q_positions, scale=scale, window=window)
    return attention(q, k, v, key_visible(jnp.arange(v.shape[2], dtype=jnp.int32)[None, None, :],
                                            q_positions[:, :, None], window), scale)


def key_visible(key_pos: jax.Array, q_pos: jax.Array, window=None) -> jax.Array:
    """Causal visibility of keys to queries by absolute position, within `window` if given."""
    visible = key_pos <= q_pos
    return visible if window is None else visible & (key_pos > q_pos - window)


# A running softmax over chunks of keys ("flash" attention): (running max, denominator, weighted
# values) per query row, folded one chunk at a time, so attention can visit only the keys it needs.
def softmax_start(rows: tuple, D: int) -> tuple:
    f32 = jnp.float32
    return jnp.full(rows + (1,), -1e30, f32), jnp.zeros(rows + (1,), f32), jnp.zeros(rows + (D,), f32)


def softmax_fold(state: tuple, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float,
                 keys_t: bool = True) -> tuple:
    """Fold keys k [..., D, C] (keys_t) or [..., C, D] / values v [..., C, D] into the running
    softmax of queries q [..., Q, D]; visible broadcasts to [..., Q, C]."""
    running_max, denom, acc = state
    f32 = jnp.float32
    scores = jnp.einsum("...qd,...ds->...qs" if keys_t else "...qd,...sd->...qs", q, k, preferred_element_type=f32)
    scores = jnp.where(visible, scores * scale, -1e30)
    new_max = jnp.maximum(running_max, scores.max(-1, keepdims=True))
    # A query none of whose keys is in this chunk yet adds exp(0)-weighted junk here, which the
    # rescale by exp(-1e30 - real max) zeroes at its first visible key (its own is always one).
    probs = jnp.exp(scores - new_max)
    rescale = jnp.exp(running_max - new_max)
    acc = acc * rescale + jnp.einsum("...qs,...sd->...qd", probs.astype(v.dtype), v, preferred_element_type=f32)
    return new_max, denom * rescale + probs.sum(-1, keepdims=True), acc


def softmax_result(state: tuple) -> jax.Array:
    _, denom, acc = state
    return acc / denom


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, chunk: int = 256,
                      scale: float | None = None, window=None) -> jax.Array:
    """`cache_attention` reading keys only up to the furthest query position (and, with a
    window, from the earliest key the nearest query can see).

    Keys are visited in chunks (a `fori_loop` over a running softmax), as many as the queries
    need, so a step costs what the context holds, not what the cache could hold: decoding
    the 2,048th token of a long cache reads 2,048 keys, the 64th reads one chunk, and a local
    layer reads its window. Equal to `attention(q, k, v, key_visible(...))` up to float rounding."""
    B, T, H, D = q.shape
    kv_heads, S = v.shape[1], v.shape[2]
    G = H // kv_heads
    # At least two chunks: a slice spanning the whole cache makes XLA CPU copy the cache per layer.
    chunk = min(chunk, max(S // 2, 1))
    qg = grouped_queries(q, kv_heads)
    q_pos = jnp.repeat(q_positions, G, axis=1)[:, None, :, None]  # [B, 1, T*G, 1], rows (t, g) like q's
    num_chunks = jnp.minimum(jnp.max(q_positions) // chunk + 1, -(-S // chunk))
    first_chunk = 0 if window is None else jnp.clip((jnp.min(q_positions) - window + 1) // chunk, 0, num_chunks - 1)
    scale = D ** -0.5 if scale is None else scale

    def visit(c, state):
        start = jnp.minimum(c * chunk, S - chunk)  # the last chunk ends at S and overlaps the one before,
        key_pos = start + jnp.arange(chunk, dtype=jnp.int32)
        fresh = key_pos >= c * chunk  # so keys an earlier chunk already counted are masked
        return softmax_fold(state, qg, jax.lax.dynamic_slice_in_dim(k, start, chunk, axis=key_seq_axis()),
                            jax.lax.dynamic_slice_in_dim(v, start, chunk, axis=2),
                            fresh & key_visible(key_pos, q_pos, window), scale, keys_transposed())

    state = jax.lax.fori_loop(first_chunk, num_chunks, visit, softmax_start((B, kv_heads, T * G), D))
    return ungrouped(softmax_result(state), T).astype(q.dtype)


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, rows: jax.Array, positions: jax.Array,
                      valid: jax.Array, scale: float | None = None, window=None, chunk: int = 128,
                      span: int | None = None) -> jax.Array:
    """Causal attention of a prefill's flattened tokens among themselves (every row's cache empty).

    q [N, H, D], k, v [N, Hkv, D] as projected; rows, positions [N]; valid [N] bool. Each row's
    tokens are contiguous in the flat order and start at position 0 (`generate.flatten_prompts`),
    so token n sees exactly the flat tokens m <= n of its own row (within `window`). -> [N, H*D].

    Query blocks of `chunk` tokens visit key blocks from the one holding their earliest row's first
    token up to their own (nested scans over a running softmax): the cost follows the tokens
    and each prompt's length, not rows x longest prompt x cache as in the padded per-row layout
    (32 chat prompts: ~10x fewer scores). span (static), for reverse differentiation (training's
    packed rows): the most key blocks a query block can need (rows of at most L tokens:
    ceil((L - 1) / chunk) + 1), visited by a loop of static length."""
    N, H, D = q.shape
    kv_heads = k.shape[1]
    G = H // kv_heads
    C = min(chunk, N)
    nb = -(-N // C)
    pad = nb * C - N
    if pad:
        q, k, v = (jnp.pad(a, ((0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        rows, positions, valid = jnp.pad(rows, (0, pad)), jnp.pad(positions, (0, pad)), jnp.pad(valid, (0, pad))
    index = jnp.arange(nb * C, dtype=jnp.int32)
    row_start = index - positions  # flat index of each token's row's first token; nondecreasing
    qb = grouped_queries(q.reshape(nb, C, H, D), kv_heads)  # [nb, Hkv, C*G, D]
    kb = k.reshape(nb, C, kv_heads, D).transpose(0, 2, 3, 1)  # [nb, Hkv, D, C]
    vb = v.reshape(nb, C, kv_heads, D).transpose(0, 2, 1, 3)  # [nb, Hkv, C, D]
    q_index = jnp.repeat(index.reshape(nb, C), G, axis=1)[:, None, :, None]  # [nb, 1, C*G, 1], rows (t, g)
    q_row = jnp.repeat(rows.reshape(nb, C), G, axis=1)[:, None, :, None]
    scale = D ** -0.5 if scale is None else scale
    span = None if span is None else min(nb, span)

    def query_block(_, c):
        first_key = row_start[c * C] if window is None else jnp.maximum(row_start[c * C], c * C - window + 1)
        qi, qr = q_index[c], q_row[c]

        def fold(state, j):
            key_index = j * C + jnp.arange(C, dtype=jnp.int32)
            visible = (key_index <= qi) & (rows[key_index] == qr) & valid[key_index]
            if window is not None:
                visible &= key_index > qi - window
            return softmax_fold(state, qb[c], kb[j], vb[j], visible, scale)

        start = softmax_start((kv_heads, C * G), D)
        if span is None:
            state = jax.lax.fori_loop(first_key // C, c + 1, lambda j, state: fold(state, j), start)
        else:  # static loop bounds, so reverse-differentiable: key blocks before the row's first are skipped
            def visit(state, t):
                j = c - span + 1 + t
                return jax.lax.cond(j >= first_key // C, fold, lambda state, j: state, state, j), None

            state, _ = jax.lax.scan(visit, start, jnp.arange(span))
        return None, softmax_result(state)

    _, out = jax.lax.scan(query_block, None, jnp.arange(nb))
    return ungrouped(out, C).reshape(nb * C, H * D)[:N].astype(q.dtype)


def heads_major(x: jax.Array) -> jax.Array:
    """Values [B, T, Hkv, D] (as projected) -> [B, Hkv, T, D] (as cached and attended)."""
    return x.swapaxes(1, 2)


def transposed_keys(x: jax.Array) -> jax.Array:
    """Keys [B, T, Hkv, D] (as projected) -> [B, Hkv, D, T] (as cached and attended)."""
    return x.transpose(0, 2, 3, 1)


def project_qkv(lp: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    B, T, _ = x.shape
    if "wq" not in lp:  # per-layer layout: one matmul for the three projections
        qkv = linear(lp, "wqkv", x) + (lp["bqkv"] if cfg.qkv_bias else 0)
        q, k, v = jnp.split(qkv, np.cumsum(_fused_widths(cfg)["wqkv"])[:-1], axis=-1)
    else:
        q, k, v = linear(lp, "wq", x), linear(lp, "wk", x), linear(lp, "wv", x)
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return rope(q, cos, sin), rope(k, cos, sin), v


def mlp(lp: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if "w_gate" not in lp:  # per-layer layout
        gate, up = jnp.split(linear(lp, "w_gate_up", x), 2, axis=-1)
    else:
        gate, up = linear(lp, "w_gate", x), linear(lp, "w_up", x)
    act = jax.nn.silu(gate) if cfg.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    return linear(lp, "w_down", act * up)


def decoder_layer(lp: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array, attend):
    """One pre-norm decoder layer. `attend(lp, q, k, v) -> (out [B, T, H*D], aux)` supplies the
    attention of the caller's setting: a KV cache, packed training sequences, or the drafter's
    injected target context. Everything else about a layer lives here once."""
    eps = cfg.rms_norm_eps
    q, k, v = project_qkv(lp, cfg, rms_norm(x, lp["attn_norm"], eps), cos, sin)
    out, aux = attend(lp, q, k, v)
    out = linear(lp, "wo", out)
    x = x + (rms_norm(out, lp["attn_post_norm"], eps) if cfg.post_norms else out)
    out = mlp(lp, cfg, rms_norm(x, lp["mlp_norm"], eps))
    return x + (rms_norm(out, lp["mlp_post_norm"], eps) if cfg.post_norms else out), aux


def run_layers(params: dict, cfg: ModelConfig, x: jax.Array, cos, sin, attend, carry, tap_layers,
               remat_policy=None):
    """Run the decoder layers in the params' layout; also collect the residual stream after each tap
    layer. `attend(lp, q, k, v, carry, i)` sees layer i (a Python int in the per-layer layout, a
    traced one under the scan) and the caller's carry (e.g. the KV cache, see `layer_get`).

    Tap layer l means "after the l-th decoder layer" (0 = the embeddings), i.e. Hugging Face's
    `hidden_states[l]`. Only the requested layers are kept (not all L of them).

    remat_policy: a `jax.checkpoint` policy: under differentiation each layer keeps only what the
    policy saves and recomputes the rest in the backward pass (training memory, `run.remat`).
    """
    per_layer = layout_of(params) == "per_layer"

    def layer(lp, x, carry, i):
        return decoder_layer(lp, cfg, x, *layer_rope(cfg, cos, sin, i), lambda lp, q, k, v: attend(lp, q, k, v, carry, i))

    if remat_policy is not None:
        layer = jax.checkpoint(layer, policy=remat_policy, static_argnums=(3,) if per_layer else ())

    if per_layer:
        kept = {0: x}
        for i, lp in enumerate(params["layers"]):
            x, carry = layer(lp, x, carry, i)
            kept[i + 1] = x
        taps = jnp.stack([kept[t] for t in tap_layers]) if tap_layers else None
        return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), carry, taps

    taps = jnp.zeros((len(tap_layers),) + x.shape, x.dtype) if tap_layers else None
    slot_of = np.full(cfg.num_layers + 1, -1, np.int32)
    for slot, tap in enumerate(tap_layers):
        slot_of[tap] = slot
    slot_of = jnp.asarray(slot_of)

    def keep(taps, x, i):
        if taps is None:
            return None
        slot = slot_of[i]
        safe = jnp.maximum(slot, 0)
        value = jnp.where(slot >= 0, x, jax.lax.dynamic_index_in_dim(taps, safe, 0, keepdims=False))
        return jax.lax.dynamic_update_index_in_dim(taps, value, safe, 0)

    def body(state, layer_params):
        x, carry, taps, i = state
        x, carry = layer(from_bits(*layer_params), x, carry, i)
        return (x, carry, keep(taps, x, i + 1), i + 1), None

    layers = (as_bits(params["layers"]), params["layers"])
    (x, carry, taps, _), _ = jax.lax.scan(body, (x, carry, keep(taps, x, 0), jnp.int32(0)), layers)
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
    rows = jnp.arange(B)[:, None]

    def attend(lp, q, k_new, v_new, kv, i):
        # Scatter the new keys/values at each row's own positions; past the end is dropped.
        k_all = layer_write(kv[0], i, key_index(rows, positions), k_new)
        v_all = layer_write(kv[1], i, (rows, slice(None), positions), v_new)
        out = cache_attention(q, layer_get(k_all, i), layer_get(v_all, i), positions, cfg.attention_scale,
                              layer_window(cfg, i))
        return out, (k_all, v_all)

    cos, sin = rope_tables(cfg, positions)
    x = embed(params, cfg, tokens)
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
    B, S = tokens.shape
    segment_ids = jnp.asarray(segment_ids)
    # Attention runs over the flattened rows, each packed sequence as one prefill "row"
    # (`prefill_attention`): query blocks visit only the key blocks of their own sequences, not the
    # whole [S, S] square of a row (4 rows of 1,024 tokens, SmolLM2-135M on a Zen 3: 1.48x the
    # tokens/s in fp32).
    index = jnp.arange(B * S, dtype=jnp.int32)
    sequence = (jnp.arange(B, dtype=jnp.int32)[:, None] * (S + 1) + segment_ids).reshape(-1)
    first = jnp.concatenate([jnp.ones((1,), bool), sequence[1:] != sequence[:-1]])
    # Slot offset within the sequence (slot distance is position distance within a segment).
    offset = index - jax.lax.cummax(jnp.where(first, index, 0))
    valid = segment_ids.reshape(-1) > 0
    chunk = PACKED_ATTENTION_BLOCK

    def attend(lp, q, k, v, carry, i):
        flat = [a.reshape((B * S,) + a.shape[2:]) for a in (q, k, v)]
        out = prefill_attention(*flat, sequence, offset, valid, cfg.attention_scale, layer_window(cfg, i),
                                chunk=chunk, span=-(-(S - 1) // chunk) + 1)
        return out.reshape(B, S, -1), carry

    cos, sin = rope_tables(cfg, positions)
    x = embed(params, cfg, tokens)
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
    prefill: bool = False,
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
    default N). prefill (static): every row's cache is empty and its tokens lie contiguous in the
    flat order from position 0 (`generate.flatten_prompts`); attention then stays among this call's
    tokens (`prefill_attention`) instead of the padded [R, width] layout below.
    Returns (final-normed hidden [N, d], cache, taps [len(tap_layers), N, d] or None).
    """
    width = tokens.shape[0] if width is None else width
    R = cache.lengths.shape[0]
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

    def attend(lp, q, k_new, v_new, kv, i):
        k_all = layer_write(kv[0], i, key_index(write_rows, positions), k_new[0])
        v_all = layer_write(kv[1], i, (write_rows, slice(None), positions), v_new[0])
        if prefill:
            out = prefill_attention(q[0], k_new[0], v_new[0], rows, positions, valid, cfg.attention_scale,
                                    layer_window(cfg, i))[None]
            return out, (k_all, v_all)
        k_layer, v_layer = layer_get(k_all, i), layer_get(v_all, i)  # [R, Hkv, ., .], [R, Hkv, S, D]
        q_padded = jnp.zeros((R, width) + q.shape[2:], q.dtype).at[write_rows, slot].set(q[0], mode="drop")
        out = cache_attention(q_padded, k_layer, v_layer, padded_pos, cfg.attention_scale,
                              layer_window(cfg, i))  # [R, width, H*D]
        out = out.at[write_rows, slot].get(mode="fill", fill_value=0)[None]  # back to [1, N, H*D]
        return out, (k_all, v_all)

    cos, sin = rope_tables(cfg, positions[None])  # the flat tokens as one [1, N] "row"
    x = embed(params, cfg, tokens[None])
    hidden, (k_all, v_all), taps = run_layers(params, cfg, x, cos, sin, attend, (cache.k, cache.v), tap_layers)
    return hidden[0], KVCache(k_all, v_all, cache.lengths), (None if taps is None else taps[:, 0])


def logits(params: dict, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The (frozen) LM head, in fp32: [..., d] -> [..., vocab]."""
    if cfg.tie_word_embeddings:  # contract against the [V, d] table directly: no transposed copy
        return weight_einsum("...d,vd->...v", hidden, params["embed"], jnp.float32)
    return weight_einsum("...d,dv->...v", hidden, params["lm_head"], jnp.float32)
