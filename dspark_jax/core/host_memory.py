"""Host memory: keep the memory of XLA:CPU's temporaries mapped from one execution to the next.

Every execution of a compiled XLA:CPU program allocates its temporaries (a training step's logits over
the vocabulary, a datagen step's caches) and frees them when it ends. glibc's malloc serves a large
request with a fresh `mmap` (above its mmap threshold, and always when a worker thread's own arena
cannot hold it) and unmaps it on `free`, so the next execution faults every page in again and the
kernel zeroes each one: the recipe's training step re-faulted ~3.5 GB per step, ~25% of its busy CPU time
in the kernel (docs/results.md section 14). `keep_freed_memory` tells glibc to serve every thread
from the one main heap, never to mmap, never to give the heap's top back, so freed temporaries are
reused as they are. The price is a resident set that stays at its peak, which a step reaches
anyway. Applied by every `python -m dspark_jax.<command>` before the backend starts; a library user
calls it first thing; `DSPARK_MALLOC=system` leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
ENV = "DSPARK_MALLOC"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc malloc to keep freed memory (see above). Returns whether it is set; a no-op on other
    C libraries, with DSPARK_MALLOC=system, and after the first call. Call it before JAX starts
    its worker threads (before the first computation): a thread that has its own arena keeps it."""
    global _applied
    if _applied is None:
        _applied = False
        if os.environ.get(ENV, "keep") != "system" and platform.libc_ver()[0] == "glibc":
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            # -1 as the trim threshold: never trim (mallopt(3)); 0 mmaps: the heap serves everything
            _applied = all(mallopt(param, value) == 1
                           for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))
    return _applied


def applied() -> bool:
    """Whether `keep_freed_memory` has set this process's malloc (timings depend on it)."""
    return bool(_applied)


def malloc_note() -> str:
    """How this process's malloc is set, for results files."""
    return "glibc, freed memory kept (host_memory)" if applied() else "system default"
