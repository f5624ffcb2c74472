"""The fp32 few-row CPU kernel (models/cpu_kernels.py, cpu_matmul.cc): exact enough, bit-identical
whatever the row count, used where it should be, with gradients, and replaceable by XLA's dot."""

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


def test_a_row_gets_the_same_bits_whatever_the_row_count():
    # What makes a 1-token decode step and an 8-token verify pass agree exactly in the dense layers.
    x, w = rand((32, 576), 3), rand((3075, 576), 4)
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


def test_gradients_are_the_products():
    x, w = rand((4, 64), 7), rand((24, 64), 8)
    g = rand((4, 24), 9)
    dx, dw = jax.grad(lambda x, w: jnp.sum(cpu_kernels.matmul_t(x, w) * g), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(g @ w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(g.T @ x), rtol=1e-5, atol=1e-5)


def kernel_in(fn, *args) -> bool:
    return cpu_kernels.TARGET in jax.jit(fn).lower(*args).as_text()


def test_weight_einsum_uses_it_for_few_rows_of_fp32_only():
    if not cpu_kernels.usable(rand((1, 64), 0), rand((8, 64), 1)):
        pytest.skip("the kernel is not available on this machine")
    w = rand((48, 64), 10)
    few, many = rand((2, 4, 64), 11), rand((cpu_kernels.MAX_ROWS + 1, 64), 12)
    assert kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), few, w)
    assert kernel_in(lambda x, w: decoder.weight_einsum("...d,vd->...v", x, w, jnp.float32), few, w)
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), many, w)  # a prefill: XLA's GEMM
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,io->...o", x, w), few, w.T)  # [in, out]: XLA's dot
    wb = w.astype(jnp.bfloat16)
    assert not kernel_in(lambda x, w: decoder.weight_einsum("...i,oi->...o", x, w), few, wb)  # bf16 weights: AMX path
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
    code = ("from dspark_jax.models import cpu_kernels\nassert cpu_kernels._library()\n"
            "import os\nprint(len(os.listdir(cpu_kernels.cache_dir())))")
    env = {**os.environ, "DSPARK_KERNEL_CACHE": str(tmp_path / "k"), "JAX_PLATFORMS": "cpu"}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr[-2000:]
