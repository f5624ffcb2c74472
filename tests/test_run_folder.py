"""A run folder belongs to one run: fresh / --resume / --overwrite, what a resume may change, the
metrics log cut back to the restored step, and training killed at arbitrary moments (SIGKILL, also
in the middle of an orbax save) then resumed ends exactly where an uninterrupted run does."""

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml
from cli_helpers import assert_one_line_error, run_main
from test_training import params_of, tiny_config, tiny_target, write_tiny_data

from dspark_jax import train
from dspark_jax.core.errors import UserError
from dspark_jax.training.trainer import Trainer, jsonable_config

TIMING = ("blocks_per_s",)  # the only fields of a metrics record that depend on the clock


def log_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def snapshot(folder) -> dict:
    """Every file under folder -> its content hash (to show that nothing was touched)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def with_out_dir(cfg, out_dir):
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(out_dir)))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted in-process run (6 steps, checkpoints at 3 and 6): (config, final params)."""
    cfg = tiny_config(tmp_path_factory.mktemp("finished"))
    trainer = Trainer(cfg, tiny_target())
    params = params_of(trainer.fit(progress=False))
    trainer.close()
    return cfg, params


@pytest.fixture
def used(finished, tmp_path):
    """A copy of the finished run's folder in tmp_path/run, and its config pointed there."""
    cfg, _ = finished
    shutil.copytree(cfg.run.out_dir, tmp_path / "run")
    return with_out_dir(cfg, tmp_path / "run")


def write_yaml(path, cfg, **sections) -> str:
    raw = jsonable_config(cfg)
    for section, values in sections.items():
        raw[section] = {**raw[section], **values} if isinstance(raw[section], dict) else values
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    return str(path)


@pytest.fixture
def tiny_load_target(monkeypatch):
    """train.main with the test's tiny target whatever the config names."""
    monkeypatch.setattr("dspark_jax.checkpoints.registry.load_target", lambda name: tiny_target())


def test_a_fresh_run_refuses_a_used_folder(used, tmp_path, capsys, tiny_load_target):
    before = snapshot(used.run.out_dir)
    config = write_yaml(tmp_path / "run.yaml", used)
    assert_one_line_error(train.main, capsys, "is not empty", "--config", config, "--no-progress")
    assert_one_line_error(train.main, capsys, "pass one of them", "--config", config, "--resume", "--overwrite")
    with pytest.raises(UserError, match="--resume to continue its run, --overwrite to replace it"):
        Trainer(used, tiny_target()).fit(progress=False)
    assert snapshot(used.run.out_dir) == before  # nothing overwritten, nothing added


def test_overwrite_replaces_the_run_and_only_the_run(used, tmp_path, capsys, tiny_load_target):
    out = used.run.out_dir
    with open(os.path.join(out, "notes.txt"), "w") as f:  # not the run's: stays
        f.write("mine")
    # another drafter and 4 steps: with the old checkpoints (at 3 and 6) still there, orbax would skip
    # saving steps 3 and 4 and a resume would restore the old run's step 6
    config = write_yaml(tmp_path / "run.yaml", used, drafter={"markov_rank": 4}, optim={"steps": 4})
    code, _, err = run_main(train.main, capsys, "--config", config, "--no-progress", "--overwrite")
    assert code == 0, err
    assert sorted(os.listdir(out)) == ["checkpoints", "drafter", "metrics.jsonl", "notes.txt", "run.json"]
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)["config"]["drafter"]["markov_rank"] == 4
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "4"]
    with open(os.path.join(out, "checkpoints", "4", "config", "metadata")) as f:
        assert json.load(f)["drafter"]["markov_rank"] == 4
    assert [r["step"] for r in log_of(out)] == [1, 2, 3, 4]
    with open(os.path.join(out, "drafter", "drafter.json")) as f:
        assert json.load(f)["metadata"]["steps"] == 4

    # without a run.json, anything a run does not write makes it not a run folder
    os.rename(os.path.join(out, "run.json"), tmp_path / "run.json")
    before = snapshot(out)
    assert_one_line_error(train.main, capsys, "does not look like a run folder (no run.json; it holds notes.txt)",
                          "--config", config, "--overwrite")
    assert_one_line_error(train.main, capsys, "holds no run", "--config", config, "--resume")
    os.rename(tmp_path / "run.json", os.path.join(out, "run.json"))
    os.makedirs(os.path.join(out, "checkpoints", "mine"))  # never removes what orbax did not write
    assert_one_line_error(train.main, capsys, "holds more than checkpoints (mine)", "--config", config, "--overwrite")
    os.rmdir(os.path.join(out, "checkpoints", "mine"))
    assert {k: v for k, v in snapshot(out).items() if k != "run.json"} == before


def test_export_latest_writes_the_latest_checkpoints_drafter(used, finished, tmp_path, capsys, tiny_load_target):
    from dspark_jax.drafters.checkpoint import load_drafter

    out = used.run.out_dir
    config = write_yaml(tmp_path / "run.yaml", used)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))  # a run stopped after its step-3 save
    before = snapshot(out)
    code, stdout, err = run_main(train.main, capsys, "--config", config, "--export-latest")
    assert code == 0, err
    assert "drafter-step-3" in stdout
    assert {k: v for k, v in snapshot(out).items() if not k.startswith("drafter-step-3/")} == before  # run untouched
    at_3 = load_drafter(os.path.join(out, "drafter-step-3"))
    assert at_3.metadata["steps"] == 3
    restored = Trainer(used, tiny_target(), progress=False)
    want = params_of(restored.latest_state())
    restored.close()
    jax.tree.map(np.testing.assert_array_equal, at_3.params, want)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(at_3.params), jax.tree.leaves(finished[1])))

    # the run goes on beside its exported drafter, and ends where an uninterrupted one does
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")
    assert code == 0, err
    jax.tree.map(np.testing.assert_array_equal, load_drafter(os.path.join(out, "drafter")).params, finished[1])
    assert_one_line_error(train.main, capsys, "drafter.markov_rank (", "--config", config, "--export-latest",
                          "drafter.markov_rank=4")
    assert_one_line_error(train.main, capsys, "takes no --resume", "--config", config, "--export-latest", "--resume")
    empty = write_yaml(tmp_path / "empty.yaml", with_out_dir(used, tmp_path / "empty"))
    os.makedirs(tmp_path / "empty")
    assert_one_line_error(train.main, capsys, "no checkpoint to export", "--config", empty, "--export-latest")


def test_resuming_a_finished_run_keeps_the_drafter_calibrated_in_place(used, tmp_path, capsys, tiny_load_target):
    from dspark_jax.drafters.checkpoint import load_drafter, save_drafter

    config = write_yaml(tmp_path / "run.yaml", used)
    drafter = os.path.join(used.run.out_dir, "drafter")
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")
    assert code == 0, err
    exported = load_drafter(drafter)
    assert exported.metadata["steps"] == 6 and not exported.sts_by_temperature
    sts = [1.5] * exported.config.block_size
    save_drafter(drafter, exported.config, exported.params, sts_temperatures=sts, sts_by_temperature={0.0: sts},
                 metadata=exported.metadata)  # what `calibrate` without --save-to does
    calibrated = snapshot(drafter)
    code, stdout, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")
    assert code == 0, err
    assert "is already step 6's: kept as it is" in stdout
    assert snapshot(drafter) == calibrated

    # a drafter exported at another step (or half there) is replaced by the run's own
    save_drafter(drafter, exported.config, exported.params, sts_by_temperature={0.0: sts}, metadata={"steps": 3})
    code, stdout, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")
    assert code == 0, err
    assert "drafter written to" in stdout
    replaced = load_drafter(drafter)
    assert replaced.metadata["steps"] == 6 and not replaced.sts_by_temperature
    os.remove(os.path.join(drafter, "drafter.safetensors"))
    code, stdout, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")
    assert code == 0, err
    jax.tree.map(np.testing.assert_array_equal, load_drafter(drafter).params, exported.params)


def test_a_run_folder_in_use_by_another_process_is_refused(used, tmp_path, capsys, tiny_load_target):
    config = write_yaml(tmp_path / "run.yaml", used)
    holder = subprocess.Popen(  # another process holding the folder, as a live `train --resume` does
        [sys.executable, "-c", "import sys; from dspark_jax.core import files\n"
         f"with files.folder_lock({str(used.run.out_dir)!r}, 'busy'):\n print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(used.run.out_dir)
        assert_one_line_error(train.main, capsys, "is in use by another training process", "--config", config,
                              "--resume", "--no-progress")
        assert snapshot(used.run.out_dir) == before
    finally:
        holder.stdin.close()
        holder.wait()
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")  # released at its exit
    assert code == 0, err
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "--no-progress")  # and at ours
    assert code == 0, err


@pytest.mark.parametrize("override, key", [("drafter.markov_rank=4", "drafter.markov_rank"),
                                           ("data.seq_len=80", "data.seq_len"), ("loss.decay=2.0", "loss.decay"),
                                           ("optim.lr=1e-3", "optim.lr"), ("target=other", "target")])
def test_resume_with_another_config_is_refused(used, tmp_path, capsys, override, key):
    before = snapshot(used.run.out_dir)
    config = write_yaml(tmp_path / "run.yaml", used)
    assert_one_line_error(train.main, capsys, f"{key} (", "--config", config, "--resume", override,
                          "--allow-schedule-change")
    assert snapshot(used.run.out_dir) == before


def test_a_schedule_change_needs_the_flag_and_is_recorded(used, finished, tmp_path, capsys, tiny_load_target):
    out = used.run.out_dir
    config = write_yaml(tmp_path / "run.yaml", used)
    assert_one_line_error(train.main, capsys, "optim.steps (6 -> 8); pass --allow-schedule-change", "--config",
                          config, "--resume", "optim.steps=8")
    assert not os.path.exists(os.path.join(out, "resumes.jsonl"))
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "optim.steps=8", "run.log_every=2",
                            "--allow-schedule-change", "--no-progress")
    assert code == 0, err
    assert "optim.steps (6 -> 8): the learning rate at step 6 goes from 0 to" in err  # the cosine had reached 0
    with open(os.path.join(out, "resumes.jsonl")) as f:
        (record,) = [json.loads(line) for line in f]
    assert record["step"] == 6 and record["changes"] == {"optim.steps": [6, 8], "run.log_every": [1, 2]}
    assert record["lr_at_step"][0] == 0.0 < record["lr_at_step"][1]
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)["config"]["optim"]["steps"] == 8  # the run's schedule from now on
    assert [r["step"] for r in log_of(out)] == [1, 2, 3, 4, 5, 6, 8]
    # resuming with the new schedule is a plain resume; going back below the reached step is not
    code, _, err = run_main(train.main, capsys, "--config", config, "--resume", "optim.steps=8", "run.log_every=2",
                            "--no-progress")
    assert code == 0, err
    assert_one_line_error(train.main, capsys, "optim.steps=6 is below step 8", "--config", config, "--resume",
                          "run.log_every=2", "--allow-schedule-change")


def test_a_resumed_log_is_the_uninterrupted_log(finished, tmp_path):
    """Killed in the middle of the save at step 5, after its record was logged: the resume restores
    step 3 and its log must not hold steps 4-5 twice (nor the torn line the kill left)."""
    straight, full = finished
    cfg = with_out_dir(straight, tmp_path / "run")
    first = Trainer(cfg, tiny_target())
    first.fit(stop_after=5, progress=False)  # checkpoints at 3 and 5, records 1..5
    first.close()
    checkpoints = os.path.join(cfg.run.out_dir, "checkpoints")
    # what a kill during the save of step 5 leaves: its orbax temporary folder, not yet renamed
    os.rename(os.path.join(checkpoints, "5"), os.path.join(checkpoints, "5.orbax-checkpoint-tmp"))
    with open(os.path.join(cfg.run.out_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 6, "loss": 1.2')
    second = Trainer(cfg, tiny_target())
    resumed = second.fit(resume=True, progress=False)
    second.close()
    assert log_of(cfg.run.out_dir) == log_of(straight.run.out_dir)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(params_of(resumed))):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(checkpoints)) == ["3", "6"]  # the temporary folder is gone
    with open(os.path.join(cfg.run.out_dir, "resumes.jsonl")) as f:
        record = json.loads(f.read())
    assert record["step"] == 3 and record["dropped_log_lines"] == 3 and record["changes"] == {}


# ---- SIGKILL at arbitrary moments: the CLI in a subprocess, resumed until it finishes ----

STEPS = 12


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, tiny_target_folder):
    """The YAML config of a 12-step CLI run on the tiny Llama (checkpoints every 3 steps, an eval at
    6 and 12) and the folder of its uninterrupted run."""
    base = tmp_path_factory.mktemp("cli-run")
    write_tiny_data(str(base / "data"))
    write_tiny_data(str(base / "eval"), n=8, seed=1)
    raw = dict(target=tiny_target_folder,
               drafter=dict(kind="dspark", num_layers=1, block_size=4, head="markov", markov_rank=8,
                            confidence=True, mask_token_id=0, target_layer_ids=[0, 1]),
               loss=dict(decay=4.0),
               data=dict(train_dir=str(base / "data"), eval_dir=str(base / "eval"), rows=2, seq_len=64,
                         blocks_per_row=8, anchors_per_seq=4),
               optim=dict(lr=3e-3, steps=STEPS, warmup_frac=0.1),
               run=dict(out_dir=str(base / "straight"), log_every=1, save_every=3, eval_every=6, eval_batches=1,
                        compute_dtype="float32", mesh=[1, 1, 1]))
    config = str(base / "run.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    t0 = time.monotonic()
    proc = subprocess.run(train_command(config), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return config, str(base / "straight"), time.monotonic() - t0


def subprocess_env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1"}


def train_command(config, *extra) -> list[str]:
    return [sys.executable, "-m", "dspark_jax.train", "--config", config, "--no-progress", *extra]


def last_logged_step(out) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = [line for line in f.read().split("\n")[:-1] if line]
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def during_save(step):
    """Kill as soon as orbax's temporary folder of `step` appears (made by this process)."""
    def when(out, started):
        tmp = os.path.join(out, "checkpoints", f"{step}.orbax-checkpoint-tmp")
        try:
            return os.stat(tmp).st_ctime >= started - 1
        except FileNotFoundError:
            return False
    when.save_step = step
    return when


def after_logged(step):
    return lambda out, started: last_logged_step(out) >= step


def after_seconds(seconds):
    return lambda out, started: time.time() - started >= seconds


def kill_when(config, out, when, extra, log) -> dict:
    """Run the CLI (`extra` flags), SIGKILL it the moment `when(out, start time)` holds; what happened."""
    started = time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen(train_command(config, f"run.out_dir={out}", *extra), env=subprocess_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        killed = False
        while proc.poll() is None:
            if when(out, started):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.001)
        code = proc.wait(timeout=600)
    if not killed:
        assert code == 0, open(log).read()
    result = {"killed": killed, "logged": last_logged_step(out)}
    if killed and hasattr(when, "save_step"):  # still mid-save when the kill landed?
        ck = os.path.join(out, "checkpoints")
        result["mid_save"] = (os.path.isdir(os.path.join(ck, f"{when.save_step}.orbax-checkpoint-tmp"))
                              and not os.path.exists(os.path.join(ck, str(when.save_step))))
    return result


def assert_same_run(out, straight):
    from safetensors.numpy import load_file

    a, b = (load_file(os.path.join(d, "drafter", "drafter.safetensors")) for d in (straight, out))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k  # bit for bit
    assert log_of(out) == log_of(straight)
    assert not any("tmp" in n for n in os.listdir(os.path.join(out, "checkpoints")))


def killed_and_resumed(cli_run, tmp_path, kill_points) -> list[dict]:
    config, straight, _ = cli_run
    out = str(tmp_path / "killed")
    events = []
    for i, when in enumerate(kill_points):  # the first start is a fresh run, the others resume
        events.append(kill_when(config, out, when, ["--resume"] if i else [], tmp_path / f"attempt-{i}.txt"))
    proc = subprocess.run(train_command(config, f"run.out_dir={out}", "--resume"), env=subprocess_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert_same_run(out, straight)
    print("kill points:", events)
    return events


def test_killed_during_a_save_then_resumed_is_the_uninterrupted_run(cli_run, tmp_path):
    # the save of step 6 runs in the background while steps 7.. go on and are logged: the resume
    # restores step 3 (orbax ignores the unfinished folder) and cuts the log back to it
    (event,) = killed_and_resumed(cli_run, tmp_path, [during_save(6)])
    assert event["killed"] and event["logged"] >= 6  # records 4..6 are logged before the save of 6 starts


@pytest.mark.slow
def test_killed_at_many_moments_then_resumed_is_the_uninterrupted_run(cli_run, tmp_path):
    _, _, seconds = cli_run
    rng = np.random.default_rng(18)
    moments = [after_seconds(float(t)) for t in rng.uniform(0.0, seconds, size=4)]  # startup, steps, export
    events = killed_and_resumed(cli_run, tmp_path, [during_save(3), after_logged(5), during_save(9),
                                                    during_save(12), *moments])
    assert all(e["killed"] for e in events[:4]), events
    assert any(e.get("mid_save") for e in events), events  # at least one kill landed in the middle of a save
