"""The DSpark drafter (DESIGN.md 2.1-2.5): a DFlash parallel backbone plus a sequential head.

DFlash is this same code with `head="none"` (no Markov table) and `confidence=False`.

Block layout
------------
A block is gamma = `dcfg.block_size` draft slots opened by an ANCHOR token x_0 at absolute position
p (the last committed token; in training, a token of the response):

    slot k:      0          1       ...  gamma-1
    input:       emb(x_0)   emb(MASK)    emb(MASK)       (the target's frozen embedding table)
    position:    p          p+1          p+gamma-1
    predicts:    x at p+1   x at p+2     x at p+gamma

The slot inputs never see the target's per-token features directly. Instead every draft layer i
attends, from the block's queries, to the keys/values

    [ W_K^i H_ctx ; W_K^i H_block ]   and   [ W_V^i H_ctx ; W_V^i H_block ]

where H_ctx = RMSNorm(fc([target taps])) is the fused target feature of each context token (with
layer i's own k-norm and RoPE at the context token's own position). A block query sees the context
tokens at positions < p (the anchor's own feature does not exist yet when drafting) and all gamma
slots of its block, bidirectionally. The final-normed hidden h_k goes through the target's frozen
LM head: base logits U_k.

The sequential head then makes the block semi-autoregressive: p_k = softmax(U_k + B_k(prev)) with
prev = x_0 for k = 0 and the previous draft token after that (Markov: B = W1[prev] W2; RNN: a gated
recurrent state over [s; W1[prev]; h_k], see `_head_step`). The confidence head predicts from
[h_k; W1[prev]] whether slot k survives verification given that slots < k did.

Two entry points share all of this:

* `train_forward`: all blocks of PACKED training rows in one parallel pass, the head teacher-forced
  with the ground-truth previous tokens. Who-sees-whom comes from token-level indices (segment ids,
  positions, each block's anchor slot); the attention scores are [blocks * gamma, S] per row plus
  the [gamma, gamma] block-internal part, never an [S, S] matrix.
* `append_context` + `propose`: decoding. The projected context K/V of committed tokens live in a
  `DrafterCache` (one entry per draft layer); `propose` runs one backbone pass over the block and
  then samples the head left to right in a `lax.scan`, returning the processed draft distribution
  each token was drawn from (what lossless rejection sampling needs).

Parameters are a dict pytree: {"fc", "hidden_norm", "layers" (decoder names, stacked), "final_norm",
"markov": {"w1", "w2"}, "rnn": {"w", "b"}, "confidence": {"w", "b"}} (heads only when configured).
The target's embedding and LM head are NOT drafter parameters; callers pass the frozen target
params and its ModelConfig. Decoding reads them rearranged (`decoding_layout`: per-layer layers,
"fc_t", "w2_t", "w_t", all stored [out, in]) and may add a "draft_head" and, with a draft vocabulary,
"draft_markov" (`with_draft_head`); every function here accepts either form. With a draft vocabulary
`propose` drafts over its N tokens only and maps them to the target's ids (`draft_space_logits`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core.errors import UserError
from dspark_jax.core.platform import traced_for_cpu
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig, processed_log_probs, sample

_MASKED = -1e30  # score of an invisible key (finite: a fully masked row must not produce NaN)


# --------------------------------------------------------------------------------------------------
# Parameters


def _check_dspark(dcfg: DrafterConfig) -> None:
    if dcfg.kind != "dspark":
        raise UserError(f"drafter kind {dcfg.kind!r} is not a DSpark/DFlash drafter")
    if not dcfg.target_layer_ids:
        raise UserError("DSpark drafter config has no target_layer_ids (the target taps it fuses)")
    if dcfg.mask_token_id is None or not 0 <= dcfg.mask_token_id < dcfg.vocab_size:
        raise UserError(f"DSpark drafter needs a mask_token_id in [0, {dcfg.vocab_size}), "
                        f"got {dcfg.mask_token_id}")


def confidence_input_size(dcfg: DrafterConfig) -> int:
    """Width of the confidence head's input: [h; W1[prev]], or h alone without a Markov table."""
    with_markov = dcfg.confidence_with_markov and dcfg.uses_markov_table
    return dcfg.hidden_size + (dcfg.markov_rank if with_markov else 0)


def drafter_param_shapes(dcfg: DrafterConfig) -> dict:
    """Shape of every drafter parameter; loaders check against this and nothing else."""
    _check_dspark(dcfg)
    d, r, V = dcfg.hidden_size, dcfg.markov_rank, dcfg.vocab_size
    shapes = {
        "fc": (len(dcfg.target_layer_ids) * d, d),
        "hidden_norm": (d,),
        "layers": decoder.param_shapes(dcfg.layer_config())["layers"],
        "final_norm": (d,),
    }
    if dcfg.uses_markov_table:
        shapes["markov"] = {"w1": (V, r), "w2": (r, V)}
    if dcfg.head == "rnn":
        # z = [s; W1[prev]; h] -> [gate; candidate; output], each r wide (the reference's order).
        shapes["rnn"] = {"w": (2 * r + d, 3 * r), "b": (3 * r,)}
    if dcfg.confidence:
        shapes["confidence"] = {"w": (confidence_input_size(dcfg),), "b": ()}
    return shapes


@functools.partial(jax.jit, static_argnames=("dcfg", "scale", "dtype"))
def init_drafter_params(dcfg: DrafterConfig, key: jax.Array, scale: float = 0.02,
                        dtype=jnp.float32) -> dict:
    """Random parameters: norms at one, biases at zero, everything else N(0, scale^2)."""
    shapes = drafter_param_shapes(dcfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))  # one draw per leaf: each can be sharded on its own
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("['b']"):
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((scale * jax.random.normal(k, shape)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


# --------------------------------------------------------------------------------------------------
# Backbone


def activations(dparams: dict):
    """The drafter's activation dtype: its weights' (`fc`), widened as the target's are
    (`decoder.activation_dtype`)."""
    return jnp.dtype(decoder.activation_dtype(_weight_dtype(dparams)))


def _weight_dtype(dparams: dict):
    return (dparams["fc"] if "fc" in dparams else dparams["fc_t"]).dtype


def decoding_layout(dparams: dict, dcfg: DrafterConfig, dtype) -> dict:
    """The params as decoding reads them fastest on this backend: in `dtype`, and on a CPU with
    every matrix stored [out, in] (the draft layers in the decoder's per-layer layout, `fc_t`,
    Markov `w2_t`, RNN `w_t`), so that the pass's few-row products stream each weight once through the
    CPU kernel (`cpu_kernels`), bf16 weights at half the bytes. The same function of the input."""
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), dparams)
    layout = decoder.default_layout()
    params = decoder.with_layout(params, dcfg.layer_config(), layout)
    if layout != "per_layer":
        return params
    params = {**params, "fc_t": params["fc"].T}
    del params["fc"]
    if "markov" in params:
        params["markov"] = {"w1": params["markov"]["w1"], "w2_t": params["markov"]["w2"].T}
    if "rnn" in params:
        params["rnn"] = {"w_t": params["rnn"]["w"].T, "b": params["rnn"]["b"]}
    return params


def fuse_context(dparams: dict, dcfg: DrafterConfig, ctx_features: jax.Array) -> jax.Array:
    """H_ctx = RMSNorm(fc([taps])): [..., m*d] -> [..., d]."""
    h = decoder.linear(dparams, "fc", ctx_features.astype(activations(dparams)))
    return decoder.rms_norm(h, dparams["hidden_norm"], dcfg.rms_norm_eps)


def block_attention(q, k_blk, v_blk, k_ctx, v_ctx, ctx_visible):
    """One softmax over a block's context keys and its own slots (bidirectional within the block).

    q: [B, N, g, H, D]; k_blk, v_blk: [B, N, g, Hkv, D] (the N blocks' own slots);
    k_ctx, v_ctx: [B, S, Hkv, D] (context keys shared by the row's blocks);
    ctx_visible: [B, N, S] bool, which context keys each block may see.
    Returns [B, N * g, H * D]. Splitting the keys keeps the block part at [g, g] per block instead of
    a dense [N*g, N*g] matrix over all blocks of a row.
    """
    B, N, g, H, D = q.shape
    kv_heads = k_ctx.shape[2]
    q = q.reshape(B, N, g, kv_heads, H // kv_heads, D)
    f32 = jnp.float32
    s_ctx = jnp.einsum("bnqkhd,bskd->bkhnqs", q, k_ctx, preferred_element_type=f32)
    s_ctx = jnp.where(ctx_visible[:, None, None, :, None, :], s_ctx, _MASKED)
    s_blk = jnp.einsum("bnqkhd,bnjkd->bkhnqj", q, k_blk, preferred_element_type=f32)
    S = k_ctx.shape[1]
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) / np.sqrt(D), axis=-1)
    p_ctx, p_blk = probs[..., :S].astype(v_ctx.dtype), probs[..., S:].astype(v_blk.dtype)
    out = (jnp.einsum("bkhnqs,bskd->bnqkhd", p_ctx, v_ctx, preferred_element_type=f32)
           + jnp.einsum("bkhnqj,bnjkd->bnqkhd", p_blk, v_blk, preferred_element_type=f32))
    return out.reshape(B, N * g, H * D).astype(q.dtype)


def target_embed(target_params: dict, dcfg: DrafterConfig, tokens: jax.Array, dtype) -> jax.Array:
    """The target's frozen embedding of `tokens`, scaled as the target scales it (Gemma); asarray:
    the table may be a host numpy array."""
    x = decoder.take_rows(target_params["embed"], tokens).astype(dtype)
    return x if dcfg.target_embed_scale == 1.0 else x * jnp.asarray(dcfg.target_embed_scale, dtype)


def _backbone(dparams, dcfg, target_params, block_tokens, block_positions, context_kv, ctx_visible,
              remat_policy=None):
    """Final-normed hidden states [B, N, g, d] of N blocks per row.

    block_tokens, block_positions: [B, N, g]; context_kv(lp, layer) -> (k_ctx, v_ctx) [B, S, Hkv, D]
    for that draft layer; ctx_visible: [B, N, S]; remat_policy: `decoder.run_layers`'.
    """
    B, N, g = block_tokens.shape
    lcfg = dcfg.layer_config()
    cos, sin = decoder.rope_tables(lcfg, block_positions.reshape(B, N * g))
    x = target_embed(target_params, dcfg, block_tokens.reshape(B, N * g), activations(dparams))

    def attend(lp, q, k, v, carry, layer):
        split = lambda a: a.reshape(B, N, g, *a.shape[2:])  # noqa: E731
        k_ctx, v_ctx = context_kv(lp, layer)
        return block_attention(split(q), split(k), split(v), k_ctx, v_ctx, ctx_visible), carry

    hidden, _, _ = decoder.run_layers(dparams, lcfg, x, cos, sin, attend, None, (), remat_policy)
    return hidden.reshape(B, N, g, -1)


def _project_context(lp: dict, lcfg: ModelConfig, h_ctx: jax.Array, positions: jax.Array):
    """A draft layer's keys/values of fused context features (its own wk/wv, k-norm, RoPE)."""
    cos, sin = decoder.rope_tables(lcfg, positions)
    _, k, v = decoder.project_qkv(lp, lcfg, h_ctx, cos, sin)  # the unused q is dead code under jit
    return k, v


# --------------------------------------------------------------------------------------------------
# The LM head over the draft vocabulary


def draft_head(target_params: dict, target_cfg: ModelConfig, dcfg: DrafterConfig) -> jax.Array:
    """The target's LM-head rows of the draft vocabulary, [N, d]: a frozen copy, made once per
    loaded drafter for decoding (`with_draft_head`) or gathered inside a training step."""
    ids = jnp.asarray(dcfg.draft_vocab, jnp.int32)
    if target_cfg.tie_word_embeddings:
        return decoder.take_rows(target_params["embed"], ids)
    return jnp.take(jnp.asarray(target_params["lm_head"]), ids, axis=1).T


def _target_head(target_params: dict, target_cfg: ModelConfig) -> jax.Array:
    """The target's whole LM head as [V, d] (rows contiguous)."""
    if target_cfg.tie_word_embeddings:
        return jnp.asarray(target_params["embed"])
    return jnp.asarray(target_params["lm_head"]).T


def with_draft_head(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig) -> dict:
    """dparams plus "draft_head", a frozen copy of the LM-head rows the drafter scores, in the
    drafter's weight dtype, when decoding reads it faster than the target's head: the N rows of a
    draft vocabulary (streamed, not gathered every pass, which would cost more than it saves), or
    the whole head when the drafter's dtype is narrower than the target's (a bf16 drafter beside an
    fp32 target streams half the bytes; its logits then come from the bf16-rounded head). With a
    draft vocabulary also "draft_markov", the Markov projection's rows of its tokens, [N, r]."""
    dtype = _weight_dtype(dparams)
    if dcfg.draft_vocab_size:
        _check_draft_vocab(dcfg)
        head = jax.jit(draft_head, static_argnums=(1, 2))(target_params, target_cfg, dcfg)
        if "markov" in dparams:  # the Markov table's output rows of the same tokens, [N, r]
            dparams = {**dparams, "draft_markov": _markov_rows(dparams, dcfg)}
    else:
        head = _target_head(target_params, target_cfg)
        if jnp.dtype(head.dtype).itemsize <= jnp.dtype(dtype).itemsize:
            return dparams  # the target's own head is as cheap to read
    return {**dparams, "draft_head": head.astype(dtype)}


def _markov_rows(dparams: dict, dcfg: DrafterConfig) -> jax.Array:
    """The Markov projection's rows of the draft vocabulary, [N, r] (rows contiguous)."""
    ids = jnp.asarray(dcfg.draft_vocab, jnp.int32)
    markov = dparams["markov"]
    return markov["w2_t"][ids] if "w2_t" in markov else jnp.take(markov["w2"], ids, axis=1).T


def _check_draft_vocab(dcfg: DrafterConfig) -> None:
    if dcfg.draft_vocab_size and len(dcfg.draft_vocab) != dcfg.draft_vocab_size:
        raise UserError(f"drafter has draft_vocab_size={dcfg.draft_vocab_size} but no draft_vocab ids "
                        "(training picks them from its data)")


def base_logits(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig,
                hidden: jax.Array) -> jax.Array:
    """The drafter's base logits U [..., V] in fp32: the target's LM head, over the draft
    vocabulary only when it has one (-inf elsewhere: those tokens are never drafted)."""
    if not dcfg.draft_vocab_size:
        if "draft_head" in dparams:
            return decoder.weight_einsum("...d,vd->...v", hidden, dparams["draft_head"], jnp.float32)
        return decoder.logits(target_params, target_cfg, hidden)
    return to_target_vocab(dcfg, draft_space_logits(dparams, dcfg, target_params, target_cfg, hidden),
                           target_cfg.vocab_size)


def draft_space_logits(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig,
                       hidden: jax.Array) -> jax.Array:
    """The base logits over the tokens the drafter can propose, fp32: [..., N] over its draft
    vocabulary (token dcfg.draft_vocab[j] at j), or `base_logits` [..., V] without one. Decoding
    drafts in this space: the LM head, the Markov bias, the sampling and the argmax all cost N / V
    of the whole vocabulary's."""
    if not dcfg.draft_vocab_size:
        return base_logits(dparams, dcfg, target_params, target_cfg, hidden)
    _check_draft_vocab(dcfg)
    head = dparams["draft_head"] if "draft_head" in dparams else draft_head(target_params, target_cfg, dcfg)
    return decoder.weight_einsum("...d,vd->...v", hidden, head, jnp.float32)


def to_target_vocab(dcfg: DrafterConfig, scores: jax.Array, vocab_size: int) -> jax.Array:
    """[..., N] scores over the draft vocabulary -> [..., V] over the target's, -inf elsewhere
    (probability exactly zero: rejection sampling against the target stays lossless)."""
    if not dcfg.draft_vocab_size:
        return scores
    full = jnp.full(scores.shape[:-1] + (vocab_size,), -jnp.inf, scores.dtype)
    return full.at[..., jnp.asarray(dcfg.draft_vocab, jnp.int32)].set(scores)


# --------------------------------------------------------------------------------------------------
# Sequential head and confidence head


def _markov_embedding(dparams: dict, prev: jax.Array) -> jax.Array:
    return decoder.take_rows(dparams["markov"]["w1"], prev).astype(activations(dparams))  # W1[prev]


def _head_step(dparams: dict, dcfg: DrafterConfig, state: jax.Array, prev: jax.Array, h: jax.Array):
    """One head step -> (new state, latent [..., r] whose W2 projection is the logit bias, or None).

    Markov: latent = W1[prev]. RNN: z = [s; W1[prev]; h] -> gate, candidate, output;
    s' = sig(gate) s + (1 - sig(gate)) tanh(candidate), latent = tanh(output).
    """
    if dcfg.head == "none":
        return state, None
    e = _markov_embedding(dparams, prev)
    if dcfg.head == "markov":
        return state, e
    z = decoder.linear(dparams["rnn"], "w", jnp.concatenate([state, e, h.astype(e.dtype)], axis=-1))
    z = z + dparams["rnn"]["b"]
    gate, candidate, output = jnp.split(z, 3, axis=-1)
    gate = jax.nn.sigmoid(gate)
    return gate * state + (1.0 - gate) * jnp.tanh(candidate), jnp.tanh(output)


def _head_bias(dparams: dict, latent: jax.Array | None, dcfg: DrafterConfig | None = None) -> jax.Array | float:
    """The head's logit bias from its latent: over the whole vocabulary, or over the draft
    vocabulary's rows (`draft_space_logits`'s space) when `dcfg` is given and has one."""
    if latent is None:
        return 0.0
    if dcfg is not None and dcfg.draft_vocab_size:
        rows = dparams["draft_markov"] if "draft_markov" in dparams else _markov_rows(dparams, dcfg)
        return decoder.weight_einsum("...i,oi->...o", latent, rows, jnp.float32)
    markov = dparams["markov"]
    if "w2_t" in markov:  # the decoding layout (`decoding_layout`): [V, r], rows contiguous
        return decoder.weight_einsum("...i,oi->...o", latent, markov["w2_t"], jnp.float32)
    return decoder.weight_einsum("...r,rv->...v", latent, markov["w2"], jnp.float32)


def _initial_state(dparams: dict, dcfg: DrafterConfig, lead_shape) -> jax.Array:
    return jnp.zeros((*lead_shape, dcfg.markov_rank if dcfg.head == "rnn" else 0), activations(dparams))


def _confidence_logits(dparams: dict, dcfg: DrafterConfig, h: jax.Array, prev: jax.Array) -> jax.Array:
    """Pre-sigmoid confidence of each slot from [h_k; W1[prev]] (h_k alone without a Markov table)."""
    feats = h
    if confidence_input_size(dcfg) > dcfg.hidden_size:
        feats = jnp.concatenate([h, _markov_embedding(dparams, prev).astype(h.dtype)], axis=-1)
    w, b = dparams["confidence"]["w"], dparams["confidence"]["b"]
    # one vector: widened to the features' dtype, the product is exact for bf16 weights at no cost
    return decoder.weight_einsum("...i,i->...", feats, w.astype(feats.dtype), jnp.float32) + b.astype(jnp.float32)


def _teacher_forced_bias(dparams, dcfg, hidden, prev):
    """Head bias [..., g, V] with the given previous tokens prev [..., g] (training)."""
    if dcfg.head == "none":
        return 0.0

    def step(state, xs):
        return _head_step(dparams, dcfg, state, *xs)

    # The recurrence runs over r-vectors only; the V-wide projection happens once, after the scan.
    state0 = _initial_state(dparams, dcfg, prev.shape[:-1])
    _, latents = jax.lax.scan(step, state0, (jnp.moveaxis(prev, -1, 0), jnp.moveaxis(hidden, -2, 0)))
    return _head_bias(dparams, jnp.moveaxis(latents, 0, -2))


# --------------------------------------------------------------------------------------------------
# Training forward over packed rows


def train_forward(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig,
                  batch: dict, ctx_features: jax.Array, target_last_hidden: jax.Array, *,
                  with_logits: bool = True, remat_policy=None) -> dict:
    """All blocks of a packed batch in one parallel pass, the sequential head teacher-forced.

    batch: tokens, positions, segment_ids (0 = padding), loss_mask [B, S]; block_start (the slot of
    each block's anchor), block_valid [B, NB]. ctx_features [B, S, m*d]: the target taps of every
    slot; target_last_hidden [B, S, d]: the target's final-normed hidden state.

    Returns, per [B, NB, g] slot: hidden (final-normed), target_hidden (the target's final-normed
    hidden state at slot a+k), labels (token at slot a+k+1), label_mask, prev_tokens (the head's
    teacher-forced input), confidence_logits when the confidence head is on, and with `with_logits`
    the vocabulary-wide `slot_logits` of every slot. Without them a caller computes those a few
    blocks at a time (`training.losses.blockwise`): a row's [NB, g, V] logits are the largest
    arrays of a large target's step. remat_policy: the draft layers' (`decoder.run_layers`).

    label_mask follows the reference: slot k is supervised iff its block is valid and slots 0..k all
    have their label inside the row, in the anchor's segment and in loss_mask (a contiguous prefix).
    """
    _check_dspark(dcfg)
    tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
    loss_mask, block_start, block_valid = batch["loss_mask"], batch["block_start"], batch["block_valid"]
    B, S = tokens.shape
    g = dcfg.block_size
    take = jax.vmap(lambda row, idx: row[idx])  # row-wise gather: [B, S, ...] x [B, ...] -> [B, ..., ...]

    offsets = jnp.arange(g, dtype=jnp.int32)
    anchor_pos = take(positions, block_start)  # [B, NB]
    anchor_seg = take(segment_ids, block_start)
    block_positions = anchor_pos[..., None] + offsets  # slot k sits at p + k
    anchors = take(tokens, block_start)
    block_tokens = jnp.where(offsets == 0, anchors[..., None], jnp.int32(dcfg.mask_token_id))

    # Labels: the token at slot a+k+1; teacher-forced head input: the token at slot a+k.
    label_slot = block_start[..., None] + offsets + 1  # [B, NB, g]
    safe_label = jnp.minimum(label_slot, S - 1)
    prev_slot = jnp.minimum(label_slot - 1, S - 1)  # (clamped slots past the row end are unsupervised)
    labels = take(tokens, safe_label)
    supervised = ((label_slot < S) & (take(segment_ids, safe_label) == anchor_seg[..., None])
                  & take(loss_mask, safe_label).astype(bool)
                  & (block_valid & (anchor_seg > 0))[..., None])
    label_mask = jnp.cumprod(supervised.astype(jnp.int32), axis=-1).astype(bool)
    prev = jnp.where(offsets == 0, anchors[..., None], take(tokens, prev_slot))

    # A block sees context tokens of its own sequence strictly before its anchor.
    ctx_visible = ((segment_ids[:, None, :] == anchor_seg[..., None]) & (segment_ids[:, None, :] > 0)
                   & (positions[:, None, :] < anchor_pos[..., None]) & block_valid[..., None])

    lcfg = dcfg.layer_config()
    h_ctx = fuse_context(dparams, dcfg, ctx_features)
    hidden = _backbone(dparams, dcfg, target_params, block_tokens, block_positions,
                       lambda lp, layer: _project_context(lp, lcfg, h_ctx, positions), ctx_visible, remat_policy)
    out = {
        "hidden": hidden,
        # Only at block slots: the target's full-sequence logits are never materialised.
        "target_hidden": take(target_last_hidden, prev_slot),
        "labels": labels,
        "label_mask": label_mask,
        "prev_tokens": prev,
    }
    if dcfg.confidence:
        out["confidence_logits"] = _confidence_logits(dparams, dcfg, hidden, prev)
    if with_logits:
        out.update(slot_logits(dparams, dcfg, target_params, target_cfg, hidden, prev, out["target_hidden"]))
    return out


def slot_logits(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig,
                hidden: jax.Array, prev_tokens: jax.Array, target_hidden: jax.Array) -> dict:
    """The vocabulary-wide outputs of teacher-forced slots [..., g]: draft_logits (base + head
    bias), base_logits and target_logits (the target's LM head at slot a+k, i.e. its distribution
    for the token at a+k+1)."""
    base = base_logits(dparams, dcfg, target_params, target_cfg, hidden)
    return {"draft_logits": base + _teacher_forced_bias(dparams, dcfg, hidden, prev_tokens),
            "base_logits": base,
            "target_logits": decoder.logits(target_params, target_cfg, target_hidden)}


# --------------------------------------------------------------------------------------------------
# Decoding: context cache + proposals


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterCache:
    # [draft layers, batch, max_len, kv_heads, head_dim] (kv_heads before max_len where
    # `context_heads_major`): projected context keys and values
    k: jax.Array
    v: jax.Array
    lengths: jax.Array  # [batch] int32: context tokens (committed tokens with a target feature)

    @property
    def max_len(self) -> int:
        return self.k.shape[3 if context_heads_major() else 2]

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """Draft layer i's context keys and values, [B, max_len, kv_heads, head_dim] each."""
        if context_heads_major():
            return self.k[i].swapaxes(1, 2), self.v[i].swapaxes(1, 2)
        return self.k[i], self.v[i]


def context_heads_major() -> bool:
    """The context cache's layout when decoding: [L, B, S, Hkv, D] on a CPU (as attention reads it);
    elsewhere heads before positions, [L, B, Hkv, S, D]: with a chip's one or two KV heads in the
    minor dimensions, the TPU's (8, 128) tiles pad them eightfold, and the compiler copied the whole
    cache to another layout in and out of every program (1.3 GB a step per chip at batch 32)."""
    return not traced_for_cpu()


def init_drafter_cache(dcfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> DrafterCache:
    L, H, D = dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim
    shape = (L, batch, H, max_len, D) if context_heads_major() else (L, batch, max_len, H, D)
    return DrafterCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def append_context(dparams: dict, dcfg: DrafterConfig, cache: DrafterCache, ctx_features: jax.Array,
                   num_new: jax.Array) -> DrafterCache:
    """Append `num_new[b]` context tokens (the first entries of ctx_features[b], [B, T, m*d]) to row b.

    They sit at positions lengths[b] + 0..num_new[b]-1. Entries past num_new[b] are written beyond the
    row's new length (invisible, overwritten later); writes past max_len are dropped.
    """
    B, T, _ = ctx_features.shape
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    k, v = _write_context(dparams, dcfg, cache, ctx_features, jnp.arange(B)[:, None], positions)
    return DrafterCache(k, v, cache.lengths + num_new.astype(jnp.int32))


def context_from_flat(dparams: dict, dcfg: DrafterConfig, cache: DrafterCache, ctx_features: jax.Array,
                      rows: jax.Array, positions: jax.Array, valid: jax.Array, lengths: jax.Array) -> DrafterCache:
    """A prefill's context from its flattened prompt tokens: ctx_features [N, m*d] of token n at
    (rows[n], positions[n]), valid [N] (False: padding, dropped), into an empty cache whose rows
    then hold `lengths` tokens. Projects the N real tokens, not rows x the longest prompt."""
    out_of_range = cache.k.shape[1]
    k, v = _write_context(dparams, dcfg, cache, ctx_features[None], jnp.where(valid, rows, out_of_range)[None],
                          positions[None])
    return DrafterCache(k, v, lengths.astype(jnp.int32))


def _write_context(dparams: dict, dcfg: DrafterConfig, cache: DrafterCache, ctx_features, rows, positions):
    """The cache's K/V with every draft layer's keys/values of ctx_features [..., m*d] written at
    (rows, positions) (broadcast to ctx_features' leading shape; out of range is dropped)."""
    lcfg = dcfg.layer_config()
    h_ctx = fuse_context(dparams, dcfg, ctx_features)
    if decoder.layout_of(dparams) == "per_layer":
        k_new, v_new = (jnp.stack(a) for a in zip(*(_project_context(lp, lcfg, h_ctx, positions)
                                                      for lp in dparams["layers"])))
    else:
        k_new, v_new = jax.vmap(lambda lp: _project_context(lp, lcfg, h_ctx, positions))(dparams["layers"])
    if not context_heads_major():
        k = cache.k.at[:, rows, positions].set(k_new.astype(cache.k.dtype), mode="drop")
        v = cache.v.at[:, rows, positions].set(v_new.astype(cache.v.dtype), mode="drop")
        return k, v
    # One write per layer: a write across the layers made the TPU compiler lay the cache out again.
    k, v = cache.k, cache.v
    for layer in range(dcfg.num_layers):
        k = k.at[layer, rows, :, positions].set(k_new[layer].astype(k.dtype), mode="drop")
        v = v.at[layer, rows, :, positions].set(v_new[layer].astype(v.dtype), mode="drop")
    return k, v


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    tokens: jax.Array  # [B, g] int32: draft tokens x_1..x_g (slot k proposes the token at p+k+1)
    log_probs: jax.Array  # [B, g, V] fp32: the PROCESSED distribution each token was drawn from
    logits: jax.Array  # [B, g, V] fp32: raw draft logits U_k + B_k(prev) before sampling processing
    confidence_logits: jax.Array | None  # [B, g] pre-sigmoid c_k (None without a confidence head)
    hidden: jax.Array  # [B, g, d]: the backbone's final-normed hidden states


def propose(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig,
            cache: DrafterCache, anchor_tokens: jax.Array, key: jax.Array, sampling: SamplingConfig,
            teacher_tokens: jax.Array | None = None) -> Proposal:
    """Draft one block per row after `anchor_tokens` [B], which sit at positions cache.lengths.

    One parallel backbone pass, then the sequential head as a scan over the g slots: slot k samples
    x_k ~ processed(softmax(U_k + B_k(prev))) with `sampling.sample(keys[k], ...)`, keys =
    jax.random.split(key, g); prev is the anchor for k = 0, else the previous slot's token.
    `teacher_tokens` [B, g] (optional) replaces the previous sampled token by teacher_tokens[:, k-1]
    in the head's input (teacher forcing, as in training; tokens are still sampled and returned).
    """
    _check_dspark(dcfg)
    B, g = anchor_tokens.shape[0], dcfg.block_size
    offsets = jnp.arange(g, dtype=jnp.int32)
    anchors = anchor_tokens.astype(jnp.int32)
    block_tokens = jnp.where(offsets == 0, anchors[:, None], jnp.int32(dcfg.mask_token_id))[:, None]
    block_positions = (cache.lengths[:, None] + offsets)[:, None]
    ctx_visible = (jnp.arange(cache.max_len) < cache.lengths[:, None])[:, None, :]  # keys < p
    hidden = _backbone(dparams, dcfg, target_params, block_tokens, block_positions,
                       lambda lp, layer: cache.layer(layer), ctx_visible)[:, 0]
    base = draft_space_logits(dparams, dcfg, target_params, target_cfg, hidden)  # [B, g, N or V]
    ids = jnp.asarray(dcfg.draft_vocab, jnp.int32) if dcfg.draft_vocab_size else None

    def step(carry, xs):
        state, prev = carry
        base_k, h_k, key_k, forced_prev = xs
        state, latent = _head_step(dparams, dcfg, state, prev, h_k)
        logits = base_k + _head_bias(dparams, latent, dcfg)
        token = sample(key_k, logits, sampling)
        token = token if ids is None else ids[token]  # ids ascending: ties go to the lower id either way
        conf = _confidence_logits(dparams, dcfg, h_k, prev) if dcfg.confidence else None
        next_prev = token if forced_prev is None else forced_prev
        return (state, next_prev), (token, processed_log_probs(logits, sampling), logits, conf)

    forced = None if teacher_tokens is None else jnp.moveaxis(teacher_tokens.astype(jnp.int32), -1, 0)
    xs = (jnp.moveaxis(base, 1, 0), jnp.moveaxis(hidden, 1, 0), jax.random.split(key, g), forced)
    carry = (_initial_state(dparams, dcfg, (B,)), anchors)
    _, (tokens, log_probs, logits, conf) = jax.lax.scan(step, carry, xs, unroll=True)
    slots_second = lambda a: None if a is None else jnp.moveaxis(a, 0, 1)  # noqa: E731
    vocab = lambda a: to_target_vocab(dcfg, slots_second(a), target_cfg.vocab_size)  # noqa: E731
    return Proposal(tokens=slots_second(tokens), log_probs=vocab(log_probs), logits=vocab(logits),
                    confidence_logits=slots_second(conf), hidden=hidden)
