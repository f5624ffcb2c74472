"""core.host_memory: with freed memory kept, an XLA:CPU program's temporaries are not faulted in again
on every execution (counted in page faults, in fresh processes, since malloc is set process-wide)."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc and /proc/self/stat only")

PROBE = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from dspark_jax.core import cli, host_memory

    @cli.run_cli
    def main(argv):  # the way every command starts: run_cli sets malloc before the backend starts
        f = jax.jit(lambda x, w: jax.nn.log_softmax(x @ w, axis=-1).sum())  # ~100 MB of temporaries
        x, w = jnp.ones((512, 64)), jnp.full((64, 49152), 0.01)
        for _ in range(6):  # the heap settles: a temporary now and then still lands past a fragment
            f(x, w).block_until_ready()
        faults = lambda: int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
        before = faults()
        for _ in range(10):
            f(x, w).block_until_ready()
        print(host_memory.applied(), (faults() - before) / 10)
        return 0

    sys.exit(main([]))
""")


def run_probe(**env) -> tuple[bool, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", **env}).stdout.split()
    return out[0] == "True", float(out[1])


def test_kept_memory_is_not_faulted_in_again():
    kept, kept_faults = run_probe(DSPARK_MALLOC="keep")
    system, system_faults = run_probe(DSPARK_MALLOC="system")
    assert kept and not system
    # ~100 MB of temporaries: ~25k pages faulted in per execution with glibc's defaults
    assert system_faults > 10_000
    assert kept_faults < system_faults / 4, (kept_faults, system_faults)
