"""What the processes of a multi-process command (multi-controller SPMD) tell one another.

Every process runs the same command; these helpers split work between them and move small host
values (results, counts, errors) across with JAX's own collectives
(`jax.experimental.multihost_utils`, over padded arrays), never home-made networking. With one
process (no `jax.distributed.initialize`) each is a plain local no-op, so a command calls them
unconditionally.

A collective blocks until every process reaches it, so a process must never skip one that the
others make: errors found on one process only are passed through `on_primary` / `everywhere`,
which raise the same one-line UserError on every process instead of leaving the others waiting.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from dspark_jax.core.errors import UserError

T = TypeVar("T")


def _distributed() -> bool:
    import jax

    return jax.distributed.is_initialized()


def process_count() -> int:
    """Processes in this run (1 unless `runtime.initialize` joined several); touches no device."""
    if not _distributed():
        return 1
    import jax

    return jax.process_count()


def process_index() -> int:
    if not _distributed():
        return 0
    import jax

    return jax.process_index()


def is_primary() -> bool:
    """Process 0 writes a run's files and prints its output; the others compute."""
    return process_index() == 0


def share(items: Sequence[T], index: int | None = None, count: int | None = None) -> list[T]:
    """This process's part of `items`: every count-th one from position `index` (round robin, so a
    list sorted by cost gives every process a like share). The parts of 0 .. count-1 are disjoint
    and together hold every item."""
    index = process_index() if index is None else index
    count = process_count() if count is None else count
    return list(items[index::count])


def protect_stdout() -> None:
    """In a multi-process run, keep stdout for the command's own output: native libraries print
    there (gloo announces every connection it makes: "[Gloo] Rank 0 is connected to ..."), which
    would mix with --json lines. File descriptor 1 is pointed at stderr and `sys.stdout` writes to
    a copy of the original stdout instead. A no-op with one process."""
    if process_count() == 1 or getattr(sys.stdout, "_dspark_protected", False):
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no real file descriptors (an embedding host): leave stdout as it is
        return
    stream = os.fdopen(saved, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8",
                       errors=getattr(sys.stdout, "errors", None) or "strict")
    stream._dspark_protected = True  # type: ignore[attr-defined]
    sys.stdout = stream


# ----------------------------------------------------------------------------- collectives


def _allgather(array: np.ndarray) -> np.ndarray:
    """[processes, *array.shape]: every process's `array` (same shape and dtype everywhere)."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array))


def _padded(data: bytes, size: int) -> np.ndarray:
    buf = np.zeros(max(size, 1), np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    return buf


def allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data` (any length), in process order, on every process."""
    if process_count() == 1:
        return [data]
    lengths = _allgather(np.asarray([len(data)], np.int64))[:, 0]
    out = _allgather(_padded(data, int(lengths.max())))
    return [out[i, : int(n)].tobytes() for i, n in enumerate(lengths)]


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass anything, e.g. None)."""
    if process_count() == 1:
        return data if data is not None else b""
    from jax.experimental import multihost_utils

    mine = data if is_primary() and data is not None else b""
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([len(mine)], np.int64)))[0])
    out = np.asarray(multihost_utils.broadcast_one_to_all(_padded(mine, n)))
    return out[:n].tobytes()


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def allgather_json(obj) -> list:
    """Every process's JSON-able `obj`, in process order, on every process."""
    return [json.loads(b.decode("utf-8")) for b in allgather_bytes(_dumps(obj))]


def broadcast_json(obj):
    """Process 0's JSON-able `obj` on every process."""
    return json.loads(broadcast_bytes(_dumps(obj) if is_primary() else None).decode("utf-8"))


def on_primary(fn: Callable[[], Any]):
    """Run `fn` (returning something JSON-able) on process 0 only and hand its result to every
    process: what only process 0 may do, such as reading the results file it will write. A
    UserError there is raised on every process."""
    if process_count() == 1:
        return fn()
    value = error = None
    if is_primary():
        try:
            value = fn()
        except UserError as e:
            error = str(e)
    message = broadcast_json({"value": value, "error": error})
    if message["error"] is not None:
        raise UserError(message["error"])
    return value if is_primary() else message["value"]


def everywhere(fn: Callable[[], T]) -> T:
    """Run `fn` on every process; if it raises a UserError on any, raise it on all (the first
    failing process's message, named by process where it is another's)."""
    if process_count() == 1:
        return fn()
    value, error = None, None
    try:
        value = fn()
    except UserError as e:
        error = str(e)
    errors = allgather_json(error)
    for i, e in enumerate(errors):
        if e is not None:
            raise UserError(e if i == process_index() else f"process {i}: {e}")
    return value


def barrier(name: str) -> None:
    """Wait until every process gets here."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
