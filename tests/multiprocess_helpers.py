"""Run a command as a multi-process JAX program on this machine (CPU devices, gloo collectives).

`run_processes(args, num_processes=2, devices_per_process=2)` starts `num_processes` copies of a
command, each with `devices_per_process` CPU devices and the flags that join them into one JAX
program (`--coordinator-address 127.0.0.1:<free port> --num-processes N --process-id I`, see
`dspark_jax.distributed.runtime`), and returns each one's (returncode, stdout, stderr), in process
order. `run_single(args, devices=4)` runs the same command as one process with all the devices,
for comparison. `args` is a module and its arguments (`["dspark_jax.train", "--config", ...]`,
run as `python -m ...`), a script (`["path/to/script.py", ...]`) or `["-c", code, ...]`; or, for
`run_processes`, a function process_id -> such a list. Nothing hangs: when the time is up, or one
process fails (the others would wait for it at their next collective), every process still running
is killed after a short grace period.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Sequence

GRACE_S = 5.0  # after one process fails, how long the others may go on (to print their own errors)
DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


class ProcessResult(NamedTuple):
    returncode: int  # negative: killed by that signal (-9 after a timeout or another process's failure)
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int, env: dict | None = None) -> dict:
    """The environment of one process: CPU only, `devices` devices, no inherited multi-process
    settings (the flags say it), no progress bars; `env` on top."""
    out = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    # the test session's own device count (tests/conftest.py) must not override this process's
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", out.get("XLA_FLAGS", "")).strip()
    out.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), TQDM_DISABLE="1", XLA_FLAGS=flags)
    if not flags:
        del out["XLA_FLAGS"]
    out.update(env or {})
    return out


def command(args: Sequence[str]) -> list[str]:
    args = [str(a) for a in args]
    if not args:
        raise ValueError("no command given")
    if args[0] == "-c" or args[0].endswith(".py"):
        return [sys.executable, *args]
    return [sys.executable, "-m", *args]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: whatever it started goes too
        except ProcessLookupError:
            pass
    proc.wait()


def _run(commands: list[list[str]], envs: list[dict], timeout: float, cwd: str | None) -> list[ProcessResult]:
    with tempfile.TemporaryDirectory(prefix="multiprocess-") as tmp:
        procs, files = [], []
        try:
            for i, (cmd, env) in enumerate(zip(commands, envs)):
                out = open(os.path.join(tmp, f"{i}.out"), "w+")
                err = open(os.path.join(tmp, f"{i}.err"), "w+")
                files.append((out, err))
                procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
            deadline = time.monotonic() + timeout
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill(p)
        results = []
        for p, (out, err) in zip(procs, files):
            out.seek(0), err.seek(0)
            results.append(ProcessResult(p.returncode, out.read(), err.read()))
            out.close(), err.close()
        return results


def run_processes(args: Sequence[str] | Callable[[int], Sequence[str]], num_processes: int = 2,
                  devices_per_process: int = 2, timeout: float = 300, env: dict | None = None,
                  cwd: str | None = None) -> list[ProcessResult]:
    """Run `args` as one JAX program of `num_processes` processes (see the module docstring)."""
    port = free_port()
    argv = args if callable(args) else (lambda _: args)
    commands = [command(argv(i)) + ["--coordinator-address", f"127.0.0.1:{port}",
                                    "--num-processes", str(num_processes), "--process-id", str(i)]
                for i in range(num_processes)]
    return _run(commands, [process_env(devices_per_process, env)] * num_processes, timeout, cwd)


def run_single(args: Sequence[str], devices: int = 4, timeout: float = 300, env: dict | None = None,
               cwd: str | None = None) -> ProcessResult:
    """Run `args` as one process with `devices` CPU devices (no multi-process flags)."""
    return _run([command(args)], [process_env(devices, env)], timeout, cwd)[0]


def describe(results: ProcessResult | Sequence[ProcessResult], tail: int = 3000) -> str:
    """What each process returned and the end of its stderr (for assertion messages)."""
    results = [results] if isinstance(results, ProcessResult) else list(results)
    return "\n".join(f"--- process {i}: returncode {r.returncode}\n{r.stderr[-tail:]}" for i, r in enumerate(results))


def check(results: ProcessResult | Sequence[ProcessResult]):
    """`results`, after asserting that every process exited with 0."""
    many = [results] if isinstance(results, ProcessResult) else list(results)
    assert all(r.returncode == 0 for r in many), describe(many)
    return results
