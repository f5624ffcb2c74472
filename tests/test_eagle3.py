"""Eagle3 drafter against the reference fixture (TTT training forward), chain drafting against TTT,
and the DeepSpec loader's checks."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.checkpoints.hf import load_hf_model
from dspark_jax.drafters import eagle3
from dspark_jax.core.errors import UserError
from dspark_jax.models.sampling import SamplingConfig

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspec")
STEPS = 3  # the fixture's ttt_length

train_forward = jax.jit(eagle3.eagle3_train_forward, static_argnames=("dcfg", "target_cfg", "steps"))
append_context = jax.jit(eagle3.eagle3_append_context, static_argnames=("dcfg",))
propose = jax.jit(eagle3.eagle3_propose, static_argnames=("dcfg", "target_cfg", "sampling", "gamma"))


@functools.lru_cache(maxsize=None)
def fixture():
    target_cfg, target_params = load_hf_model(os.path.join(FIXTURE, "target"))
    dcfg, params = eagle3.load_deepspec_eagle3(
        os.path.join(FIXTURE, "eagle3.safetensors"), os.path.join(FIXTURE, "eagle3_config.json"),
        target_cfg=target_cfg, target_params=target_params)
    inputs = dict(np.load(os.path.join(FIXTURE, "inputs.npz")))
    inputs["taps"] = np.load(os.path.join(FIXTURE, "eagle3_inputs.npz"))["target_hidden_states"]
    expected = dict(np.load(os.path.join(FIXTURE, "eagle3_expected.npz")))
    return dcfg, params, target_cfg, target_params, inputs, expected


def run_ttt(input_ids):
    dcfg, params, target_cfg, target_params, inputs, _ = fixture()
    return train_forward(params, dcfg=dcfg, target_params=target_params, target_cfg=target_cfg,
                         input_ids=jnp.asarray(input_ids), loss_mask=jnp.asarray(inputs["loss_mask"]),
                         ctx_features=jnp.asarray(inputs["taps"]),
                         target_last_hidden=jnp.asarray(inputs["target_last_hidden_states"]), steps=STEPS)


def test_config_from_fixture():
    dcfg, params, target_cfg, *_ = fixture()
    assert dcfg.kind == "eagle3" and dcfg.num_layers == 1
    assert dcfg.target_layer_ids == (0, 1, 2, 3, 4) and dcfg.tap_layers == (1, 2, 3, 4, 5)
    assert (dcfg.ttt_steps, dcfg.ttt_decay) == (3, 0.8)
    assert params["fc"].shape == (5 * 64, 64) and params["layers"]["wq"].shape == (1, 128, 64)
    init = eagle3.init_eagle3_params(dcfg, jax.random.key(0))
    assert jax.tree.map(np.shape, init) == jax.tree.map(np.shape, params)


def test_ttt_forward_matches_reference():
    *_, inputs, expected = fixture()
    out = run_ttt(inputs["input_ids"])
    for i in range(STEPS):
        mask = expected[f"step{i}_position_mask"]
        np.testing.assert_array_equal(np.asarray(out["position_mask"][i]), mask)
        err = np.abs(np.asarray(out["draft_logits"][i]) - expected[f"step{i}_draft_logits"])[mask > 0].max()
        assert err <= 1e-4, (i, err)
        np.testing.assert_allclose(float(out["loss"][i]), expected[f"step{i}_loss"], rtol=1e-5)
    np.testing.assert_allclose(float(out["total_loss"]), expected["total_loss"], rtol=1e-5)


def padded(rows, width, fill=0):
    out = np.full((len(rows), width) + rows[0].shape[1:], fill, rows[0].dtype)
    for b, row in enumerate(rows):
        out[b, :len(row)] = row
    return out


def test_chain_drafting_matches_ttt():
    """Greedy chain drafting from anchor x_n (rows at different n) equals the TTT forward run on the
    drafted tokens: proposal step k = TTT pass k at position n-1. Context goes in in two ragged appends."""
    dcfg, params, target_cfg, target_params, inputs, expected = fixture()
    ids, taps = inputs["input_ids"], inputs["taps"]
    anchors, first = np.array([22, 31]), np.array([10, 17])  # cache ends at n-1; first append size
    cache = eagle3.init_eagle3_cache(dcfg, batch=2, max_len=48)
    for lo, hi in ((np.zeros(2, int), first), (first, anchors - 1)):  # pairs (g_t, x_{t+1}), t in [lo, hi)
        feats = padded([taps[b, lo[b]:hi[b]] for b in range(2)], (hi - lo).max())
        nxt = padded([ids[b, lo[b] + 1:hi[b] + 1] for b in range(2)], (hi - lo).max())
        cache = append_context(params, dcfg, target_params, cache, jnp.asarray(feats), jnp.asarray(nxt),
                               jnp.asarray(hi - lo, jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), anchors - 1)

    rows = np.arange(2)
    tokens, log_probs, hidden = propose(
        params, dcfg, target_params, target_cfg, cache, jnp.asarray(ids[rows, anchors]),
        jnp.asarray(taps[rows, anchors - 1]), jax.random.key(0), sampling=SamplingConfig(), gamma=STEPS)
    assert tokens.shape == (2, STEPS) and log_probs.shape == (2, STEPS, 256) and hidden.shape == (2, STEPS, 64)
    np.testing.assert_array_equal(np.asarray(tokens), np.argmax(np.asarray(log_probs), axis=-1))

    # Step 0 is the fixture's pass 0 at n-1 (prefix consistency with the reference).
    ref0 = jax.nn.log_softmax(expected["step0_draft_logits"][rows, anchors - 1], axis=-1)
    np.testing.assert_allclose(np.asarray(log_probs[:, 0]), ref0, atol=1e-4)
    # Later steps: TTT fed the drafted tokens as ground truth.
    drafted_ids = ids.copy()
    for b in rows:
        drafted_ids[b, anchors[b] + 1:anchors[b] + STEPS] = np.asarray(tokens[b, :STEPS - 1])
    out = run_ttt(drafted_ids)
    for k in range(STEPS):
        ttt = jax.nn.log_softmax(out["draft_logits"][k][rows, anchors - 1], axis=-1)
        np.testing.assert_allclose(np.asarray(log_probs[:, k]), np.asarray(ttt), atol=1e-4, err_msg=f"step {k}")


def test_sampled_proposals_come_from_their_distribution():
    dcfg, params, target_cfg, target_params, inputs, _ = fixture()
    cache = eagle3.init_eagle3_cache(dcfg, batch=2, max_len=48)
    n = 12
    cache = append_context(params, dcfg, target_params, cache, jnp.asarray(inputs["taps"][:, :n - 1]),
                           jnp.asarray(inputs["input_ids"][:, 1:n]), jnp.full((2,), n - 1, jnp.int32))
    sampling = SamplingConfig(temperature=0.8, top_k=5)
    tokens, log_probs, _ = propose(params, dcfg, target_params, target_cfg, cache,
                                   jnp.asarray(inputs["input_ids"][:, n]), jnp.asarray(inputs["taps"][:, n - 1]),
                                   jax.random.key(1), sampling=sampling, gamma=4)
    log_probs = np.asarray(log_probs)
    assert (np.isfinite(log_probs).sum(-1) == 5).all()  # top-k applied
    chosen = np.take_along_axis(log_probs, np.asarray(tokens)[..., None], axis=-1)
    assert np.isfinite(chosen).all()


def test_gradients_reach_drafter_params():
    dcfg, _, target_cfg, target_params, inputs, _ = fixture()
    params = eagle3.init_eagle3_params(dcfg, jax.random.key(0))

    @jax.jit
    def loss(params):
        return eagle3.eagle3_train_forward(
            params, dcfg, target_params, target_cfg, jnp.asarray(inputs["input_ids"]),
            jnp.asarray(inputs["loss_mask"]), jnp.asarray(inputs["taps"]),
            jnp.asarray(inputs["target_last_hidden_states"]), steps=2)["total_loss"]

    grads = jax.grad(loss)(params)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert np.isfinite(np.asarray(g)).all(), jax.tree_util.keystr(path)
    assert np.abs(np.asarray(grads["fc"])).max() > 0
    assert np.abs(np.asarray(grads["layers"]["wq"])).max() > 0


def test_wrong_shaped_tensor_is_a_user_error(tmp_path):
    tensors = load_file(os.path.join(FIXTURE, "eagle3.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :256].copy()  # 4 taps' worth instead of 5
    save_file(tensors, str(tmp_path / "eagle3.safetensors"))
    shutil.copy(os.path.join(FIXTURE, "eagle3_config.json"), tmp_path / "eagle3_config.json")
    with pytest.raises(UserError, match="fc.weight"):
        eagle3.load_deepspec_eagle3(str(tmp_path / "eagle3.safetensors"), str(tmp_path / "eagle3_config.json"))


def test_wrong_target_is_a_user_error():
    _, _, target_cfg, *_ = fixture()
    with pytest.raises(UserError, match="trained for target"):
        eagle3.load_deepspec_eagle3(os.path.join(FIXTURE, "eagle3.safetensors"),
                                    os.path.join(FIXTURE, "eagle3_config.json"),
                                    target_cfg=target_cfg.replace(num_layers=8))


def test_packed_rows_equal_each_sequence_alone():
    """Two sequences packed in one row (the training pipeline's format) give the same per-position
    logits and step losses (up to the B*S normaliser) as each sequence in its own row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.drafters.eagle3 import eagle3_train_forward, init_eagle3_params
    from dspark_jax.drafters.config import DrafterConfig
    from dspark_jax.models import decoder
    from dspark_jax.models.config import ModelConfig

    tcfg = ModelConfig(family="qwen3", vocab_size=40, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=8, intermediate_size=48, max_position_embeddings=128, qk_norm=True)
    dcfg = DrafterConfig(kind="eagle3", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=40, head="none", confidence=False,
                         target_layer_ids=(0, 1), ttt_steps=3)
    tparams = decoder.init_params(tcfg, jax.random.key(0), scale=0.3)
    params = init_eagle3_params(dcfg, jax.random.key(1))
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 40, size=9), rng.integers(1, 40, size=7)
    feats = jnp.asarray(rng.normal(size=(1, 16, 64)), jnp.float32)
    last = jnp.asarray(rng.normal(size=(1, 16, 32)), jnp.float32)
    packed = eagle3_train_forward(
        params, dcfg, tparams, tcfg, jnp.asarray(np.concatenate([a, b])[None]), jnp.ones((1, 16)), feats, last,
        segment_ids=jnp.asarray([[1] * 9 + [2] * 7]), positions=jnp.asarray([list(range(9)) + list(range(7))]))
    for seq, sl in ((a, slice(0, 9)), (b, slice(9, 16))):
        alone = eagle3_train_forward(params, dcfg, tparams, tcfg, jnp.asarray(seq[None]), jnp.ones((1, len(seq))),
                                     feats[:, sl], last[:, sl])
        mask = np.asarray(alone["position_mask"]) > 0
        np.testing.assert_array_equal(np.asarray(packed["position_mask"])[:, :, sl], np.asarray(alone["position_mask"]))
        np.testing.assert_allclose(np.asarray(packed["draft_logits"])[:, :, sl][mask],
                                   np.asarray(alone["draft_logits"])[mask], atol=2e-5)


def test_loss_at_slots_is_the_full_loss_restricted_to_them():
    """Supervising only some positions (a gather before both LM heads) gives the full forward's
    logits and masks at those positions, and the same loss as masking every other position out."""
    dcfg, params, target_cfg, target_params, inputs, _ = fixture()
    B, S = inputs["input_ids"].shape
    rng = np.random.default_rng(0)
    slots = np.sort(np.stack([rng.choice(S, 5, replace=False) for _ in range(B)]), axis=1).astype(np.int32)
    valid = np.ones_like(slots, bool)
    valid[0, -1] = False
    kw = dict(params=params, dcfg=dcfg, target_params=target_params, target_cfg=target_cfg,
              input_ids=jnp.asarray(inputs["input_ids"]), ctx_features=jnp.asarray(inputs["taps"]),
              target_last_hidden=jnp.asarray(inputs["target_last_hidden_states"]), steps=STEPS)
    full = train_forward(loss_mask=jnp.asarray(inputs["loss_mask"]), **kw)
    picked = train_forward(loss_mask=jnp.asarray(inputs["loss_mask"]), loss_slots=jnp.asarray(slots),
                           loss_slots_valid=jnp.asarray(valid), **kw)
    rows = np.arange(B)[:, None]
    np.testing.assert_allclose(np.asarray(picked["draft_logits"]),
                               np.asarray(full["draft_logits"])[:, rows, slots], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(picked["position_mask"]),
                                  np.asarray(full["position_mask"])[:, rows, slots] * valid)
    keep = np.zeros((B, S), np.float32)
    keep[rows, np.where(valid, slots, 0)] = valid  # the same positions, by masking instead of gathering
    restricted = [train_forward(loss_mask=jnp.asarray(inputs["loss_mask"] * np.roll(keep, i, axis=1)), **kw)
                  for i in range(STEPS)]
    for i in range(STEPS):  # pass i reads loss_mask at t+i, so the mask is moved along with it
        np.testing.assert_allclose(float(picked["loss"][i]) * slots.size,
                                   float(restricted[i]["loss"][i]) * B * S, rtol=2e-5)
    # acceptance: sum_v min(q, p) with p the target's distribution at t+1+i, where pass i is supervised
    from dspark_jax.models import decoder
    p = np.asarray(jax.nn.softmax(decoder.logits(target_params, target_cfg,
                                                 jnp.asarray(inputs["target_last_hidden_states"])), axis=-1))
    q = np.asarray(jax.nn.softmax(full["draft_logits"], axis=-1))
    for i in range(STEPS):
        b, t = np.nonzero(np.asarray(full["position_mask"][i]))
        want = np.minimum(q[i, b, t], p[b, t + 1 + i]).sum(-1)
        np.testing.assert_allclose(np.asarray(full["acceptance"][i])[b, t], want, atol=1e-5)
    supervised = np.asarray(picked["position_mask"]) > 0  # elsewhere p is a placeholder
    np.testing.assert_allclose(np.asarray(picked["acceptance"])[supervised],
                               np.asarray(full["acceptance"])[:, rows, slots][supervised], atol=1e-5)
    every = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    whole = train_forward(loss_mask=jnp.asarray(inputs["loss_mask"]), loss_slots=jnp.asarray(every), **kw)
    np.testing.assert_allclose(float(whole["total_loss"]), float(full["total_loss"]), rtol=2e-5)
