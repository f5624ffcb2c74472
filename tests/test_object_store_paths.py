"""gs:// paths work wherever local ones do (core/files.py), without a network: a fake "gs" fsspec
filesystem stores objects under a tmp folder with an object store's rules (no folders of their
own, no appends). Decode --output, datagen --out, training data / feature cache / run folder
files and plots on gs:// give what local paths give and resume the same; an unusable URL is one
line. Orbax checkpoints are left local here: orbax writes gs:// through tensorstore's own GCS
driver, which needs the network."""

import dataclasses
import importlib
import json
import os

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_main
from fsspec.implementations.local import LocalFileSystem
from test_data import GEN, shard_arrays, tiny_target  # noqa: F401  (tiny_target: a fixture)
from test_decode_offline import BASE, LINES, decode_json, prompts_file, read_results, without_timings  # noqa: F401
from test_training import tiny_config, write_tiny_data
from test_training import tiny_target as tiny_train_target

from dspark_jax import datagen as datagen_cli
from dspark_jax import decode, plot_metrics, train
from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.training import datagen


class FakeGCS(LocalFileSystem):
    """gs://bucket/key -> FakeGCS.root/bucket/key, with an object store's rules: makedirs does
    nothing (a "folder" exists only while objects lie under it) and nothing opens for appending."""

    protocol = ("gs", "gcs")
    root = None
    cachable = False
    opened: list = []

    def __init__(self, **kwargs):  # etils passes finalize_on_close=True for gcsfs
        super().__init__()

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return os.path.join(cls.root, path[len(prefix):]).rstrip("/")
        assert path.startswith(cls.root), f"not an object of the fake store: {path}"
        return path.rstrip("/")

    def makedirs(self, path, exist_ok=False):
        pass

    def mkdir(self, path, create_parents=True, **kwargs):
        pass

    def _open(self, path, mode="rb", **kwargs):
        assert "a" not in mode and "+" not in mode, f"an object store cannot open {mode!r}"
        FakeGCS.opened.append((path, mode))
        if "w" in mode:  # the local disk needs the folder an object store does not
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return super()._open(path, mode, **kwargs)


def _epath_cache_clear():
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()  # it caches the filesystem per protocol


@pytest.fixture
def gcs(tmp_path, monkeypatch):
    """The fake store, registered for gs:// (etils maps gs:// to fsspec's "gcs"); returns its root.
    The working folder is an empty one, so a path that went to the local disk as a folder named
    "gs:" would show."""
    root = tmp_path / "gcs-objects"
    root.mkdir()
    monkeypatch.setattr(FakeGCS, "root", str(root))
    monkeypatch.setattr(FakeGCS, "opened", [])
    monkeypatch.setenv("EPATH_USE_TF", "false")  # etils prefers tf.io.gfile when TensorFlow is installed
    registry = importlib.import_module("fsspec.registry")._registry
    for name in FakeGCS.protocol:
        monkeypatch.setitem(registry, name, FakeGCS)
    _epath_cache_clear()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield root
    _epath_cache_clear()
    assert os.listdir(cwd) == [], "a gs:// path was written to the local disk"


def objects(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names)


def test_paths_go_through_fsspec_with_object_store_rules(gcs):
    assert not files.exists("gs://bucket/run") and files.listdir("gs://bucket/run") == []
    files.makedirs("gs://bucket/run")  # no folders on an object store: still nothing there
    assert objects(gcs) == []
    files.atomic_write_text("gs://bucket/run/a.json", '{"a": 1}')
    files.atomic_write_bytes("gs://bucket/run/sub/b.bin", b"\0\1")
    assert objects(gcs) == ["bucket/run/a.json", "bucket/run/sub/b.bin"]  # whole objects, no temporaries
    assert FakeGCS.opened and all(path.startswith(str(gcs)) for path, _ in FakeGCS.opened)
    assert files.read_text("gs://bucket/run/a.json") == '{"a": 1}'
    assert files.listdir("gs://bucket/run") == ["a.json", "sub"] and files.is_dir("gs://bucket/run/sub")
    files.remove("gs://bucket/run/a.json")
    files.remove("gs://bucket/run/a.json")  # gone already: fine
    assert not files.exists("gs://bucket/run/a.json")
    # An error while writing uploads nothing: the old object stays whole.
    with pytest.raises(RuntimeError):
        with files.atomic_writer("gs://bucket/run/sub/b.bin") as f:
            f.write(b"half")
            raise RuntimeError("killed")
    assert files.read_bytes("gs://bucket/run/sub/b.bin") == b"\0\1"


def test_an_appended_object_is_rewritten_whole_at_most_every_interval(gcs):
    log = files.AppendedObject("gs://bucket/log.jsonl", "old\n", every_s=3600)
    log.write("a\n")
    log.flush()  # the first flush writes
    assert files.read_text("gs://bucket/log.jsonl") == "old\na\n"
    log.write("b\n")
    log.flush()  # within the interval: not yet
    assert files.read_text("gs://bucket/log.jsonl") == "old\na\n"
    log.close()
    assert files.read_text("gs://bucket/log.jsonl") == "old\na\nb\n"
    with files.open_append("gs://bucket/log.jsonl") as again:  # picks up the object's text
        again.write("c\n")
    assert files.read_text("gs://bucket/log.jsonl") == "old\na\nb\nc\n"


def test_unusable_urls_are_one_line(gcs, capsys, monkeypatch):
    # Without gcsfs (simulated even where it is installed): the install hint, before any model loads.
    registry = importlib.import_module("fsspec.registry")
    monkeypatch.delitem(registry._registry, "gcs")
    monkeypatch.setitem(registry.known_implementations, "gcs", {"class": "gcsfs_not_installed.GCSFileSystem"})
    hint = "gs://bucket/out.jsonl: gs:// needs its fsspec package: pip install 'dspark_jax[gcs]'"
    assert_one_line_error(decode.main, capsys, hint, "--prompt", "hi", "--output", "gs://bucket/out.jsonl")
    assert_one_line_error(datagen_cli.main, capsys, "pip install 'dspark_jax[gcs]'", "--sets", "gsm8k",
                          "--out", "gs://bucket/data")
    assert_one_line_error(train.main, capsys, "run.out_dir gs://bucket/run: use a local path or a gs://",
                          "--config", os.path.join(REPO, "configs/dspark_smollm2-135m.yaml"),
                          "run.out_dir=gs://bucket/run")
    # A scheme etils does not route, and target weights, stay refused in one line too.
    assert_one_line_error(decode.main, capsys, "memory:// URLs are not supported", "--prompt", "hi",
                          "--output", "memory://x/out.jsonl")
    assert_one_line_error(decode.main, capsys, "--target s3://b/model.gguf: URLs are not read here",
                          "--target", "s3://b/model.gguf", "--prompt", "hi")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_decode_output_on_gs_matches_local_and_resumes(gcs, capsys, tiny_target_folder, prompts_file, tmp_path):  # noqa: F811
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none",
            "--max-batch", "2"]
    local = tmp_path / "local.jsonl"
    decode_json(capsys, *args, "--output", str(local))
    url = "gs://bucket/out/results.jsonl"
    _, summary = decode_json(capsys, *args, "--output", url, "--limit", "4")  # an "interrupted" run
    assert summary["decoded"] == 4 and objects(gcs) == ["bucket/out/results.jsonl"]
    stored = gcs / "bucket/out/results.jsonl"
    _, summary = decode_json(capsys, *args, "--output", url)
    assert summary["skipped"] == 4 and summary["decoded"] == len(LINES) - 4
    (header, written), (local_header, local_written) = read_results(stored), read_results(local)
    assert header == local_header
    assert ({r["index"]: without_timings(r) for r in written} ==
            {r["index"]: without_timings(r) for r in local_written})
    # A torn last line (a kill mid-upload cannot make one, a copy can): dropped and redone.
    data = stored.read_bytes()
    lines = data.split(b"\n")
    stored.write_bytes(b"\n".join(lines[:3]) + b"\n" + lines[3][:20])
    _, summary = decode_json(capsys, *args, "--output", url)
    assert summary["skipped"] == 2 and summary["decoded"] == len(LINES) - 2
    assert sorted(r["index"] for r in read_results(stored)[1]) == list(range(len(LINES)))
    assert_one_line_error(decode.main, capsys, "holds results of other settings", *args, "--output", url,
                          "--temperature", "0.5")


def test_datagen_on_gs_matches_local_and_resumes(gcs, tmp_path, tiny_target):  # noqa: F811
    sets = ["gsm8k", "mbpp"]
    local = str(tmp_path / "local")
    m_local = datagen.generate_dataset(tiny_target, sets, "eval", local, **GEN)
    url = "gs://bucket/data/eval"
    m1 = datagen.generate_dataset(tiny_target, sets, "eval", url, max_shards=1, **GEN)  # "interrupted"
    assert not m1["complete"] and objects(gcs) == ["bucket/data/eval/manifest.json", "bucket/data/eval/shard-00000.npz"]
    first = gcs / "bucket/data/eval/shard-00000.npz"
    stamp = os.stat(first).st_mtime_ns
    m2 = datagen.generate_dataset(tiny_target, sets, "eval", url, **GEN)
    assert m2["complete"] and os.stat(first).st_mtime_ns == stamp  # resumed, not redone
    assert shard_arrays(url) == shard_arrays(local)
    for shard in m_local["shards"]:  # byte for byte
        assert (gcs / "bucket/data/eval" / shard["file"]).read_bytes() == open(os.path.join(local, shard["file"]), "rb").read()
    assert {k: v for k, v in m2.items() if k != "created"} == {k: v for k, v in m_local.items() if k != "created"}
    files.atomic_write_text("gs://bucket/foreign/notes.txt", "x")
    with pytest.raises(UserError, match="not empty"):
        datagen.generate_dataset(tiny_target, sets, "eval", "gs://bucket/foreign", **GEN)


class NoCheckpoints:
    """Stands in for the orbax CheckpointManager of a gs:// run folder (orbax's own GCS driver would
    need the network): no saves, nothing to restore."""

    def latest_step(self):
        return None

    def wait_until_finished(self):
        pass

    def close(self):
        pass


def _copy_to_gs(folder, url):
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            files.atomic_write_bytes(f"{url}/{name}", f.read())


def test_training_on_gs_data_cache_and_run_folder(gcs, tmp_path, monkeypatch, capsys):
    """train_dir, data.feature_cache and run.out_dir all on gs://: the same metrics as a local run;
    run.json, metrics.jsonl, resumes.jsonl, the drafter and the plots are objects; a resume reads
    them back."""
    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.training import trainer as trainer_lib

    local_cfg = tiny_config(tmp_path / "local")
    local_cfg = dataclasses.replace(local_cfg, data=dataclasses.replace(local_cfg.data,
                                                                        feature_cache=str(tmp_path / "local/cache")))
    run = trainer_lib.Trainer(local_cfg, tiny_train_target(), progress=False)
    run.fit(progress=False)
    run.close()
    local_metrics = [json.loads(line) for line in open(os.path.join(local_cfg.run.out_dir, "metrics.jsonl"))]

    write_tiny_data(str(tmp_path / "staging"))
    _copy_to_gs(str(tmp_path / "staging"), "gs://bucket/data")
    cfg = dataclasses.replace(local_cfg, data=dataclasses.replace(local_cfg.data, train_dir="gs://bucket/data",
                                                                  feature_cache="gs://bucket/cache"),
                              run=dataclasses.replace(local_cfg.run, out_dir="gs://bucket/run"))
    monkeypatch.setattr(trainer_lib.Trainer, "manager", NoCheckpoints())
    monkeypatch.setattr(trainer_lib.Trainer, "save", lambda self, state: None)
    run = trainer_lib.Trainer(cfg, tiny_train_target(), progress=False)
    state = run.fit(progress=False)
    save_drafter("gs://bucket/run/drafter", run.dcfg, state.params)
    run.close()
    assert {"bucket/cache/cache.json", "bucket/cache/features.npy", "bucket/run/run.json", "bucket/run/metrics.jsonl",
            "bucket/run/drafter/drafter.json", "bucket/run/drafter/drafter.safetensors"} <= set(objects(gcs))
    metrics = [json.loads(line) for line in (gcs / "bucket/run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [m["step"] for m in local_metrics]
    for ours, theirs in zip(metrics, local_metrics):
        np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=1e-6)
    assert json.loads((gcs / "bucket/run/run.json").read_text())["config"]["run"]["out_dir"] == "gs://bucket/run"

    with pytest.raises(UserError, match="is not empty"):  # the run folder check reads the bucket
        trainer_lib.check_run_folder(cfg)
    resumed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, steps=8))
    run = trainer_lib.Trainer(resumed, tiny_train_target(), progress=False)
    run.fit(resume=True, progress=False, allow_schedule_change=True)  # no checkpoint: from step 0
    run.close()
    resumes = (gcs / "bucket/run/resumes.jsonl").read_text().splitlines()
    assert len(resumes) == 1 and json.loads(resumes[0])["changes"] == {"optim.steps": [6, 8]}
    assert [json.loads(line)["step"] for line in (gcs / "bucket/run/metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 9))

    code, out, err = run_main(plot_metrics.main, capsys, "gs://bucket/run")
    assert code == 0, err
    assert "gs://bucket/run/plots/loss.png" in out.split()
    assert (gcs / "bucket/run/plots/loss.png").read_bytes()[:4] == b"\x89PNG"
