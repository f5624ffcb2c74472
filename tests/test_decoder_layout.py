"""The two layer layouts (stacked + scan, per-layer + Python loop) are one decoder: the same logits,
caches and taps for every entry point; and the cache attention that reads keys only up to the
furthest query equals plain masked attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.distributed import sharding
from dspark_jax.engine.generate import generate
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig

CFG = ModelConfig(family="qwen2", vocab_size=101, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                  head_dim=8, intermediate_size=80, max_position_embeddings=512, qkv_bias=True)
TAPS = (0, 1, 3)


@pytest.fixture(scope="module")
def params():
    stacked = decoder.init_params(CFG, jax.random.key(0), scale=0.2)
    return {"stacked": stacked, "per_layer": decoder.with_layout(stacked, CFG, "per_layer")}


def cache_layers(cache):
    """The cache as [L, B, Hkv, S, D] whatever its layout."""
    return tuple(np.asarray(jnp.stack(kv) if isinstance(kv, tuple) else kv) for kv in (cache.k, cache.v))


def test_layout_round_trip_and_structure(params):
    per_layer = params["per_layer"]
    assert decoder.layout_of(per_layer) == "per_layer" and len(per_layer["layers"]) == CFG.num_layers
    back = decoder.with_layout(per_layer, CFG, "stacked")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params["stacked"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for layout, p in params.items():  # shapes and logical axes describe the params of each layout
        shapes = jax.tree.map(lambda a: a.shape, p)
        assert shapes == jax.tree.map(tuple, decoder.param_shapes(CFG, layout), is_leaf=sharding.is_spec)
        assert jax.tree.structure(decoder.param_logical_axes(CFG, layout), is_leaf=sharding.is_spec) == jax.tree.structure(p)
    with pytest.raises(ValueError):
        decoder.with_layout(per_layer, CFG, "diagonal")


def test_forward_prefill_extend_decode_identical(params):
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(3, 40)), jnp.int32)
    lengths = jnp.array([40, 17, 29], jnp.int32)
    extend = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(3, 5)), jnp.int32)
    out = {}
    for layout, p in params.items():
        cache = decoder.cache_for(p, CFG, 3, 96)
        h1, cache, t1 = decoder.forward(p, CFG, prompt, cache, lengths, TAPS)
        h2, cache, t2 = decoder.forward(p, CFG, extend, cache, jnp.array([5, 2, 4], jnp.int32), TAPS)
        h3, cache, _ = decoder.forward(p, CFG, extend[:, :1], cache, jnp.ones(3, jnp.int32))
        out[layout] = [np.asarray(a) for a in (h1, t1, h2, t2, h3, decoder.logits(p, CFG, h3))] + list(cache_layers(cache))
    for a, b in zip(out["stacked"], out["per_layer"]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_forward_flat_and_packed_identical(params):
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(8,)), jnp.int32)
    rows = jnp.array([0, 0, 0, 1, 2, 2, 0, 0], jnp.int32)
    positions = jnp.array([20, 21, 22, 9, 30, 31, 0, 0], jnp.int32)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 0, 0], bool)
    packed = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 24)), jnp.int32)
    pos = jnp.concatenate([jnp.arange(10), jnp.arange(14)])[None].repeat(2, 0)
    seg = jnp.concatenate([jnp.zeros(10), jnp.ones(14)]).astype(jnp.int32)[None].repeat(2, 0)
    out = {}
    for layout, p in params.items():
        cache = decoder.cache_for(p, CFG, 3, 64)
        prompt = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, size=(3, 32)), jnp.int32)
        _, cache, _ = decoder.forward(p, CFG, prompt, cache, jnp.array([20, 9, 30], jnp.int32))
        h, cache, taps = decoder.forward_flat(p, CFG, tokens, rows, positions, valid, cache, TAPS, width=4)
        hp, tp = decoder.forward_packed(p, CFG, packed, pos, seg, TAPS)
        out[layout] = [np.asarray(a) for a in (h[:6], taps[:, :6], hp, tp)] + list(cache_layers(cache))
    for a, b in zip(out["stacked"], out["per_layer"]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_generate_identical(params):
    prompts = [[5, 6, 7, 8, 9], [3] * 21, [11, 12]]
    ids = {layout: generate(p, CFG, prompts, max_new_tokens=12).token_ids for layout, p in params.items()}
    assert ids["stacked"] == ids["per_layer"]


@pytest.mark.parametrize("S,chunk", [(64, 16), (72, 16), (40, 64), (136, 32)])
def test_chunked_attention_equals_masked_attention(S, chunk):
    """Chunks that do not divide the cache (the last one overlaps its neighbour) and queries spread
    over the cache, including rows whose queries need a single chunk."""
    rng = np.random.default_rng(S)
    B, T, H, Hkv, D = 3, 4, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, Hkv, D, S)), jnp.float32)  # transposed, as cached
    v = jnp.asarray(rng.normal(size=(B, Hkv, S, D)), jnp.float32)
    starts = np.array([0, S // 2, S - T])
    q_pos = jnp.asarray(starts[:, None] + np.arange(T)[None], jnp.int32)
    visible = jnp.arange(S)[None, None, :] <= q_pos[:, :, None]
    want = decoder.attention(q, k, v, visible)
    got = decoder.chunked_attention(q, k, v, q_pos, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    # Whatever lies past the furthest query (the unwritten cache tail) changes nothing.
    far = int(q_pos.max()) + 1
    k_junk = k.at[..., far:].set(1e4)
    np.testing.assert_allclose(np.asarray(decoder.chunked_attention(q, k_junk, v, q_pos, chunk=chunk)),
                               np.asarray(got), atol=1e-5, rtol=0)


def test_param_shardings_follow_layout(params):
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    for layout, p in params.items():
        shardings = sharding.param_shardings(mesh, CFG, layout)
        assert jax.tree.structure(shardings) == jax.tree.structure(p)
        cache = decoder.cache_for(p, CFG, 2, 16)
        assert jax.tree.structure(sharding.cache_shardings(mesh, cache)) == jax.tree.structure(cache)
