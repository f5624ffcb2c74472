"""The platform a program is traced for: that of the devices it will run on, not always this process's.

Trace-time choices made for the hardware (our CPU kernels, 16-bit weights moved as uint16 bits, the
per-layer layer layout, fp32 activations beside bf16 weights, rotary tables computed once) ask
`target_platform()`, never `jax.default_backend()`. A program compiled ahead of time for a TPU
topology in a CPU process (`tracing_for("tpu")`, the compile check) must take the TPU's choices, or
the TPU compiler is shown a program no TPU would run (the uint16 bitcast of every stacked weight
inside the decode step: 1.55 GiB of temporaries per chip at Qwen3-8B's shapes).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TRACED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar("dspark_traced_for", default=None)


def target_platform() -> str:
    """"cpu", "gpu" or "tpu": the platform of the programs being traced now."""
    return _TRACED_FOR.get() or jax.default_backend()


def traced_for_cpu() -> bool:
    return target_platform() == "cpu"


@contextlib.contextmanager
def tracing_for(platform: str) -> Iterator[None]:
    """Trace (lower) programs inside this block with `platform`'s choices. The programs' inputs must
    carry that platform's shardings: jit's trace cache is keyed on them, so a CPU trace of the same
    function is never reused for it."""
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"unknown platform {platform!r} (cpu, gpu or tpu)")
    token = _TRACED_FOR.set(platform)
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)
