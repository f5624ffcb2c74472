"""fp32 products of few rows against a weight on a CPU: `matmul_t(x, w) = x @ w.T` (w stored
[out, in]) through our own kernel (`cpu_matmul.cc`), an XLA:CPU FFI custom call.

XLA:CPU's dot costs about twice a matrix-vector product once 2-8 rows share a weight (measured for
SmolLM2-135M's matrices: 1 / 8 rows 24 / 47 ms, against 21 / 27 ms with this kernel), so a verify
pass of 8 tokens cost 2x a decode step. The kernel streams each weight row once for all rows, on
XLA's own intra-op thread pool, and reduces every output in the same order whatever the row count
(a 1-row decode step and an 8-row verify pass agree bit for bit).

It is compiled on first use for this machine (`c++ -O3 -march=native` against the FFI headers that
jaxlib ships), cached by source, jaxlib version, compiler and CPU, and loaded with ctypes. Where it
cannot be had (no C++ compiler, not x86-64 with AVX2/AVX-512, a failed build, another backend, or
DSPARK_CPU_KERNELS=0) `usable` is False and callers keep XLA's dot: same results up to float
rounding, only slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib.resources import files

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

TARGET = "dspark_matmul_f32"
MAX_ROWS = 32  # beyond this XLA's blocked GEMMs win (a prefill); measured equal at 32 rows
_SOURCE = "cpu_matmul.cc"


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("DSPARK_KERNEL_CACHE") or os.path.join(base, "dspark_jax", "kernels")


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler: str, source: bytes, include: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [source, importlib.metadata.version("jaxlib").encode(), version.encode(), _cpu_fingerprint().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    folder = cache_dir()
    path = os.path.join(folder, f"cpu_matmul_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, _SOURCE)
        with open(src, "wb") as f:
            f.write(source)
        out = os.path.join(tmp, "lib.so")
        subprocess.run([compiler, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", "-I", include,
                        src, "-o", out], check=True, capture_output=True, timeout=300)
        os.replace(out, path)  # atomic: a concurrent process sees the whole library or none
    return path


@functools.cache
def _library() -> bool:
    """Build (once per machine), load and register the kernel; False where it cannot be had."""
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    compiler = _compiler()
    if compiler is None:
        log.info("no C++ compiler: fp32 products use XLA's dot")
        return False
    try:
        path = _build(compiler, (files("dspark_jax.models") / _SOURCE).read_bytes(), jax.ffi.include_dir())
        lib = ctypes.cdll.LoadLibrary(path)
        if lib.dspark_matmul_vector_width() == 0:
            return False
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.dspark_matmul_f32), platform="cpu")
        return True
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("the fp32 CPU kernel could not be built (%s): using XLA's dot", e)
        return False


def active() -> bool:
    """Whether fp32 few-row products run our kernel in this process (the CPU backend, kernel built)."""
    return jax.default_backend() == "cpu" and _library()


def usable(x: jax.Array, w: jax.Array) -> bool:
    """Whether `matmul_t(x, w)` runs our kernel: fp32 on a CPU, few rows (the static shape)."""
    rows = x.size // max(x.shape[-1], 1)
    return x.dtype == jnp.float32 and w.dtype == jnp.float32 and w.ndim == 2 and 0 < rows <= MAX_ROWS and active()


def _call(x2: jax.Array, w: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, w)


@jax.custom_vjp
def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] in fp32 (check `usable` first)."""
    return _call(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (w.shape[0],))


def _forward(x, w):
    return matmul_t(x, w), (x, w)


def _backward(res, g):
    x, w = res
    return jnp.einsum("...n,nk->...k", g, w), jnp.einsum("...n,...k->nk", g, x)


matmul_t.defvjp(_forward, _backward)
