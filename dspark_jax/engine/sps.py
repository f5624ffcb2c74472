"""SPS table: target verify steps per second at each token bucket (DESIGN.md 3.1, 3.4).

The confidence scheduler trades expected committed tokens against verify cost: a round that
verifies B tokens (anchors + scheduled draft tokens, summed over requests) commits tau tokens in
expectation and runs at SPS(B) steps per second, so it yields tau * SPS(B) tokens per second.
SPS(B) is hardware- and model-specific, so it is PROFILED ONCE at engine start on the real device
and kept as a small lookup table over the engine's static token buckets:

* the verify step is compiled only for the bucket sizes of `token_buckets(max_tokens)` (powers of
  two below `max_tokens`, plus `max_tokens` itself);
* a round that needs B tokens runs the smallest bucket >= B (`pad_to_bucket`), so its cost is that
  bucket's: `sps_of(table, B)` = SPS of the smallest bucket >= B, and 0 (= "not allowed") for B
  beyond the largest bucket, which makes any scheduler maximising tau * SPS(B) stay inside the
  table by construction.

`SPSTable` is a frozen, hashable dataclass of tuples, so it can sit inside a static engine config
(`jax.jit(..., static_argnames=...)`); `sps_of` / `sps_lookup` work on Python/numpy scalars or
arrays (numpy result) and on jax arrays / tracers (searchsorted over constants, jit-safe).

A table is tied to the device kind and the model it was profiled for; `load_sps_table` refuses a
table made for another device or model with a one-line `UserError` (re-profile instead of
scheduling with somebody else's latency curve).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import math
import os
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.core.errors import UserError
from dspark_jax.core import files, host_memory
from dspark_jax.core.files import read_json_object

FORMAT = "dspark-sps-table"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class SPSTable:
    """Verify steps per second per token bucket. Hashable (usable as a static jit argument)."""

    buckets: tuple[int, ...]  # token bucket sizes, strictly ascending, >= 1
    sps: tuple[float, ...]  # steps per second of the verify step at each bucket (>= 0, finite)
    device: str = ""  # jax device kind the table was profiled on (e.g. "NVIDIA H200", "cpu")
    model: str = ""  # identity of the target model / engine configuration it was profiled for
    created: str = ""  # ISO-8601 UTC timestamp of the profiling run
    # Plain target decode steps per second for the same rows (no drafter pass; DESIGN.md 3.3b), when
    # profiled: what a step costs when the engine does not draft.
    plain_sps: float | None = None

    def __post_init__(self):
        buckets = tuple(int(b) for b in self.buckets)
        sps = tuple(float(s) for s in self.sps)
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "sps", sps)
        if not buckets:
            raise ValueError("an SPS table needs at least one bucket")
        if len(buckets) != len(sps):
            raise ValueError(f"{len(buckets)} buckets but {len(sps)} SPS values")
        if buckets[0] < 1 or any(b >= c for b, c in zip(buckets, buckets[1:])):
            raise ValueError(f"bucket sizes must be positive and strictly ascending, got {list(buckets)}")
        if any(not math.isfinite(s) or s < 0 for s in sps):
            raise ValueError(f"SPS values must be finite and >= 0, got {list(sps)}")
        if self.plain_sps is not None:
            object.__setattr__(self, "plain_sps", float(self.plain_sps))
            if not math.isfinite(self.plain_sps) or self.plain_sps <= 0:
                raise ValueError(f"plain_sps must be finite and > 0, got {self.plain_sps}")

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(buckets int32 [n], sps float32 [n]) — the form the scheduler functions take."""
        return np.asarray(self.buckets, np.int32), np.asarray(self.sps, np.float32)

    def to_json(self) -> dict[str, Any]:
        out = dict(format=FORMAT, version=VERSION, device=self.device, model=self.model, created=self.created,
                   buckets=list(self.buckets), sps=list(self.sps))
        return out if self.plain_sps is None else dict(out, plain_sps=self.plain_sps)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SPSTable:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        if obj.get("version") != VERSION:
            raise ValueError(f"unsupported version {obj.get('version')!r} (expected {VERSION})")
        return cls(buckets=tuple(obj["buckets"]), sps=tuple(obj["sps"]), device=str(obj["device"]),
                   model=str(obj["model"]), created=str(obj.get("created", "")), plain_sps=obj.get("plain_sps"))


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Static verify-batch sizes: 1, 2, 4, ... (powers of two below max_tokens), then max_tokens.

    The engine compiles its verify step for exactly these sizes and pads a round of B tokens to
    `pad_to_bucket(buckets, B)`; SPS is profiled per bucket, so the table and the padding agree.
    Typically max_tokens = max_batch * (gamma + 1) (every request verifies its anchor + gamma).
    """
    max_tokens = int(max_tokens)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, b = [], 1
    while b < max_tokens:
        out.append(b)
        b *= 2
    return tuple(out) + (max_tokens,)


def _xp(x):
    return jnp if isinstance(x, jax.Array) else np


def bucket_index(buckets, n):
    """Index of the smallest bucket >= n (== len(buckets) when n exceeds the largest bucket)."""
    xp = _xp(n)
    return xp.searchsorted(xp.asarray(buckets), n, side="left")


def pad_to_bucket(buckets, n):
    """Padded verify size for n tokens: the smallest bucket >= n (the largest one if n is beyond it;
    schedulers never produce such n since its SPS is 0)."""
    xp = _xp(n)
    b = xp.asarray(buckets)
    return b[xp.minimum(bucket_index(b, n), b.shape[0] - 1)]


def sps_lookup(buckets, sps, n):
    """SPS at n tokens = SPS of the smallest bucket >= n; 0 beyond the largest bucket.

    numpy in -> numpy out; a jax array / tracer in -> jnp (jit-safe). `n` may be any shape.
    """
    xp = _xp(n)
    b, v = xp.asarray(buckets), xp.asarray(sps, dtype=xp.float32)
    i = bucket_index(b, n)
    inside = i < b.shape[0]
    return xp.where(inside, v[xp.minimum(i, b.shape[0] - 1)], xp.float32(0))


def sps_of(table: SPSTable, n):
    """SPS of the smallest bucket >= n (0 when n is beyond the largest bucket)."""
    if isinstance(n, jax.Array):
        return sps_lookup(jnp.asarray(table.buckets, jnp.int32), jnp.asarray(table.sps, jnp.float32), n)
    return sps_lookup(np.asarray(table.buckets, np.int64), np.asarray(table.sps, np.float32), n)


# The modules whose code a round runs, besides the CPU kernels (`cpu_kernels.source_tag`).
_ROUND_MODULES = ("dspark_jax.models.decoder", "dspark_jax.drafters.dspark", "dspark_jax.engine.drafting",
                  "dspark_jax.engine.speculative")


@functools.cache
def code_tag() -> str:
    """A short hash of the decoding code a round runs: part of a cached table's key, since a table
    profiled under one version of that code misleads the scheduler under another (a change that
    makes rounds cheaper leaves the old table pricing them at the old cost)."""
    digest = hashlib.sha256()
    for name in _ROUND_MODULES:
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:8]


def device_kind() -> str:
    return jax.devices()[0].device_kind


def machine() -> dict[str, Any]:
    """What results files record about the machine they were measured on (CPU model, cores, JAX)."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "malloc": host_memory.malloc_note(), "jax": jax.__version__, "jax_backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def profile_sps(step_fn: Callable[[int], Any], buckets: Sequence[int], warmup: int = 2, repeats: int = 5, *,
                device: str | None = None, model: str = "",
                clock: Callable[[], float] = time.perf_counter) -> SPSTable:
    """Time `step_fn(bucket)` for every bucket; SPS = 1 / median seconds per call.

    `step_fn` must already be compiled for every bucket (the engine passes its jitted verify step
    on dummy inputs of that many tokens); its result is waited for with `jax.block_until_ready`
    so asynchronous dispatch does not hide the device time. `warmup` untimed calls per bucket
    absorb first-call effects. device defaults to the current jax device kind.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    buckets = tuple(int(b) for b in buckets)
    sps = []
    for b in buckets:
        for _ in range(warmup):
            jax.block_until_ready(step_fn(b))
        times = []
        for _ in range(repeats):
            t0 = clock()
            jax.block_until_ready(step_fn(b))
            times.append(clock() - t0)
        med = statistics.median(times)
        sps.append(1.0 / med if med > 0 else float("inf"))
    if any(math.isinf(s) for s in sps):  # a zero-duration fake step: cap at the fastest measurable
        finite = [s for s in sps if math.isfinite(s)]
        cap = max(finite) if finite else 1.0
        sps = [cap if math.isinf(s) else s for s in sps]
    return SPSTable(buckets, tuple(sps), device=device_kind() if device is None else device, model=model,
                    created=_now())


def save_sps_table(path: str | os.PathLike, table: SPSTable) -> None:
    """Write the table as JSON (atomically, `files.atomic_write_json`), its folder created first."""
    path = os.fspath(path)
    files.make_parent(path)
    files.atomic_write_json(path, table.to_json())


def load_sps_table(path: str | os.PathLike, *, device: str | None = None, model: str | None = None,
                   buckets: Sequence[int] | None = None) -> SPSTable:
    """Read a table saved by `save_sps_table`, checking it fits this engine.

    device / model / buckets: when given, the table must have been profiled for exactly this device
    kind, model identity and bucket list; otherwise (and for a missing or corrupt file) raise a
    one-line `UserError` that says to re-profile.
    """
    path = os.fspath(path)
    obj = read_json_object(path, "SPS table", missing="; profile the verify step first",
                           corrupt="; delete it and re-profile")
    try:
        table = SPSTable.from_json(obj)
    except (KeyError, TypeError, ValueError) as e:
        msg = str(e).replace("\n", " ") if not isinstance(e, KeyError) else f"missing field {e}"
        raise UserError(f"SPS table {path} is corrupt ({msg}); delete it and re-profile") from None
    if device is not None and table.device != device:
        raise UserError(f"SPS table {path} was profiled on device {table.device!r}, not on this "
                        f"device {device!r}; re-profile it here")
    if model is not None and table.model != model:
        raise UserError(f"SPS table {path} was profiled for model {table.model!r}, not {model!r}; "
                        "re-profile it for this model")
    if buckets is not None and tuple(int(b) for b in buckets) != table.buckets:
        raise UserError(f"SPS table {path} covers token buckets {list(table.buckets)}, but the engine uses "
                        f"{[int(b) for b in buckets]}; re-profile it for this configuration")
    return table
