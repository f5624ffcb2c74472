"""Our CPU kernels (models/cpu_kernels.py, cpu_kernels.cc): the few-row product against fp32 or bf16
weights (exact enough, bit-identical whatever the row count, with gradients) and the decode attention
(equal to masked attention, windows and ragged rows included), each used where it should be and
replaceable by XLA's ops."""

import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import cpu_kernels, decoder

X86 = platform.machine().lower() in ("x86_64", "amd64")


def rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def test_the_kernel_is_built_here():
    # On this project's machines (x86-64, a C++ compiler) a failed build must fail a test, not fall
    # back to XLA's dot unnoticed.
    if not X86 or cpu_kernels._compiler() is None:
        pytest.skip("needs x86-64 and a C++ compiler")
    assert cpu_kernels.usable(rand((1, 64), 0), rand((8, 64), 1))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 32])
@pytest.mark.parametrize("K,N", [(576, 960), (64, 13), (100, 1001), (1536, 576)])
def test_matches_a_float64_product(rows, K, N):
    x, w = rand((rows, K), rows), rand((N, K), K + N)
    y = np.asarray(jax.jit(cpu_kernels.matmul_t)(x, w))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(y, exact, rtol=0, atol=2e-6 * np.sqrt(K) * np.abs(exact).max())


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 32])
@pytest.mark.parametrize("K,N", [(576, 960), (64, 49152), (100, 1001)])
def test_bf16_weights_are_widened_exactly(rows, K, N):
    """bf16 weights: the fp32 activations times the weights' exact bf16 values (not rounded
    activations), accumulated in fp32."""
    x, w = rand((rows, K), rows), rand((N, K), K + N).astype(jnp.bfloat16)
    y = jax.jit(cpu_kernels.matmul_t)(x, w)
    assert y.dtype == jnp.float32
    exact = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(y), exact, rtol=0, atol=2e-6 * np.sqrt(K) * np.abs(exact).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [576, 100])
def test_a_row_gets_the_same_bits_whatever_the_row_count(dtype, K):
    # What makes a 1-token decode step and an 8-token verify pass agree exactly in the dense layers:
    # few rows and many take different block shapes (and 3075 leaves odd weight rows at the end).
    x, w = rand((32, K), 3), rand((3075, K), 4).astype(dtype)
    run = jax.jit(cpu_kernels.matmul_t)
    full = np.asarray(run(x, w))
    for rows in (1, 2, 3, 5, 8, 13):
        part = np.asarray(run(x[:rows], w))
        assert np.array_equal(part, full[:rows]), rows
    assert np.array_equal(np.asarray(run(x[6:7], w))[0], full[6])


def test_leading_axes_and_vmap():
    x, w = rand((2, 3, 64), 5), rand((40, 64), 6)
    ref = np.einsum("abk,nk->abn", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(cpu_kernels.matmul_t(x, w)), ref, atol=1e-4)
    np.testing.assert_allclose(np.asarray(jax.vmap(cpu_kernels.matmul_t, (0, None))(x, w)), ref, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_are_the_products(dtype):
    x, w = rand((4, 64), 7), rand((24, 64), 8).astype(dtype)
    g = rand((4, 24), 9)
    dx, dw = jax.grad(lambda x, w: jnp.sum(cpu_kernels.matmul_t(x, w) * g), argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.float32 and dw.dtype == dtype
    wide = w.astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(g @ wide), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray((g.T @ x).astype(dtype), np.float32),
                               rtol=1e-5, atol=1e-5)


def kernel_in(fn, *args, target=cpu_kernels.TARGET) -> bool:
    return f"@{target}(" in jax.jit(fn).lower(*args).as_text()


def test_weight_einsum_uses_it_for_few_rows():
    if not cpu_kernels.usable(rand((1, 64), 0), rand((8, 64), 1)):
        pytest.skip("the kernel is not available on this machine")
    w = rand((48, 64), 10)
    few, many = rand((2, 4, 64), 11), rand((cpu_kernels.MAX_ROWS + 1, 64), 12)
    assert kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), few, w)
    assert kernel_in(lambda x, w: decoder.weight_einsum("...d,vd->...v", x, w, jnp.float32), few, w)
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), many, w)  # a prefill: XLA's GEMM
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,io->...o", x, w), few, w.T)  # [in, out]: XLA's dot
    wb = w.astype(jnp.bfloat16)  # bf16 weights: the kernel's widening variant, XLA's bf16 product past 32 rows
    assert kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), few, wb,
                     target=cpu_kernels.BF16_WEIGHTS_TARGET)
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), few, wb)
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), many, wb,
                         target=cpu_kernels.BF16_WEIGHTS_TARGET)
    y = decoder.weight_einsum("...i,oi->...o", few, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(jnp.einsum("...i,oi->...o", few, w)), atol=1e-5)


def test_switched_off_it_falls_back_to_xla():
    code = ("import jax.numpy as jnp\nfrom dspark_jax.models import cpu_kernels, decoder\n"
            "x, w = jnp.ones((2, 64)), jnp.ones((8, 64))\nassert not cpu_kernels.usable(x, w)\n"
            "assert float(decoder.weight_einsum('...i,oi->...o', x, w)[0, 0]) == 64.0\nprint('ok')")
    env = {**os.environ, "DSPARK_CPU_KERNELS": "0", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(not X86 or shutil.which("c++") is None, reason="needs x86-64 and c++")
def test_builds_into_a_fresh_cache_folder(tmp_path):
    # A new machine: the library is compiled once into the cache folder and then reused.
    code = ("from dspark_jax.models import cpu_kernels\nassert cpu_kernels._library()['matmul']\n"
            "import os\nprint(len(os.listdir(cpu_kernels.cache_dir())))")
    env = {**os.environ, "DSPARK_KERNEL_CACHE": str(tmp_path / "k"), "JAX_PLATFORMS": "cpu"}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]


def masked_attention(q, k_t, v, q_pos, scale, window=None):
    S = v.shape[2]
    visible = decoder.key_visible(jnp.arange(S, dtype=jnp.int32)[None, None, :], q_pos[:, :, None], window)
    return decoder.attention(q, k_t, v, visible, scale)


needs_attention_kernel = pytest.mark.skipif(not X86 or cpu_kernels._compiler() is None,
                                            reason="needs x86-64 and a C++ compiler")


def attention_case(B, T, H, Hkv, D, S, seed):
    q, k_t, v = rand((B, T, H, D), seed), rand((B, Hkv, D, S), seed + 1), rand((B, Hkv, S, D), seed + 2)
    start = np.random.default_rng(seed).integers(0, S - T, size=B)  # ragged rows: each its own length
    return q, k_t, v, jnp.asarray(start[:, None] + np.arange(T)[None, :], jnp.int32)


@needs_attention_kernel
@pytest.mark.parametrize("B,T,H,Hkv,D,S", [(1, 1, 9, 3, 64, 384), (1, 8, 9, 3, 64, 512), (3, 1, 9, 3, 64, 2176),
                                           (32, 1, 9, 3, 64, 512), (2, 5, 8, 2, 128, 80), (2, 3, 4, 1, 256, 48),
                                           (4, 16, 6, 6, 64, 16 * 7)])
def test_decode_attention_equals_masked_attention(B, T, H, Hkv, D, S):
    q, k_t, v, q_pos = attention_case(B, T, H, Hkv, D, S, B + T + S)
    if not cpu_kernels.attention_usable(q, k_t, v):
        pytest.skip("the attention kernel is not built here (needs AVX2 or AVX-512): XLA's attention runs")
    got = jax.jit(cpu_kernels.decode_attention, static_argnums=4)(q, k_t, v, q_pos, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(masked_attention(q, k_t, v, q_pos, 0.3)), atol=2e-5, rtol=1e-5)
    # keys past a row's position are not read: junk there changes nothing
    junk = jnp.arange(S)[None, None, None, :] > q_pos.max(axis=1)[:, None, None, None]
    k_junk = jnp.where(junk, 1e4, k_t)
    v_junk = jnp.where(junk.swapaxes(2, 3), jnp.nan, v)
    again = cpu_kernels.decode_attention(q, k_junk, v_junk, q_pos, 0.3)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))


@needs_attention_kernel
@pytest.mark.parametrize("window", [1, 7, 40])
def test_decode_attention_windows(window):
    q, k_t, v, q_pos = attention_case(2, 4, 4, 2, 64, 96, window)
    if not cpu_kernels.attention_usable(q, k_t, v):
        pytest.skip("the attention kernel is not built here (needs AVX2 or AVX-512): XLA's attention runs")
    got = cpu_kernels.decode_attention(q, k_t, v, q_pos, 0.125, jnp.int32(window))
    want = masked_attention(q, k_t, v, q_pos, 0.125, jnp.int32(window))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)


def test_cache_attention_uses_the_kernel_for_few_new_tokens_only():
    q, k_t, v, q_pos = attention_case(2, 4, 9, 3, 64, 128, 0)
    if not cpu_kernels.attention_usable(q, k_t, v):
        pytest.skip("the attention kernel is not available on this machine")
    assert cpu_kernels.ATTENTION_TARGET in jax.jit(decoder.cache_attention).lower(q, k_t, v, q_pos).as_text()
    long_q = jnp.zeros((2, cpu_kernels.MAX_NEW_TOKENS + 1, 9, 64))
    long_pos = jnp.zeros((2, cpu_kernels.MAX_NEW_TOKENS + 1), jnp.int32)
    assert cpu_kernels.ATTENTION_TARGET not in jax.jit(decoder.cache_attention).lower(long_q, k_t, v, long_pos).as_text()


@pytest.mark.skipif(not X86 or shutil.which("c++") is None, reason="needs x86-64 and c++")
def test_the_avx2_build_computes_the_same_products_and_attention(tmp_path):
    # CPUs without AVX-512 (AMD before Zen 4, older Intel) get the 8-lane AVX2 path of both kernels;
    # built here for haswell, it runs on any AVX2 machine (so an AVX-512 machine tests it too).
    if "avx2" not in cpu_kernels._cpu_fingerprint():
        pytest.skip("needs an AVX2 CPU")
    code = ("import jax, jax.numpy as jnp, numpy as np\nfrom dspark_jax.models import cpu_kernels\n"
            "assert cpu_kernels._library() == {'matmul': True, 'attention': True}, cpu_kernels._library()\n"
            "rng = np.random.default_rng(0)\n"
            "for rows, K, N in [(1, 576, 960), (5, 100, 1001), (8, 1536, 576), (32, 64, 13)]:\n"
            "    x, w = rng.standard_normal((rows, K), np.float32), rng.standard_normal((N, K), np.float32)\n"
            "    y = np.asarray(jax.jit(cpu_kernels.matmul_t)(jnp.asarray(x), jnp.asarray(w)))\n"
            "    exact = x.astype(np.float64) @ w.T.astype(np.float64)\n"
            "    assert np.abs(y - exact).max() <= 2e-6 * np.sqrt(K) * np.abs(exact).max(), (rows, K, N)\n"
            "    assert np.array_equal(np.asarray(cpu_kernels.matmul_t(jnp.asarray(x[:1]), jnp.asarray(w))), y[:1])\n"
            "    wb = jnp.asarray(w).astype(jnp.bfloat16)\n"
            "    yb = np.asarray(jax.jit(cpu_kernels.matmul_t)(jnp.asarray(x), wb))\n"
            "    exact = x.astype(np.float64) @ np.asarray(wb.astype(jnp.float32), np.float64).T\n"
            "    assert np.abs(yb - exact).max() <= 2e-6 * np.sqrt(K) * np.abs(exact).max(), ('bf16', rows, K, N)\n"
            "from dspark_jax.models import decoder\n"
            "for B, T, H, Hkv, D, S in [(1, 1, 9, 3, 64, 384), (3, 8, 9, 3, 64, 2176), (32, 1, 9, 3, 64, 512),\n"
            "                           (2, 5, 8, 2, 128, 80), (2, 3, 4, 1, 256, 48)]:\n"
            "    q, k_t, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in\n"
            "                 ((B, T, H, D), (B, Hkv, D, S), (B, Hkv, S, D)))\n"
            "    q_pos = jnp.asarray(rng.integers(0, S - T, B)[:, None] + np.arange(T), jnp.int32)\n"
            "    for window in (None, 7):\n"
            "        w = None if window is None else jnp.int32(window)\n"
            "        got = cpu_kernels.decode_attention(q, k_t, v, q_pos, 0.3, w)\n"
            "        visible = decoder.key_visible(jnp.arange(S)[None, None, :], q_pos[:, :, None], w)\n"
            "        want = decoder.attention(q, k_t, v, visible, 0.3)\n"
            "        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)\n"
            "print('ok')")
    env = {**os.environ, "DSPARK_KERNEL_CACHE": str(tmp_path / "k"), "DSPARK_KERNEL_MARCH": "haswell",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
