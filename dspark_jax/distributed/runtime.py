"""Joining a multi-process JAX program (multi-controller SPMD): the flags every command takes.

Every command runs the same program on each process; `jax.distributed.initialize` connects them so
that `jax.devices()` lists every process's devices and one mesh spans them all. Explicit flags win,
then the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), and
`--distributed` alone lets JAX detect the cluster (Cloud TPU, SLURM, Open MPI, ...). On CPU the
cross-process collectives are gloo's (JAX's own), which is how the tests run 2 processes on one
machine.
"""

from __future__ import annotations

import dataclasses
import os

from dspark_jax.core.config_checks import setting, validate
from dspark_jax.core.errors import UserError

ENVIRONMENT = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


@dataclasses.dataclass(frozen=True)
class ProcessSettings:
    """How this process joins a multi-process run (the flags every command takes; `None`: from the
    environment, else a single-process run)."""

    coordinator_address: str | None = setting(
        None, doc="process 0's address; every process passes the same (env JAX_COORDINATOR_ADDRESS)",
        metavar="HOST:PORT")
    num_processes: int | None = setting(None, doc="how many processes run this command (env JAX_NUM_PROCESSES)",
                                        metavar="N")
    process_id: int | None = setting(None, doc="this process's index, 0 .. N-1 (env JAX_PROCESS_ID)", metavar="I")
    distributed: bool = setting(
        False, doc="join a multi-process run, detecting the cluster (Cloud TPU, SLURM, ...) where flags are absent")

    FLAG_GROUP = "multi-process (jax.distributed)"  # for `core.cli.add_settings`

    def __post_init__(self):
        validate(self)


def distributed_settings(settings: ProcessSettings) -> dict | None:
    """The keyword arguments for `jax.distributed.initialize`, or None for a single-process run."""
    given = {}
    for key, env in ENVIRONMENT.items():
        value = getattr(settings, key)
        if value is None and os.environ.get(env):
            value = os.environ[env]
            if key != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    raise UserError(f"{env}={value!r} is not an integer") from None
        if value is not None:
            given[key] = value
    if not given and not settings.distributed:
        return None
    n, i = given.get("num_processes"), given.get("process_id")
    if n is not None and n < 1:
        raise UserError(f"--num-processes must be at least 1, got {n}")
    if i is not None and (i < 0 or (n is not None and i >= n)):
        raise UserError(f"--process-id must be in 0 .. {'N-1' if n is None else n - 1}, got {i}")
    if not settings.distributed and len(given) < 3 and given.get("num_processes") != 1:
        missing = [f"--{k.replace('_', '-')}" for k in ENVIRONMENT if k not in given]
        raise UserError(f"a multi-process run needs {', '.join(missing)} too (or --distributed to detect "
                        "them on a cluster)")
    return given


def initialize(settings: ProcessSettings) -> None:
    """Join the multi-process run the flags / environment describe; a no-op for one process."""
    given = distributed_settings(settings)
    if given is None or given.get("num_processes") == 1:
        return
    import jax

    # CPU devices of different processes only talk through a collectives library (accelerators
    # ignore this setting)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(**given)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"could not join the multi-process run ({first})") from None
    from dspark_jax.distributed.gather import protect_stdout

    protect_stdout()  # gloo announces its connections on stdout; keep stdout for the command's output
