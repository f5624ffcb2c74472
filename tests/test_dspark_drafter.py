"""The DSpark / DFlash drafter: reference parity, block attention pattern, packing, decoding path,
sequential-head sampling, DeepSpec checkpoint loading."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.checkpoints.hf import load_hf_model
from dspark_jax.drafters import dspark
from dspark_jax.drafters.checkpoint import drafter_logical_axes
from dspark_jax.drafters.deepspec import load_deepspec_drafter
from dspark_jax.core.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.sampling import SamplingConfig
from stats_helpers import P_MIN, reference_probs, stratified_chi_square_pvalue

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspec")
VARIANTS = ("dspark_markov", "dspark_rnn", "dflash")

train_forward = jax.jit(dspark.train_forward, static_argnums=(1, 3))
append_context = jax.jit(dspark.append_context, static_argnums=(1,))
propose = jax.jit(dspark.propose, static_argnums=(1, 3, 7))


@pytest.fixture(scope="module")
def target():
    return load_hf_model(os.path.join(FIXTURE, "target"))


@pytest.fixture(scope="module")
def drafters(target):
    tcfg, tparams = target
    return {v: load_deepspec_drafter(os.path.join(FIXTURE, f"{v}.safetensors"),
                                     os.path.join(FIXTURE, f"{v}_config.json"), target_cfg=tcfg,
                                     target_params=tparams) for v in VARIANTS}


@pytest.fixture(scope="module")
def inputs():
    return dict(np.load(os.path.join(FIXTURE, "inputs.npz")))


def fixture_batch(inputs):
    """The fixture's rows: one sequence per row."""
    B, S = inputs["input_ids"].shape
    return dict(tokens=inputs["input_ids"].astype(np.int32),
                positions=np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)),
                segment_ids=np.ones((B, S), np.int32), loss_mask=inputs["loss_mask"] > 0.5,
                block_start=inputs["anchor_positions"].astype(np.int32), block_valid=inputs["block_keep_mask"])


def run(drafter, target, batch, ctx, last):
    (dcfg, dparams), (tcfg, tparams) = drafter, target
    return jax.tree.map(np.asarray, train_forward(dparams, dcfg, tparams, tcfg, batch, ctx, last))


# --------------------------------------------------------------------------------------------------
# Reference parity


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, drafters, target, inputs):
    out = run(drafters[variant], target, fixture_batch(inputs),
              inputs["target_hidden_states"], inputs["target_last_hidden_states"])
    want = np.load(os.path.join(FIXTURE, f"{variant}_expected.npz"))
    m = want["eval_mask"]
    assert m.any()
    np.testing.assert_array_equal(out["label_mask"], m)
    np.testing.assert_array_equal(out["labels"][m], want["target_ids"][m])
    np.testing.assert_allclose(out["draft_logits"][m], want["draft_logits"][m], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out["target_logits"][m], want["aligned_target_logits"][m], atol=1e-4, rtol=0)
    if "confidence_logits" in want:
        np.testing.assert_allclose(out["confidence_logits"][m], want["confidence_logits"][m], atol=1e-4, rtol=0)
    else:
        assert "confidence_logits" not in out
        np.testing.assert_array_equal(out["draft_logits"], out["base_logits"])  # DFlash: no head bias


def test_target_taps_are_the_fixture_features(drafters, target, inputs):
    """Our target decoder's taps at the drafter's tap indices are the reference's context features."""
    (dcfg, _), (tcfg, tparams) = drafters["dspark_markov"], target
    batch = fixture_batch(inputs)
    hidden, taps = decoder.forward_packed(tparams, tcfg, batch["tokens"], batch["positions"],
                                          batch["segment_ids"], dcfg.tap_layers)
    np.testing.assert_allclose(np.concatenate(list(taps), axis=-1), inputs["target_hidden_states"], atol=1e-4)
    np.testing.assert_allclose(hidden, inputs["target_last_hidden_states"], atol=1e-4)


def test_param_shapes_and_init(drafters):
    for dcfg, params in (drafters[v] for v in ("dflash", "dspark_markov", "dspark_rnn")):
        shapes = jax.tree.map(np.shape, params)
        assert shapes == jax.tree.map(tuple, dspark.drafter_param_shapes(dcfg),
                                      is_leaf=lambda x: isinstance(x, tuple))
        is_axes = lambda x: isinstance(x, tuple)  # noqa: E731
        axes = drafter_logical_axes(params)  # every parameter named, with one axis name per dimension
        assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params)
        assert all(len(a) == np.ndim(p) for a, p in zip(jax.tree.leaves(axes, is_leaf=is_axes), jax.tree.leaves(params)))
    # The RNN variant has every parameter kind; eval_shape traces init without compiling it.
    init = jax.eval_shape(dspark.init_drafter_params, dcfg, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, init) == shapes


# --------------------------------------------------------------------------------------------------
# Packing and the block attention pattern

S_PACK = 64
LEN_A, LEN_B = 22, 30  # sequence A = fixture row 0[:22], B = fixture row 1[:30]
ANCHORS_A, ANCHORS_B = (12, 19), (17, 25)  # 19: A's labels run out at its end (slot 21)


def packed_and_alone(inputs, seed=0):
    """The same two sequences packed in one row, and each alone in its own row (same S, same NB)."""
    rng = np.random.default_rng(seed)
    m_d = inputs["target_hidden_states"].shape[-1]
    d = inputs["target_last_hidden_states"].shape[-1]
    seqs = [(0, LEN_A, ANCHORS_A), (1, LEN_B, ANCHORS_B)]

    def empty(rows):
        # Padding slots hold garbage: they must never matter.
        return dict(tokens=rng.integers(0, 256, (rows, S_PACK)).astype(np.int32),
                    positions=np.zeros((rows, S_PACK), np.int32), segment_ids=np.zeros((rows, S_PACK), np.int32),
                    loss_mask=rng.random((rows, S_PACK)) < 0.5, block_start=np.zeros((rows, 4), np.int32),
                    block_valid=np.zeros((rows, 4), bool)), \
            rng.normal(size=(rows, S_PACK, m_d)).astype(np.float32), \
            rng.normal(size=(rows, S_PACK, d)).astype(np.float32)

    def put(batch, ctx, last, row, start, seg, src, n, anchors, first_block):
        sl = slice(start, start + n)
        batch["tokens"][row, sl] = inputs["input_ids"][src, :n]
        batch["positions"][row, sl] = np.arange(n)
        batch["segment_ids"][row, sl] = seg
        batch["loss_mask"][row, sl] = inputs["loss_mask"][src, :n] > 0.5
        batch["block_start"][row, first_block:first_block + len(anchors)] = np.asarray(anchors) + start
        batch["block_valid"][row, first_block:first_block + len(anchors)] = True
        ctx[row, sl] = inputs["target_hidden_states"][src, :n]
        last[row, sl] = inputs["target_last_hidden_states"][src, :n]

    packed = empty(1)
    put(*packed, 0, 0, 1, *seqs[0], 0)
    put(*packed, 0, LEN_A, 2, *seqs[1], 2)
    alone = empty(2)
    put(*alone, 0, 0, 1, *seqs[0], 0)
    put(*alone, 1, 0, 1, *seqs[1], 0)
    return packed, alone


def test_packing_matches_each_sequence_alone(drafters, target, inputs):
    packed, alone = packed_and_alone(inputs)
    p = run(drafters["dspark_markov"], target, *packed)
    a = run(drafters["dspark_markov"], target, *alone)
    assert p["label_mask"][0, 1].tolist() == [True, True, False, False]  # stops at A's end, not in B
    for key in ("hidden", "draft_logits", "target_logits", "confidence_logits", "labels", "label_mask"):
        got = p[key][0]  # blocks 0-1: sequence A, 2-3: sequence B
        want = np.concatenate([a[key][0, :2], a[key][1, :2]])
        if key not in ("hidden", "label_mask"):  # past a sequence's end these read the neighbour
            got, want = got[p["label_mask"][0]], want[p["label_mask"][0]]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=key)


def test_block_attention_pattern(drafters, target, inputs):
    """Block 2 (sequence B, anchor at B's position 17 = slot 39) sees B's slots 22..38 and itself only."""
    (batch, ctx, last), _ = packed_and_alone(inputs)
    drafter = drafters["dspark_markov"]
    base = run(drafter, target, batch, ctx, last)
    blk, a = 2, LEN_A + ANCHORS_B[0]
    rng = np.random.default_rng(1)

    def block_outputs(b=batch, c=ctx):
        out = run(drafter, target, b, c, last)
        return {k: out[k][0, blk] for k in ("hidden", "base_logits")}

    def moved(**kw):
        out = block_outputs(**kw)
        return max(np.abs(out[k] - base[k][0, blk]).max() for k in out)

    def with_ctx(slots):
        c = ctx.copy()
        c[0, slots] += rng.normal(size=c[0, slots].shape).astype(np.float32)
        return c

    def with_tokens(slots):
        b = dict(batch, tokens=batch["tokens"].copy())
        b["tokens"][0, slots] = (b["tokens"][0, slots] + 1) % 256
        return b

    everything_but_anchor = [s for s in range(S_PACK) if s != a]
    assert moved(c=with_ctx(list(range(a, S_PACK)))) == 0  # the anchor's own feature and later ones
    assert moved(c=with_ctx(list(range(LEN_A)))) == 0  # another sequence (positions < p included)
    assert moved(b=with_tokens(everything_but_anchor)) == 0  # other blocks' anchors, context tokens
    assert moved(c=with_ctx([a - 1])) > 1e-3  # an allowed context position
    assert moved(c=with_ctx([LEN_A])) > 1e-3  # B's first token
    assert moved(b=with_tokens([a])) > 1e-3  # its own anchor
    # The sequential head reads the ground-truth previous tokens (teacher forcing): slot 1 uses a+1.
    out = run(drafter, target, with_tokens([a + 1]), ctx, last)
    assert np.abs(out["draft_logits"][0, blk, 1] - base["draft_logits"][0, blk, 1]).max() > 1e-3
    np.testing.assert_array_equal(out["draft_logits"][0, blk, [0, 2, 3]], base["draft_logits"][0, blk, [0, 2, 3]])


# --------------------------------------------------------------------------------------------------
# Decoding path


def build_cache(dcfg, dparams, ctx, lengths, max_len=48, chunk=16):
    """Append each row's first lengths[b] features in ragged chunks of at most `chunk` tokens."""
    B = ctx.shape[0]
    cache = dspark.init_drafter_cache(dcfg, B, max_len)
    done = np.zeros(B, np.int32)
    while (done < lengths).any():
        num_new = np.minimum(lengths - done, chunk - np.arange(B) * 3)  # rows advance by different counts
        num_new = np.maximum(num_new, 0).astype(np.int32)
        feats = np.zeros((B, chunk, ctx.shape[-1]), np.float32)
        for b in range(B):
            n = min(chunk, ctx.shape[1] - done[b])
            feats[b, :n] = ctx[b, done[b]:done[b] + n]  # includes features past num_new: must be ignored
        cache = append_context(dparams, dcfg, cache, feats, num_new)
        done += num_new
    np.testing.assert_array_equal(cache.lengths, lengths)
    return cache


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_forward_equals_decoding_path(variant, drafters, target, inputs):
    dcfg, dparams = drafters[variant]
    tcfg, tparams = target
    out = run(drafters[variant], target, fixture_batch(inputs),
              inputs["target_hidden_states"], inputs["target_last_hidden_states"])
    blk = 1
    anchors_at = inputs["anchor_positions"][:, blk].astype(np.int32)  # different per row
    cache = build_cache(dcfg, dparams, inputs["target_hidden_states"], anchors_at)
    rows = np.arange(2)
    anchor_tokens = inputs["input_ids"][rows, anchors_at].astype(np.int32)
    proposal = jax.tree.map(np.asarray, propose(dparams, dcfg, tparams, tcfg, cache, anchor_tokens, jax.random.key(0),
                                                SamplingConfig(), out["labels"][:, blk]))
    np.testing.assert_allclose(proposal.hidden, out["hidden"][:, blk], atol=1e-5, rtol=0)
    np.testing.assert_allclose(proposal.logits, out["draft_logits"][:, blk], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(proposal.tokens, out["draft_logits"][:, blk].argmax(-1))
    if dcfg.confidence:
        np.testing.assert_allclose(proposal.confidence_logits, out["confidence_logits"][:, blk], atol=1e-5, rtol=0)
    else:
        assert proposal.confidence_logits is None


def test_head_none_is_dflash(drafters, target, inputs):
    """Switching the head off leaves the same backbone: draft logits = the DSpark model's base logits."""
    dcfg, dparams = drafters["dspark_rnn"]
    dflash_cfg = dcfg.replace(head="none", markov_rank=0, confidence=False)
    dflash_params = {k: v for k, v in dparams.items() if k not in ("markov", "rnn", "confidence")}
    assert jax.tree.map(np.shape, dflash_params) == jax.tree.map(
        tuple, dspark.drafter_param_shapes(dflash_cfg), is_leaf=lambda x: isinstance(x, tuple))
    args = (fixture_batch(inputs), inputs["target_hidden_states"], inputs["target_last_hidden_states"])
    full = run((dcfg, dparams), target, *args)
    off = run((dflash_cfg, dflash_params), target, *args)
    np.testing.assert_allclose(off["draft_logits"], full["base_logits"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(off["draft_logits"], off["base_logits"])


def reference_head_bias(dcfg, dparams, prev, h, state):
    """The sequential head written out in numpy (DESIGN.md 2.3)."""
    if dcfg.head == "none":
        return 0.0, state
    w1, w2 = np.asarray(dparams["markov"]["w1"]), np.asarray(dparams["markov"]["w2"])
    e = w1[prev]
    if dcfg.head == "markov":
        return e @ w2, state
    z = np.concatenate([state, e, h], -1) @ np.asarray(dparams["rnn"]["w"]) + np.asarray(dparams["rnn"]["b"])
    r = dcfg.markov_rank
    gate = 1 / (1 + np.exp(-z[:, :r]))
    state = gate * state + (1 - gate) * np.tanh(z[:, r:2 * r])
    return np.tanh(z[:, 2 * r:]) @ w2, state


@pytest.mark.parametrize("variant", ["dspark_markov", "dspark_rnn"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=40, top_p=0.95)],
                         ids=["greedy", "T0.9"])
def test_scan_sampling_equals_python_loop(variant, sampling, drafters, target, inputs):
    dcfg, dparams = drafters[variant]
    tcfg, tparams = target
    lengths = np.array([21, 30], np.int32)
    cache = build_cache(dcfg, dparams, inputs["target_hidden_states"], lengths)
    anchors = inputs["input_ids"][[0, 1], lengths].astype(np.int32)
    key = jax.random.key(7)
    prop = jax.tree.map(np.asarray, propose(dparams, dcfg, tparams, tcfg, cache, anchors, key, sampling))
    base = np.asarray(decoder.logits(tparams, tcfg, prop.hidden))
    prev, state = anchors, np.zeros((2, dcfg.markov_rank), np.float32)
    w = np.asarray(dparams["confidence"]["w"])
    for k in range(dcfg.block_size):
        conf = np.concatenate([prop.hidden[:, k], np.asarray(dparams["markov"]["w1"])[prev]], -1) @ w
        np.testing.assert_allclose(prop.confidence_logits[:, k], conf + np.asarray(dparams["confidence"]["b"]),
                                   atol=1e-5, rtol=0)
        bias, state = reference_head_bias(dcfg, dparams, prev, prop.hidden[:, k], state)
        logits = base[:, k] + bias
        np.testing.assert_allclose(prop.logits[:, k], logits, atol=1e-4, rtol=0)
        # the processed distribution, from its definition in numpy (not the sampler under test)
        want = (reference_probs(logits, 1.0) if sampling.greedy  # greedy: the plain softmax
                else reference_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p))
        np.testing.assert_array_equal(np.isneginf(prop.log_probs[:, k]), want == 0)
        np.testing.assert_allclose(np.exp(prop.log_probs[:, k]), want, atol=1e-4, rtol=0)
        token = prop.tokens[:, k]
        if sampling.greedy:
            np.testing.assert_array_equal(token, np.argmax(logits, -1))
        else:  # a token the processed distribution allows (its frequencies: the test below)
            assert (want[np.arange(2), token] > 0).all()
        prev = token
    if not sampling.greedy:  # the log-probs are the processed (truncated) distribution
        assert np.isinf(prop.log_probs).any()


@pytest.mark.parametrize("variant", ["dspark_markov", "dspark_rnn"])
def test_scan_draws_follow_the_sequential_head(variant, drafters, target, inputs):
    """The tokens the scan samples, over 5000 keys: at each slot k, the counts of (row, previous
    token, token) match the processed softmax(U_k + B_k(prev)) computed in numpy for each draw's own
    previous token and recurrent state (chi-square stratified by row and previous token). The
    fixture's logits are nearly flat (std 0.16) and its head bias tiny, so the test sharpens both
    (T = 0.1, W2 x 20) to give wrong temperatures or a wrongly fed head something to show."""
    dcfg, dparams = drafters[variant]
    dparams = dict(dparams, markov=dict(dparams["markov"], w2=dparams["markov"]["w2"] * 20.0))
    tcfg, tparams = target
    sampling = SamplingConfig(temperature=0.1, top_k=40, top_p=0.95)
    lengths = np.array([21, 30], np.int32)
    cache = build_cache(dcfg, dparams, inputs["target_hidden_states"], lengths)
    anchors = inputs["input_ids"][[0, 1], lengths].astype(np.int32)
    n = 5000
    many = jax.jit(jax.vmap(lambda key: dspark.propose(dparams, dcfg, tparams, tcfg, cache, anchors, key, sampling).tokens))
    tokens = np.asarray(many(jax.random.split(jax.random.key(5), n))).reshape(2 * n, -1)  # [row-major draws, g]
    prop = propose(dparams, dcfg, tparams, tcfg, cache, anchors, jax.random.key(0), sampling)
    hidden = np.tile(np.asarray(prop.hidden), (n, 1, 1))  # key-independent backbone output
    base = np.tile(np.asarray(decoder.logits(tparams, tcfg, prop.hidden)), (n, 1, 1))
    row = np.tile(np.arange(2), n)
    prev, state, V = np.tile(anchors, n), np.zeros((2 * n, dcfg.markov_rank), np.float32), base.shape[-1]
    for k in range(dcfg.block_size):
        bias, state = reference_head_bias(dcfg, dparams, prev, hidden[:, k], state)
        probs = reference_probs(base[:, k] + bias, sampling.temperature, sampling.top_k, sampling.top_p)
        stratum = row * V + prev
        observed, expected = np.zeros((2 * V, V)), np.zeros((2 * V, V))
        np.add.at(observed, (stratum, tokens[:, k]), 1)
        np.add.at(expected, stratum, probs)
        pvalue = stratified_chi_square_pvalue(observed, expected)
        assert pvalue > P_MIN, (k, pvalue)
        prev = tokens[:, k]


# --------------------------------------------------------------------------------------------------
# Loader errors


def copy_variant(tmp_path, variant, edit_weights=None, edit_config=None):
    folder = tmp_path / variant
    folder.mkdir()
    weights = load_file(os.path.join(FIXTURE, f"{variant}.safetensors"))
    with open(os.path.join(FIXTURE, f"{variant}_config.json")) as f:
        config = json.load(f)
    if edit_weights:
        edit_weights(weights)
    if edit_config:
        edit_config(config)
    save_file(weights, str(folder / "model.safetensors"))
    with open(folder / "config.json", "w") as f:
        json.dump(config, f)
    return str(folder)


def test_loads_a_folder(tmp_path, drafters):
    dcfg, params = load_deepspec_drafter(copy_variant(tmp_path, "dspark_rnn"), target_name="tiny")
    assert dcfg == drafters["dspark_rnn"][0].replace(target_name="tiny")
    assert (dcfg.head, dcfg.markov_rank, dcfg.block_size, dcfg.mask_token_id) == ("rnn", 8, 4, 255)
    assert dcfg.tap_layers == (2, 4)
    np.testing.assert_array_equal(params["rnn"]["w"], drafters["dspark_rnn"][1]["rnn"]["w"])


@pytest.mark.parametrize("edit_weights, edit_config, message", [
    (lambda w: w.update({"markov_head.markov_w2.weight": np.zeros((256, 9), np.float32)}), None, "shape"),
    (lambda w: w.pop("layers.1.self_attn.k_norm.weight"), None, "layers/k_norm"),
    (lambda w: w.pop("confidence_head.proj.bias"), None, "confidence/b"),
    (lambda w: w.update({"extra.weight": np.zeros(3, np.float32)}), None, "unexpected"),
    (None, lambda c: c.update(markov_head_type="gated"), "markov_head_type"),
    (None, lambda c: c.pop("mask_token_id"), "mask_token_id"),
    (None, lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "not a DeepSpec drafter"),
])
def test_bad_checkpoint_is_a_user_error(tmp_path, edit_weights, edit_config, message):
    folder = copy_variant(tmp_path, "dspark_markov", edit_weights, edit_config)
    with pytest.raises(UserError, match=message):
        load_deepspec_drafter(folder)


def test_wrong_target_is_a_user_error(tmp_path, target):
    tcfg, tparams = target
    folder = copy_variant(tmp_path, "dflash")
    with pytest.raises(UserError, match="trained for target"):
        load_deepspec_drafter(folder, target_cfg=tcfg.replace(vocab_size=512))
    with pytest.raises(UserError, match="trained for target"):
        load_deepspec_drafter(folder, target_cfg=tcfg.replace(num_layers=12))
    other = dict(tparams, embed=np.asarray(tparams["embed"]) + 1.0)
    with pytest.raises(UserError, match="different target"):
        load_deepspec_drafter(folder, target_cfg=tcfg, target_params=other)
    with pytest.raises(UserError, match="no such"):
        load_deepspec_drafter(str(tmp_path / "missing"), os.path.join(folder, "config.json"))
    shutil.rmtree(folder)
