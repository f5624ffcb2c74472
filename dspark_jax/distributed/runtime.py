"""Joining a multi-process JAX program (multi-controller SPMD): the flags every command takes.

Every command runs the same program on each process; `jax.distributed.initialize` connects them so
that `jax.devices()` lists every process's devices and one mesh spans them all. Explicit flags win,
then the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), and
`--distributed` alone lets JAX detect the cluster (Cloud TPU, SLURM, Open MPI, ...). On CPU the
cross-process collectives are gloo's (JAX's own), which is how the tests run 2 processes on one
machine.
"""

from __future__ import annotations

import argparse
import os

from dspark_jax.core.errors import UserError

ENVIRONMENT = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address; every process passes the same (env JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="how many processes run this command (env JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process's index, 0 .. N-1 (env JAX_PROCESS_ID)")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-process run, detecting the cluster (Cloud TPU, SLURM, ...) where flags are absent")


def distributed_settings(args: argparse.Namespace) -> dict | None:
    """The keyword arguments for `jax.distributed.initialize`, or None for a single-process run."""
    given = {}
    for key, env in ENVIRONMENT.items():
        value = getattr(args, key, None)
        if value is None and os.environ.get(env):
            value = os.environ[env]
            if key != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    raise UserError(f"{env}={value!r} is not an integer") from None
        if value is not None:
            given[key] = value
    if not given and not getattr(args, "distributed", False):
        return None
    n, i = given.get("num_processes"), given.get("process_id")
    if n is not None and n < 1:
        raise UserError(f"--num-processes must be at least 1, got {n}")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        raise UserError(f"--process-id must be in 0 .. {'N-1' if n is None else n - 1}, got {i}")
    if not getattr(args, "distributed", False) and len(given) < 3 and given.get("num_processes") != 1:
        missing = [f"--{k.replace('_', '-')}" for k in ENVIRONMENT if k not in given]
        raise UserError(f"a multi-process run needs {', '.join(missing)} too (or --distributed to detect "
                        "them on a cluster)")
    return given


def initialize(args: argparse.Namespace) -> None:
    """Join the multi-process run the flags / environment describe; a no-op for one process."""
    settings = distributed_settings(args)
    if settings is None or settings.get("num_processes") == 1:
        return
    import jax

    # CPU devices of different processes only talk through a collectives library (accelerators
    # ignore this setting)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**settings)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not join the multi-process run ({first})") from None
    from dspark_jax.distributed.gather import protect_stdout

    protect_stdout()  # gloo announces its connections on stdout; keep stdout for the command's output
