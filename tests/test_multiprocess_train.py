"""Training as a multi-process JAX program, on this machine: 2 processes x 2 CPU devices train the
same run as 1 process x 4 devices (same global batches, same losses), a run resumes on another
number of processes with the same continuation, and the processes' rows of a step are disjoint and
together the global batch. Every run is `python -m dspark_jax.train` in subprocesses
(tests/multiprocess_helpers.py)."""

import json
import os

import numpy as np
import pytest
import yaml
from multiprocess_helpers import check, run_processes, run_single
from test_training import write_tiny_data

STEPS = 6
TIMEOUT = 480  # seconds per launch (2 shared CPU cores: a launch takes ~20-30 s alone)
TIMING = ("blocks_per_s",)  # the only fields of a metrics record that depend on the clock
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train.main, stopped after N more steps as a kill after the checkpoint of step start + N would
# (`Trainer.fit(stop_after=N)`; that last step is always saved), then the drafter as usual
STOPPED_AFTER = """
import sys
from dspark_jax import train
from dspark_jax.training.trainer import Trainer
fit = Trainer.fit
Trainer.fit = lambda self, **kw: fit(self, stop_after=int(sys.argv[1]), **kw)
sys.exit(train.main(sys.argv[2:]))
"""

# Per process: the first 3 global batches of the train stream, this process's rows of each, and the
# global arrays those rows assemble into (gathered back to the host), in npz files under argv[2].
ROWS = """
import sys, numpy as np
from dspark_jax import train
from dspark_jax.core.cli import ArgumentParser, add_settings, settings_from
from dspark_jax.distributed import runtime
p = ArgumentParser(); p.add_argument("config"); p.add_argument("out"); add_settings(p, runtime.ProcessSettings)
args = p.parse_args(sys.argv[1:])
runtime.initialize(settings_from(runtime.ProcessSettings, args))
import jax
from jax.experimental import multihost_utils
from dspark_jax.checkpoints.registry import load_target
from dspark_jax.training.config import load_config
from dspark_jax.training.trainer import Trainer
cfg = load_config(args.config)
trainer = Trainer(cfg, load_target(cfg.target))
out = {}
for step in range(3):
    batch = next(trainer.data)
    local = trainer.local_batch(batch)
    device = trainer.device_batch(trainer.host_batch(local), rows=trainer.batch_rows)
    out[f"global_{step}"] = batch["token_index"]
    out[f"local_{step}"] = local["token_index"]
    out[f"assembled_{step}"] = np.asarray(multihost_utils.process_allgather(device["tokens"], tiled=True))
np.savez(f"{args.out}/{jax.process_index()}.npz", **out)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target_folder):
    """The config of a 6-step run on the tiny Llama (4 rows x 2 micro-batches per step, so each of
    the 4 devices holds 2 rows; checkpoints every 3 steps; an eval at the end) and the folder of its
    uninterrupted 1-process x 4-device run."""
    base = tmp_path_factory.mktemp("multiprocess-train")
    write_tiny_data(str(base / "data"))
    write_tiny_data(str(base / "eval"), n=8, seed=1)
    raw = dict(target=tiny_target_folder,
               drafter=dict(kind="dspark", num_layers=1, block_size=4, head="markov", markov_rank=8,
                            confidence=True, mask_token_id=0, target_layer_ids=[0, 1]),
               loss=dict(decay=4.0),
               data=dict(train_dir=str(base / "data"), eval_dir=str(base / "eval"), rows=4, seq_len=64,
                         blocks_per_row=8, anchors_per_seq=4),
               optim=dict(lr=3e-3, steps=STEPS, warmup_frac=0.1, grad_accum=2),
               run=dict(out_dir=str(base / "one-process"), log_every=1, save_every=3, eval_every=STEPS,
                        eval_batches=1, compute_dtype="float32", mesh=[-1, 1, 1]))
    config = str(base / "run.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    check(run_single(train(config), devices=4, timeout=TIMEOUT, cwd=REPO))
    return config, str(base / "one-process")


def train(config, *extra) -> list[str]:
    return ["dspark_jax.train", "--config", config, "--no-progress", *extra]


def stopped_after(steps, config, *extra) -> list[str]:
    return ["-c", STOPPED_AFTER, str(steps), *train(config, *extra)[1:]]


def log_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def assert_same_log(got, want):
    """The same records (steps, fields), every number equal to float tolerance."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b), a["step"]
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=f"step {b['step']}: {k}")


def assert_same_drafter(got_dir, want_dir):
    from safetensors.numpy import load_file

    a, b = (load_file(os.path.join(d, "drafter", "drafter.safetensors")) for d in (got_dir, want_dir))
    assert sorted(a) == sorted(b)
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_two_processes_train_the_one_process_run(setup, tmp_path):
    config, one = setup
    out = str(tmp_path / "two-processes")
    results = check(run_processes(train(config, f"run.out_dir={out}"), num_processes=2, devices_per_process=2,
                                  timeout=TIMEOUT, cwd=REPO))
    assert_same_log(log_of(out), log_of(one))  # per-step losses (and every other metric) of 1 x 4 devices
    assert "eval_loss" in log_of(out)[-1]
    assert_same_drafter(out, one)
    assert sorted(os.listdir(out)) == ["checkpoints", "drafter", "metrics.jsonl", "run.json"]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "6"]
    # process 0 writes the run's files and says so; process 1 only computes
    assert "drafter written to" in results[0].stdout and "drafter written" not in results[1].stdout


@pytest.mark.slow  # ~1 min; the default suite keeps the two-process == one-process run above
def test_a_run_resumes_on_another_number_of_processes(setup, tmp_path):
    """2 processes to step 2, 1 process (4 devices) to step 4, 2 processes to the end: the
    uninterrupted run's log and drafter (the data position is the global stream's, saved once)."""
    config, one = setup
    out = str(tmp_path / "resumed")
    where = f"run.out_dir={out}"
    check(run_processes(stopped_after(2, config, where), num_processes=2, devices_per_process=2, timeout=TIMEOUT,
                        cwd=REPO))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["2"]
    check(run_single(stopped_after(2, config, where, "--resume"), devices=4, timeout=TIMEOUT, cwd=REPO))  # 2 -> 1
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "4"]  # run.keep_checkpoints=2
    check(run_processes(train(config, where, "--resume"), num_processes=2, devices_per_process=2,  # 1 -> 2
                        timeout=TIMEOUT, cwd=REPO))
    assert_same_log(log_of(out), log_of(one))
    assert_same_drafter(out, one)
    with open(os.path.join(out, "resumes.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [2, 4]


def test_the_processes_rows_are_disjoint_and_together_the_global_batch(setup, tmp_path):
    """Each process keeps its devices' rows (process 0 rows 0-3, process 1 rows 4-7 of 8) of the
    same global batch, which is the 1-process stream's; assembled, they are that global batch."""
    config, _ = setup
    check(run_processes(["-c", ROWS, config, str(tmp_path)], num_processes=2, devices_per_process=2,
                        timeout=TIMEOUT, cwd=REPO))
    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.training.config import load_config
    from dspark_jax.training.trainer import make_train_iterator

    cfg = load_config(config)
    target = load_target(cfg.target)
    alone = make_train_iterator(cfg, cfg.drafter_config(target.config, target.name))
    got = [dict(np.load(tmp_path / f"{p}.npz")) for p in range(2)]
    for step in range(3):
        want = next(alone)
        rows = len(want["tokens"])
        assert rows == 8
        for p in range(2):  # the global batch does not depend on the process count
            np.testing.assert_array_equal(got[p][f"global_{step}"], want["token_index"])
            np.testing.assert_array_equal(got[p][f"assembled_{step}"], want["tokens"])
        local = [got[p][f"local_{step}"] for p in range(2)]
        assert [len(x) for x in local] == [rows // 2, rows // 2]
        np.testing.assert_array_equal(np.concatenate(local), want["token_index"])  # complete, in order
        tokens = [set(x[x > 0].tolist()) for x in local]  # token_index: 0 only for padding
        assert tokens[0] and tokens[1]
        if step == 0:  # within the first epoch no example comes twice: none is in both processes
            assert not tokens[0] & tokens[1]
