"""Sharded forward on 4 fake CPU devices equals the unsharded forward."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from dspark_jax.distributed import sharding
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=128, qk_norm=True)


@pytest.mark.needs_devices(4)  # fails with fewer devices unless DSPARK_ALLOW_FEWER_DEVICES=1 (tests/conftest.py)
@pytest.mark.parametrize("mesh_shape", [dict(data=2, tensor=2), dict(tensor=4), dict(data=4)])
def test_sharded_forward_matches_unsharded(mesh_shape):
    params = decoder.init_params(CFG, jax.random.key(0), scale=0.1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(4, 12)), jnp.int32)
    num_new = jnp.array([12, 7, 9, 3], jnp.int32)

    def run(params, tokens, cache, num_new):
        h, cache, _ = decoder.forward(params, CFG, tokens, cache, num_new)
        return decoder.logits(params, CFG, h), cache

    cache = decoder.init_cache(CFG, 4, 32)
    ref_logits, ref_cache = jax.jit(run)(params, tokens, cache, num_new)

    mesh = sharding.make_mesh(devices=jax.devices()[:4], **mesh_shape)
    p_sh = sharding.param_shardings(mesh, CFG)
    c_sh = sharding.cache_shardings(mesh, cache)
    batch = NamedSharding(mesh, sharding.logical_spec(mesh, ("batch", "seq"), tokens.shape))
    rows = NamedSharding(mesh, sharding.logical_spec(mesh, ("batch",), num_new.shape))
    out_logits = NamedSharding(mesh, sharding.logical_spec(mesh, ("batch", "seq", "vocab"), ref_logits.shape))
    sharded = jax.jit(run, in_shardings=(p_sh, batch, c_sh, rows), out_shardings=(out_logits, c_sh))
    params_s = jax.device_put(params, p_sh)
    if mesh.shape["tensor"] > 1:  # the weights really are split
        assert params_s["layers"]["wq"].sharding.spec == P(None, None, "tensor")
        assert len(params_s["layers"]["wq"].addressable_shards) == 4
    logits, new_cache = sharded(params_s, jax.device_put(tokens, batch), jax.device_put(cache, c_sh),
                                jax.device_put(num_new, rows))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(new_cache.k), np.asarray(ref_cache.k), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(new_cache.lengths), [12, 7, 9, 3])


def test_indivisible_dimension_is_replicated():
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    assert sharding.logical_spec(mesh, ("batch", "kv_heads"), (3, 3)) == P(None, None)


@pytest.mark.needs_devices(4)
def test_indivisible_dimension_is_replicated_on_4_devices():
    mesh4 = sharding.make_mesh(tensor=4, devices=jax.devices()[:4])
    assert sharding.logical_spec(mesh4, ("embed", "kv_heads"), (64, 3)) == P(None, None)
    assert sharding.logical_spec(mesh4, ("embed", "heads"), (64, 8)) == P(None, "tensor")
