"""Eagle3: the autoregressive baseline drafter (one causal decoder layer on fused target features).

Inputs. At position t the drafter sees the pair (g_t, x_{t+1}): g_t = fc([H(l_1); ...; H(l_m)])_t,
the target's tapped hidden states at position t fused to width d (no norm after fc), and x_{t+1}, the
token the target put after it. The layer's q/k/v read the 2d-wide
[RMSNorm_input(embed(x_{t+1})); RMSNorm_hidden(g_t)] (in that order); its residual stream starts
from g_t. The output h_t, through the final norm and the target's frozen LM head, predicts x_{t+2}.
Embedding and LM head are the target's own (`target_params`), never the drafter's.

Training-time test (TTT). Training unrolls the drafter on its own outputs for `steps` passes over
the whole sequence. Pass i holds, at position t, the chain that drafts token t+2+i:

    pass 0:  input [embed(x_{t+1});   g_t            ]  key K_0[t], RoPE position t
    pass i:  input [embed(x_{t+1+i}); h^{(i-1)}_t    ]  key K_i[t], RoPE position t+i

(tokens past the end of the row are id 0). A query of pass i at position t attends causally to the
pass-0 keys K_0[0..t] (keys made from target features: committed context) and to its own chain's
later keys K_1[t], ..., K_i[t] at the same position (a diagonal). This is exactly what chain
drafting sees at inference: the committed context plus the keys of the tokens drafted so far in
this round. Pass i is supervised by the target's next-token distribution at position t+1+i, on
position_mask_i = position_mask_0 shifted left by i, where position_mask_0 = loss_mask with each
row's last token masked (it has no next-token target); the reference also blanks pass i's
attention at a row's last i positions, which nothing supervised depends on. Each pass's loss is the soft cross-entropy
summed over the masked positions and divided by B*S (the reference's "local mean"); the total is
sum_i decay**i * loss_i. With `loss_slots` (DrafterConfig.ttt_at_anchors in training) the passes
still run over whole rows but the loss, and both LM heads, only at the given positions.

Inference (chain drafting). The cache holds the layer's K/V for every committed position whose pair
(g_t, x_{t+1}) is known EXCEPT the newest one: with committed tokens x_0..x_n where the target has
processed x_0..x_{n-1} (features g_0..g_{n-1}) and x_n is the anchor/bonus token it just sampled,
the cache holds positions 0..n-2 and `eagle3_propose(last_token=x_n, last_feature=g_{n-1})` runs
the pair (g_{n-1}, x_n) at position n-1 as its first step. Each step's own output hidden replaces g
for the next step. After verification the caller appends the pairs that became known (starting
again at position n-1, whose K/V propose did not keep) and proposes from the new bonus token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.checkpoints.assemble import NameTable
from dspark_jax.drafters import deepspec, dspark
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig, processed_log_probs


# --------------------------------------------------------------------------------------------------
# Parameters


def eagle3_param_shapes(dcfg: DrafterConfig) -> dict:
    """Shape of every drafter parameter (the embedding and LM head are the target's, not here)."""
    L, d, f = dcfg.num_layers, dcfg.hidden_size, dcfg.intermediate_size
    q, kv = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    layers = {
        "input_norm": (L, d), "hidden_norm": (L, d),  # norms of the embedding / feature halves
        "wq": (L, 2 * d, q), "wk": (L, 2 * d, kv), "wv": (L, 2 * d, kv), "wo": (L, q, d),
        "mlp_norm": (L, d), "w_gate": (L, d, f), "w_up": (L, d, f), "w_down": (L, f, d),
    }
    if dcfg.qk_norm:
        layers.update(q_norm=(L, dcfg.head_dim), k_norm=(L, dcfg.head_dim))
    return {"fc": (len(dcfg.target_layer_ids) * d, d), "layers": layers, "final_norm": (d,)}


def init_eagle3_params(dcfg: DrafterConfig, key: jax.Array, scale: float = 0.02) -> dict:
    """Random parameters: norms at one, everything else N(0, scale^2)."""
    shapes = eagle3_param_shapes(dcfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = [jnp.ones(shape, jnp.float32) if "norm" in jax.tree_util.keystr(path)
              else scale * jax.random.normal(k, shape, jnp.float32)
              for (path, shape), k in zip(flat, keys)]
    return jax.tree.unflatten(treedef, leaves)


# --------------------------------------------------------------------------------------------------
# The layer stack and its attention


def _run_layers(params: dict, dcfg: DrafterConfig, embeds: jax.Array, g: jax.Array, positions: jax.Array,
                attend, layer_inputs=None, remat_policy=None):
    """All Eagle3 layers over embeds, g: [B, T, d] at `positions` [B, T] -> (h, layer_outputs).

    `attend(q, k, v, inputs) -> (out, outputs)` supplies the attention; `inputs` is this layer's
    slice of `layer_inputs` (arrays with a leading layer axis, e.g. its KV cache) and `outputs` are
    stacked over layers into `layer_outputs`. remat_policy: as `decoder.run_layers`'.

    Every layer reads the same token embeddings and the previous layer's output, and runs through
    `decoder.decoder_layer` unchanged: the residual stream is g, attn_norm is hidden_norm and the
    projections are the g-halves of the 2d-wide q/k/v weights. Since [e; g] W = e W[:d] + g W[d:],
    the embedding half RMSNorm_input(e) W[:d] is a per-token bias of the projections, added where a
    bias goes (before q/k-norm and RoPE). So the one layer implementation serves Eagle3 too.
    """
    cfg = dcfg.layer_config().replace(qkv_bias=True)  # the bias slot carries the embedding half
    d = dcfg.hidden_size
    cos, sin = decoder.rope_tables(cfg, positions)

    def body(g, layer):
        bits, lp, inputs = layer  # sliced as bits too: see `decoder.as_bits`
        rows = lambda name, part: decoder.from_bits(bits[name][part], lp[name][part])  # noqa: E731
        lp = decoder.from_bits(bits, lp)
        e = decoder.rms_norm(embeds, lp["input_norm"], cfg.rms_norm_eps)
        lp = dict(lp, attn_norm=lp["hidden_norm"], **{w: rows(w, np.s_[d:]) for w in ("wq", "wk", "wv")},
                  **{b: decoder.weight_einsum("...i,io->...o", e, rows(w, np.s_[:d])) for b, w in
                     (("bq", "wq"), ("bk", "wk"), ("bv", "wv"))})
        return decoder.decoder_layer(lp, cfg, g, cos, sin, lambda lp, q, k, v: attend(q, k, v, inputs))

    if remat_policy is not None:
        body = jax.checkpoint(body, policy=remat_policy)
    return jax.lax.scan(body, g, (decoder.as_bits(params["layers"]), params["layers"], layer_inputs))


def _fuse(params: dict, ctx_features: jax.Array) -> jax.Array:
    """Concatenated target taps [..., m*d] -> g [..., d] (Eagle3 has no norm after fc)."""
    return decoder.weight_einsum("...i,io->...o", ctx_features.astype(dspark.activations(params)), params["fc"])




def _draft_logits(params, dcfg, target_params, target_cfg, h):
    return decoder.logits(target_params, target_cfg, decoder.rms_norm(h, params["final_norm"], dcfg.rms_norm_eps))


# --------------------------------------------------------------------------------------------------
# Training forward with training-time test


def _shift_left(x: jax.Array, n: int, fill) -> jax.Array:
    """x[:, t] <- x[:, t + n] along axis 1; the last n entries become `fill`."""
    if n == 0:
        return x
    return jnp.concatenate([x[:, n:], jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)], axis=1)


def _shift_right(x: jax.Array, n: int, fill) -> jax.Array:
    """x[:, t] <- x[:, t - n] along axis 1; the first n entries become `fill`."""
    if n == 0:
        return x
    return jnp.concatenate([jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype), x[:, :-n]], axis=1)


def eagle3_train_forward(
    params: dict,
    dcfg: DrafterConfig,
    target_params: dict,
    target_cfg: ModelConfig,
    input_ids: jax.Array,
    loss_mask: jax.Array,
    ctx_features: jax.Array,
    target_last_hidden: jax.Array,
    steps: int | None = None,
    lengths: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    loss_slots: jax.Array | None = None,
    loss_slots_valid: jax.Array | None = None,
    remat_policy=None,
) -> dict:
    """The TTT forward over whole sequences (layout and loss in the module docstring).

    input_ids, loss_mask: [B, S]; ctx_features: [B, S, m*d] the concatenated target taps;
    target_last_hidden: [B, S, d] the target's final-normed hidden state (the target's distribution
    is its LM head on it); steps: TTT passes (default dcfg.ttt_steps); lengths: [B] valid tokens per
    row when rows are right-padded (default S). For PACKED rows (the training pipeline's format)
    pass segment_ids and positions [B, S]: attention stays inside a segment, RoPE restarts per
    sequence, and a pass never predicts across a segment boundary.
    loss_slots, loss_slots_valid: [B, P] to supervise only those positions t (every pass still runs
    over the whole row, so attention is unchanged); the LM heads, drafter's and target's, then run
    on B*P*steps rather than B*S*steps positions, and each pass's loss is divided by B*P.
    remat_policy: the layers' (`decoder.run_layers`), for training memory.
    Returns {"draft_logits": [steps, B, N, V], "position_mask": [steps, B, N], "loss": [steps],
    "acceptance": [steps, B, N] (sum_v min(q, p), the chance pass i's draft survives verification),
    "total_loss": scalar}, N = S (or P with loss_slots). Under jit, outputs the caller drops cost nothing.
    """
    steps = dcfg.ttt_steps if steps is None else steps
    B, S = input_ids.shape
    V = target_cfg.vocab_size
    lengths = jnp.full((B,), S, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    # A row's last token has no next token, so pass 0 has nothing to predict there.
    position_mask = jnp.where(jnp.arange(S)[None] == lengths[:, None] - 1, 0.0, loss_mask.astype(jnp.float32))
    # Pass i at position t learns the target's distribution at t+1+i (past the end: uniform, masked).
    if loss_slots is None:
        target_logp = jax.nn.log_softmax(decoder.logits(target_params, target_cfg, target_last_hidden), axis=-1)
        target_probs = jax.lax.stop_gradient(jnp.exp(_shift_left(target_logp, 1, -np.log(V))))

        valid = 1.0

        def pick(x):
            return x
    else:
        rows = jnp.arange(B)[:, None]
        valid = jnp.ones(loss_slots.shape, bool) if loss_slots_valid is None else loss_slots_valid

        def pick(x):  # [B, S, ...] -> [B, P, ...] at the supervised slots
            return x[rows, loss_slots]

        # Only the slots a pass reads (clipped past the row: masked there anyway).
        read = jnp.minimum(loss_slots[:, :, None] + 1 + jnp.arange(steps), S - 1)  # [B, P, steps]
        target_logp = jax.nn.log_softmax(decoder.logits(target_params, target_cfg, target_last_hidden[rows[..., None], read]), axis=-1)
        target_probs = jax.lax.stop_gradient(jnp.exp(target_logp))

        def target_probs_of_pass(i):
            return target_probs[:, :, i]
    causal = jnp.tril(jnp.ones((S, S), bool))[None]
    base_positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)) if positions is None else positions
    if segment_ids is not None:
        causal = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])

    def attend(q, k, v, inputs):
        k_ctx, v_ctx, k_chain, v_chain = inputs
        if k_ctx is None:  # pass 0: its keys, made from target features, are the causal context
            k_ctx, v_ctx = k, v
        else:  # later passes: the context stays pass 0's; own keys extend the chain at position t
            k_chain = jnp.concatenate([k_chain, k[:, :, None]], axis=2)
            v_chain = jnp.concatenate([v_chain, v[:, :, None]], axis=2)
        # Each position's chain is a "block" of one query whose own keys are its J chain keys: one
        # softmax over context and chain, O(S^2 + J*S) rather than a mask over all (J+1)*S keys.
        out = dspark.block_attention(q[:, :, None], k_chain, v_chain, k_ctx, v_ctx, causal)
        return out, (k, v)

    g = _fuse(params, ctx_features)
    tokens = _shift_left(jnp.asarray(input_ids, jnp.int32), 1, 0)
    chain_shape = (dcfg.num_layers, B, S, 0, dcfg.num_kv_heads, dcfg.head_dim)  # [L, B, S, J, Hkv, D]
    ctx, chain = (None, None), (jnp.zeros(chain_shape, g.dtype), jnp.zeros(chain_shape, g.dtype))
    outs = {"draft_logits": [], "position_mask": [], "loss": [], "acceptance": []}
    total = jnp.float32(0.0)
    for i in range(steps):
        positions = base_positions + i
        embeds = dspark.target_embed(target_params, dcfg, tokens, g.dtype)
        g, (k, v) = _run_layers(params, dcfg, embeds, g, positions, attend, ctx + chain, remat_policy)
        if i == 0:
            ctx = (k, v)
        else:
            chain = tuple(jnp.concatenate([c, new[:, :, :, None]], axis=3) for c, new in zip(chain, (k, v)))
        logits = _draft_logits(params, dcfg, target_params, target_cfg, pick(g))
        mask = _shift_left(position_mask, i, 0.0)
        if segment_ids is not None:  # pass i at t predicts t+1+i: it must be the same sequence
            mask = mask * (_shift_left(segment_ids, 1 + i, -1) == segment_ids)
        mask = pick(mask) * valid
        if loss_slots is None:
            # Scored at u = t + i against the one target array: a [B, S, V] target shifted per pass
            # was kept per pass for the backward (2.5 GB a pass per chip at Qwen3-8B's shapes). The
            # draft side moves instead, as its [B, S, d] hidden state; `logits` above stays the
            # reported output and is never computed in training, which does not read it.
            aligned = _draft_logits(params, dcfg, target_params, target_cfg, _shift_right(g, i, 0.0))
            log_q, p, scored = jax.nn.log_softmax(aligned, axis=-1), target_probs, _shift_right(mask, i, 0.0)
        else:
            log_q, p, scored = jax.nn.log_softmax(logits, axis=-1), target_probs_of_pass(i), mask
        ce = -jnp.sum(p * log_q, axis=-1)
        loss = jnp.sum(ce * scored) / mask.size  # the reference's normaliser: all B*S slots, masked or not
        total = total + dcfg.ttt_decay ** i * loss
        tokens = _shift_left(tokens, 1, 0)
        acceptance = jax.lax.stop_gradient(jnp.sum(jnp.minimum(jnp.exp(log_q), p), axis=-1))
        outs["draft_logits"].append(logits)
        outs["position_mask"].append(mask)
        outs["loss"].append(loss)
        outs["acceptance"].append(_shift_left(acceptance, i, 0.0) if loss_slots is None else acceptance)
    out = {name: jnp.stack(values) for name, values in outs.items()}
    out["total_loss"] = total
    return out


# --------------------------------------------------------------------------------------------------
# Inference: chain drafting over a KV cache of committed positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3Cache:
    """K/V of the committed positions (pairs (g_t, x_{t+1})). `eagle3_propose` also writes its gamma
    steps past `lengths` into a scratch copy, so max_len must leave gamma free slots."""

    k: jax.Array  # [layers, batch, max_len, kv_heads, head_dim]
    v: jax.Array
    lengths: jax.Array  # [batch] int32: positions held

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_eagle3_cache(dcfg: DrafterConfig, batch: int, max_len: int, dtype=jnp.float32) -> Eagle3Cache:
    shape = (dcfg.num_layers, batch, max_len, dcfg.num_kv_heads, dcfg.head_dim)
    return Eagle3Cache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def _extend(params, dcfg, target_params, cache: Eagle3Cache, g, next_tokens, num_new):
    """Run pairs (g [B, T, d], next_tokens [B, T]) at positions lengths + j, causally over the cache
    (decoder.forward's pattern: each row writes its K/V at its own positions, past max_len is
    dropped, entries past num_new[b] are padding beyond the new length). -> (h [B, T, d], cache)."""
    B, T = next_tokens.shape
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    visible = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None] <= positions[:, :, None]
    rows = jnp.arange(B)[:, None]

    def attend(q, k, v, layer_cache):
        k_layer, v_layer = layer_cache
        k_layer = k_layer.at[rows, positions].set(k.astype(k_layer.dtype), mode="drop")
        v_layer = v_layer.at[rows, positions].set(v.astype(v_layer.dtype), mode="drop")
        return decoder.attention(q, decoder.cached_keys(k_layer), decoder.heads_major(v_layer), visible), (k_layer, v_layer)

    embeds = dspark.target_embed(target_params, dcfg, next_tokens, g.dtype)
    h, (k, v) = _run_layers(params, dcfg, embeds, g, positions, attend, (cache.k, cache.v))
    return h, Eagle3Cache(k, v, cache.lengths + num_new.astype(jnp.int32))


def eagle3_append_context(
    params: dict,
    dcfg: DrafterConfig,
    target_params: dict,
    cache: Eagle3Cache,
    ctx_features: jax.Array,
    next_tokens: jax.Array,
    num_new: jax.Array,
) -> Eagle3Cache:
    """Append `num_new[b]` committed pairs to row b: entry j is position t = lengths[b] + j with
    ctx_features[b, j] = the target's concatenated taps at t [m*d] and next_tokens[b, j] = x_{t+1}.
    Entries past num_new[b] are padding."""
    return _extend(params, dcfg, target_params, cache, _fuse(params, ctx_features), next_tokens, num_new)[1]


def eagle3_propose(
    params: dict,
    dcfg: DrafterConfig,
    target_params: dict,
    target_cfg: ModelConfig,
    cache: Eagle3Cache,
    last_token: jax.Array,
    last_feature: jax.Array,
    key: jax.Array,
    sampling: SamplingConfig,
    gamma: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draft gamma tokens per row after the anchor (bonus) token.

    With committed x_0..x_n (x_n = the anchor, just sampled by the target) and the target's taps
    g_0..g_{n-1} (x_n has none yet), the cache holds positions 0..n-2 (lengths = n-1) and
    last_token = x_n [B], last_feature = the taps at n-1 [B, m*d]. Step k (0-based) runs position
    n-1+k on [embed(token); feature], starting from (x_n, fc(taps_{n-1})); its output hidden and its
    drawn token x_{n+1+k} are the next step's feature and token. Steps are appended to a scratch
    copy of the cache (so a step sees the context and this round's earlier steps); the caller's
    cache is unchanged.
    Returns tokens [B, gamma], log_probs [B, gamma, V] (the processed distribution each token was
    drawn from, `sampling.processed_log_probs`) and the steps' output hidden states [B, gamma, d]
    (before the final norm: what Eagle3 chains).
    """
    one = jnp.ones_like(cache.lengths)

    def step(carry, key):
        scratch, token, g = carry
        h, scratch = _extend(params, dcfg, target_params, scratch, g, token[:, None], one)
        log_probs = processed_log_probs(_draft_logits(params, dcfg, target_params, target_cfg, h[:, 0]), sampling)
        if sampling.greedy:
            token = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
        else:
            token = jax.random.categorical(key, log_probs, axis=-1).astype(jnp.int32)
        return (scratch, token, h), (token, log_probs, h[:, 0])

    init = (cache, last_token.astype(jnp.int32), _fuse(params, last_feature)[:, None])
    _, (tokens, log_probs, hidden) = jax.lax.scan(step, init, jax.random.split(key, gamma))
    return tokens.T, jnp.swapaxes(log_probs, 0, 1), jnp.swapaxes(hidden, 0, 1)


# --------------------------------------------------------------------------------------------------
# DeepSpec checkpoints (read through dspark_jax/drafters/deepspec.py, which picks the format by the
# architecture name "...Eagle3..." in the config)

# The decoder-layer names of DSpark, except that input_layernorm normalises the embedding half and
# hidden_norm (per layer here) the feature half. embed_tokens / lm_head are the target's copies,
# skipped (and checked against the target when it is given) by the shared loader.
DEEPSPEC_EAGLE3_NAMES: NameTable = [entry for entry in deepspec.LAYER_NAMES if entry[1] != "layers/attn_norm"] + [
    (r"layers\.(\d+)\.input_layernorm\.weight", "layers/input_norm", False),
    (r"layers\.(\d+)\.hidden_norm\.weight", "layers/hidden_norm", False),
    (r"fc\.weight", "fc", True),
    (r"norm\.weight", "final_norm", False),
]


def eagle3_config_from_json(hf: dict, source: str) -> DrafterConfig:
    """DeepSpec's Eagle3 config.json (a Qwen3 config plus target_layer_ids, num_target_layers,
    ttt_length, step_loss_decay) -> DrafterConfig(kind="eagle3")."""
    return DrafterConfig(
        kind="eagle3", **deepspec.drafter_config_fields(hf, source),
        head="none", markov_rank=0, confidence=False, confidence_with_markov=False,
        ttt_steps=int(hf.get("ttt_length", 7)), ttt_decay=float(hf.get("step_loss_decay", 0.8)))


def eagle3_config_to_json(dcfg: DrafterConfig, training: dict) -> dict:
    """The inverse of eagle3_config_from_json beyond the shared fields (DeepSpec's Eagle3
    build_draft_config: target name, TTT length and decay, draft layer count)."""
    return {"target_model_name_or_path": dcfg.target_name, "ttt_length": dcfg.ttt_steps,
            "step_loss_decay": dcfg.ttt_decay, "draft_num_hidden_layers": dcfg.num_layers}


deepspec.register_format("eagle3", deepspec.DeepSpecFormat(
    eagle3_config_from_json, eagle3_param_shapes, DEEPSPEC_EAGLE3_NAMES, architecture="Qwen3Eagle3Model",
    config_to_json=eagle3_config_to_json))


def load_deepspec_eagle3(weights_path: str, config_path: str | None = None, target_name: str = "",
                         target_cfg: ModelConfig | None = None,
                         target_params: dict | None = None) -> tuple[DrafterConfig, dict]:
    """DeepSpec Eagle3 weights (.safetensors file or folder) + config JSON -> (DrafterConfig, params).

    With `target_cfg` checks the drafter belongs to that target (vocab, width, depth, taps); with
    `target_params` also that its embedding / LM head copies are the target's.
    """
    dcfg, params = deepspec.load_deepspec_drafter(weights_path, config_path, target_name, target_cfg, target_params)
    if dcfg.kind != "eagle3":
        raise UserError(f"{config_path or weights_path}: not an Eagle3 drafter (kind {dcfg.kind!r})")
    return dcfg, params
