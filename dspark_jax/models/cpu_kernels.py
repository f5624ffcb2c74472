"""Our own XLA:CPU kernels (`cpu_kernels.cc`, FFI custom calls) for the two things a decode step or a
verify pass does with few new tokens, in fp32:

* `matmul_t(x, w) = x @ w.T` against a weight stored [out, in], fp32 or bf16 (widened exactly as it
  is read: the product of the fp32 activations with the bf16 weights' values, for half the bytes);
* `decode_attention`: the new tokens' attention over the KV cache, reading only the keys each row
  can see.

Products: XLA:CPU's dot costs about twice a matrix-vector product once 2-8 rows share a weight (measured for
SmolLM2-135M's matrices: 1 / 8 rows 24 / 47 ms, against 21 / 27 ms with this kernel), so a verify
pass of 8 tokens cost 2x a decode step. The kernel streams each weight row once for all rows, on
XLA's own intra-op thread pool, and reduces every output in the same order whatever the row count
(a 1-row decode step and an 8-row verify pass agree bit for bit).
Attention: XLA:CPU either reads the whole cache (a masked pass) or slices chunks of it in a loop,
and each slice, loop trip and small library call has a fixed cost: ~3 ms of a ~27 ms SmolLM2 step
at a short context, and at batch 32 every row reads the whole cache.

The library is compiled on first use for this machine (`c++ -O3 -march=native` against the FFI headers that
jaxlib ships), cached by source, jaxlib version, compiler and CPU, and loaded with ctypes. Where it
cannot be had (no C++ compiler, not x86-64 with AVX2/AVX-512, a failed build, another backend, or
DSPARK_CPU_KERNELS=0) `usable` / `attention_usable` are False and callers keep XLA's ops: same
results up to float rounding, only slower.
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
import numpy as np

from dspark_jax.core.platform import traced_for_cpu

log = logging.getLogger(__name__)

_SOURCE = "cpu_kernels.cc"
TARGET = "dspark_matmul_f32"
BF16_WEIGHTS_TARGET = "dspark_matmul_bf16w"
ATTENTION_TARGET = "dspark_decode_attention_f32"
MAX_ROWS = 32  # beyond this XLA's blocked GEMMs win (a prefill); measured equal at 32 rows
MAX_NEW_TOKENS = 16  # attention: decode steps and verify passes (a prefill keeps XLA's)


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
    march = os.environ.get("DSPARK_KERNEL_MARCH", "native")  # e.g. "haswell": the AVX2 path on an AVX-512 CPU
    parts = [source, importlib.metadata.version("jaxlib").encode(), version.encode(), _cpu_fingerprint().encode(),
             march.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    folder = cache_dir()
    path = os.path.join(folder, f"cpu_kernels_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, _SOURCE)
        with open(src, "wb") as f:
            f.write(source)
        out = os.path.join(tmp, "lib.so")
        subprocess.run([compiler, "-O3", f"-march={march}", "-std=c++17", "-shared", "-fPIC", "-w", "-I", include,
                        src, "-o", out], check=True, capture_output=True, timeout=300)
        os.replace(out, path)  # atomic: a concurrent process sees the whole library or none
    return path


@functools.cache
def _library() -> dict:
    """Build (once per machine), load and register the kernels -> {"matmul": bool, "attention": bool}."""
    none = {"matmul": False, "attention": False}
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return none
    compiler = _compiler()
    if compiler is None:
        log.info("no C++ compiler: fp32 products and attention use XLA's ops")
        return none
    try:
        path = _build(compiler, (files("dspark_jax.models") / _SOURCE).read_bytes(), jax.ffi.include_dir())
        lib = ctypes.cdll.LoadLibrary(path)
        found = {"matmul": lib.dspark_matmul_vector_width() > 0, "attention": lib.dspark_attention_available() > 0}
        if found["matmul"]:
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.dspark_matmul_f32), platform="cpu")
            jax.ffi.register_ffi_target(BF16_WEIGHTS_TARGET, jax.ffi.pycapsule(lib.dspark_matmul_bf16w),
                                        platform="cpu")
        if found["attention"]:
            jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.dspark_decode_attention_f32),
                                        platform="cpu")
        return found
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        log.warning("the CPU kernels could not be built (%s): using XLA's ops", e)
        return none


@functools.cache
def source_tag() -> str:
    """A short hash of the kernels' source: what their speed depends on, for caches of measured costs
    (an SPS table profiled with one version of the kernels misleads the scheduler under another)."""
    return hashlib.sha256((files("dspark_jax.models") / _SOURCE).read_bytes()).hexdigest()[:8]


def active(kernel: str = "matmul") -> bool:
    """Whether `kernel` ("matmul" or "attention") runs in the programs traced now (for a CPU, kernel built)."""
    return traced_for_cpu() and _library()[kernel]


def usable(x: jax.Array, w: jax.Array) -> bool:
    """Whether `matmul_t(x, w)` runs our kernel: fp32 activations, fp32 or bf16 weights, on a CPU,
    few rows (the static shape)."""
    rows = x.size // max(x.shape[-1], 1)
    return (x.dtype == jnp.float32 and w.dtype in (jnp.float32, jnp.bfloat16) and w.ndim == 2
            and 0 < rows <= MAX_ROWS and active())


def _call(x2: jax.Array, w: jax.Array) -> jax.Array:
    _library()  # registers the targets (usable() has built them already)
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[0]), jnp.float32)
    target = TARGET if w.dtype == jnp.float32 else BF16_WEIGHTS_TARGET
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(x2, w)


@jax.custom_vjp
def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] in fp32 (check `usable` first)."""
    return _call(x.reshape(-1, x.shape[-1]), w).reshape(x.shape[:-1] + (w.shape[0],))


def _forward(x, w):
    return matmul_t(x, w), (x, w)


def _backward(res, g):
    x, w = res
    return jnp.einsum("...n,nk->...k", g, w.astype(g.dtype)), jnp.einsum("...n,...k->nk", g, x).astype(w.dtype)


matmul_t.defvjp(_forward, _backward)


def attention_usable(q: jax.Array, k_t: jax.Array, v: jax.Array) -> bool:
    """Whether `decode_attention` runs our kernel: fp32, few new tokens, head_dim 64/128/256, a cache
    length that is a multiple of 16 (the static shapes)."""
    return (all(a.dtype == jnp.float32 for a in (q, k_t, v)) and q.shape[1] <= MAX_NEW_TOKENS
            and q.shape[-1] in (64, 128, 256) and v.shape[2] % 16 == 0 and active("attention"))


def decode_attention(q: jax.Array, k_t: jax.Array, v: jax.Array, q_positions: jax.Array, scale: float,
                     window=None) -> jax.Array:
    """`decoder.cache_attention` (same arguments and result, [B, T, H*D]) through our kernel: each
    (row, kv head) attends over the keys its queries can see, p - window < s <= p, and no others.
    Inference only (no gradient)."""
    _library()
    B, T, H, D = q.shape
    window = jnp.asarray(2**30 if window is None else window, jnp.int32)
    out = jax.ShapeDtypeStruct((B, T, H * D), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION_TARGET, out, vmap_method="sequential")(
        q, k_t, v, q_positions.astype(jnp.int32), window, scale=np.float32(scale))
