"""bf16 weights with fp32 activations (`--dtype bfloat16` on a CPU): every product against a weight
accumulates in fp32 (`decoder.weight_einsum`), the rest of the model stays fp32. Products of up to
32 rows against a weight stored [out, in] run our CPU kernel, which widens the bf16 weights and keeps
the activations fp32; the others run in bf16 (the activations rounded to bf16 at the product)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import cpu_kernels, decoder
from dspark_jax.models.config import ModelConfig

CFG = ModelConfig(family="llama", vocab_size=101, hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=12, intermediate_size=80, max_position_embeddings=128)


def rounded(a):
    return np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("...i,oi->...o", (1, 1, 40), (24, 40)),  # one row: the kernel, or computed as two without it
    ("...i,oi->...o", (3, 5, 40), (24, 40)),
    ("...i,oi->...o", (3, 11, 40), (24, 40)),  # 33 rows: past the kernel's, XLA's bf16 product
    ("...i,io->...o", (1, 40), (40, 24)),
    ("...r,rv->...v", (2, 16), (16, 300)),
    ("...i,i->...", (1, 40), (40,)),  # the confidence head's vector
])
def test_weight_einsum_is_the_bf16_product_accumulated_in_fp32(spec, x_shape, w_shape):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.bfloat16)
    got = decoder.weight_einsum(spec, x, w)
    assert got.dtype == jnp.float32 and got.shape == np.einsum(spec, np.asarray(x), np.asarray(w, np.float32)).shape
    kernel = spec in decoder._ROWS_OF_W and cpu_kernels.usable(x, w)
    # exact products of the bf16 weights with the activations: fp32 in the kernel, else rounded to bf16
    want = np.einsum(spec, np.asarray(x, np.float64) if kernel else rounded(x), rounded(w))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    same = decoder.weight_einsum(spec, x, w.astype(jnp.float32))  # equal dtypes: a plain fp32 product
    np.testing.assert_allclose(np.asarray(same), np.einsum(spec, np.asarray(x, np.float64), rounded(w)),
                               rtol=1e-5, atol=1e-5)


def test_bf16_weights_keep_fp32_activations_and_track_the_fp32_model():
    params = decoder.init_params(CFG, jax.random.key(0), scale=0.1)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    upcast = jax.tree.map(lambda a: a.astype(jnp.float32), bf16)  # the same weights, fp32 products
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, size=(2, 12)), jnp.int32)
    outs = {}
    for name, p in (("bf16", bf16), ("upcast", upcast)):
        cache = decoder.init_cache(CFG, 2, 16)
        hidden, cache, _ = decoder.forward(p, CFG, tokens, cache, jnp.array([12, 9]))
        assert hidden.dtype == jnp.float32 and cache.k.dtype == jnp.float32
        outs[name] = np.asarray(decoder.logits(p, CFG, hidden))
    # Only the activations' rounding at each product's input differs: bf16 has 8 mantissa bits.
    scale = np.abs(outs["upcast"]).max()
    err = np.abs(outs["bf16"] - outs["upcast"]).max()
    assert 0 < err < 2e-2 * scale, (err, scale)


def test_activations_are_fp32_on_a_cpu():
    assert jax.default_backend() == "cpu"
    assert decoder.activation_dtype(jnp.bfloat16) == "float32"
    assert decoder.activation_dtype("float32") == "float32"


def test_gradients_reach_16_bit_weights_moved_as_bits():
    """The stacked scan and `take_rows` move bf16 weights as uint16 bits (`decoder.as_bits`); a bf16
    training step must still get their gradients (through the bits alone they would be zero)."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), decoder.init_params(CFG, jax.random.key(0), scale=0.1))
    assert decoder.layout_of(params) == "stacked"
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, size=(1, 6)), jnp.int32)

    def loss(p):
        hidden, _ = decoder.forward_packed(p, CFG, tokens, jnp.arange(6)[None], jnp.ones((1, 6), jnp.int32),
                                           tap_layers=())  # the training forward
        return decoder.logits(p, CFG, hidden).astype(jnp.float32).std() + \
            decoder.take_rows(p["embed"], tokens).astype(jnp.float32).sum()

    got = jax.grad(loss)(params)
    want = jax.grad(lambda p: loss(jax.tree.map(lambda a: a.astype(jnp.float32), p)))(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.abs(g).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=0.1, atol=0.05 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))
