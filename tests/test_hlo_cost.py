"""serving/hlo_cost.py: a compiled program's matmul flops and HBM bytes per execution, every loop body
counted as many times as it runs (XLA's cost_analysis counts it once)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.serving import hlo_cost

B, D, N = 8, 256, 6  # rows, width, layers


def layers(x, ws):
    """N matmul layers in a scan, as the decoder runs its stacked layers."""
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]


def first_rows(x, ws, n):
    """A loop of data-dependent length: the first n layers."""
    return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ ws[i]), x)


def shapes(dtype=jnp.float32, sharding=None, n=N):
    return (jax.ShapeDtypeStruct((B, D), dtype, sharding=sharding),
            jax.ShapeDtypeStruct((n, D, D), dtype, sharding=sharding))


def test_a_scan_counts_its_body_once_per_layer():
    cost = hlo_cost.program_cost(jax.jit(layers).lower(*shapes()).compile().as_text())
    assert cost.loops == (N,) and cost.dynamic_loops == 0
    assert cost.flops == N * 2 * B * D * D  # XLA's own figure holds one layer's
    # XLA:CPU copies each layer's weights out of the stack before its matmul: read, written, read
    weights = N * D * D * 4
    assert 3 * weights <= cost.hbm_bytes <= 3.25 * weights
    twice = hlo_cost.program_cost(jax.jit(layers).lower(*shapes(n=2 * N)).compile().as_text())
    assert twice.flops == 2 * cost.flops and twice.hbm_bytes == pytest.approx(2 * cost.hbm_bytes, rel=0.02)


def test_a_loop_of_data_dependent_length_is_counted_once_and_said():
    x, ws = shapes()
    compiled = jax.jit(first_rows).lower(x, ws, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    cost = hlo_cost.program_cost(compiled.as_text())
    assert cost.loops == (None,) and cost.dynamic_loops == 1
    assert cost.flops == 2 * B * D * D


def test_padding_of_a_convolution_is_not_counted():
    """The TPU compiler writes a batched matmul as a convolution whose window slides over zero
    padding: only the pairs that meet real input count (here the diagonal: 4 of 16)."""
    assert hlo_cost._valid_pairs(out=4, window=4, size=1, pad_lo=3, stride=1, rhs_dilate=1, lhs_dilate=1) == 4
    assert hlo_cost._valid_pairs(out=7, window=4, size=4, pad_lo=3, stride=1, rhs_dilate=1, lhs_dilate=1) == 16
    brute = sum(1 for o in range(5) for j in range(3) if 0 <= o * 2 + j - 1 < 9)
    assert hlo_cost._valid_pairs(out=5, window=3, size=9, pad_lo=1, stride=2, rhs_dilate=1, lhs_dilate=1) == brute


def test_an_in_place_update_counts_the_update_not_the_buffer():
    def write(cache, row):  # one row of a donated [4096, D] buffer
        return jax.lax.dynamic_update_slice(cache, row, (7, 0))

    compiled = jax.jit(write, donate_argnums=0).lower(jax.ShapeDtypeStruct((4096, D), jnp.float32),
                                                      jax.ShapeDtypeStruct((1, D), jnp.float32)).compile()
    assert hlo_cost.program_cost(compiled.as_text()).hbm_bytes <= 4 * D * 4


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason=f"libtpu is not installed: pip install 'jax[tpu]=={jax.__version__}'")
def test_the_tpu_compiler_s_matmuls_are_counted_as_xla_counts_them():
    """Compiled for a TPU (matmuls as convolutions, arrays in on-chip memory): one layer's flops are
    XLA's cost_analysis figure; the scan's are N times it, and each layer's weights are read once
    (the slice of the stack fused into the matmul)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from dspark_jax.serving.tpu_compile import quiet_cache, slice_devices, tpu_slice

    mesh = Mesh(np.asarray(slice_devices(tpu_slice("v5p-8"))[:1]), ("x",))
    args = shapes(jnp.bfloat16, NamedSharding(mesh, PartitionSpec()))
    with quiet_cache():
        one = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(args[0], jax.ShapeDtypeStruct(
            (D, D), jnp.bfloat16, sharding=args[0].sharding)).compile()
        scanned = jax.jit(layers).lower(*args).compile()
    xla = one.cost_analysis()
    xla = xla[0] if isinstance(xla, (list, tuple)) else xla
    assert hlo_cost.program_cost(one.as_text()).flops == pytest.approx(xla["flops"], rel=0.02)
    cost = hlo_cost.program_cost(scanned.as_text())
    assert cost.loops == (N,) and cost.flops == N * 2 * B * D * D
    assert N * D * D * 2 <= cost.hbm_bytes <= 1.25 * N * D * D * 2
