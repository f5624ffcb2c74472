"""The on-disk target feature cache: token indices, equality with the online path, staleness, atomicity."""

import dataclasses
import errno
import hashlib
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_data import fake_examples, write_fake_dataset
from test_training import TARGET_CFG, params_of, tiny_config, tiny_target

from dspark_jax.data import feature_cache, pipeline, shards
from dspark_jax.data.pipeline import PackingConfig, ShardSource, make_dataset, target_features
from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.training.config import config_to_dict, load_config
from dspark_jax.training.trainer import Trainer, target_feature_inputs

TAPS = (1, 3)
PACK = PackingConfig(batch_size=3, seq_len=96, max_blocks=6, block_size=4, anchors_per_seq=3, seed=2, num_epochs=1)


def tiny_data(tmp_path, name="d", seed=0):
    folder = str(tmp_path / name)
    if not os.path.exists(folder):
        write_fake_dataset(folder, fake_examples(seed, count=24, vocab=TARGET_CFG.vocab_size))
    return folder


def build(source, out, **kw):
    params = tiny_target().params
    return feature_cache.build_feature_cache(params, TARGET_CFG, TAPS, source, PACK.seq_len, str(out), rows=3,
                                             progress=False, **kw)


def cached_config(tmp_path, cache=None, **run):
    cfg = tiny_config(tmp_path)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=str(cache or tmp_path / "cache")),
                               run=dataclasses.replace(cfg.run, **run))


def partials(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("features.npy.partial"))


def test_token_index_points_at_the_tokens(tmp_path):
    source = ShardSource([tiny_data(tmp_path, "a", 0), tiny_data(tmp_path, "b", 1)])  # 2 folders x 2 shards
    count = 0
    for batch in make_dataset(source, PACK):
        present = batch["segment_ids"] > 0
        assert batch["token_index"].dtype == np.int64
        np.testing.assert_array_equal(source.tokens[batch["token_index"][present]], batch["tokens"][present])
        assert not batch["token_index"][~present].any()
        count += int(present.sum())
    assert count > 0 and source.tokens.size > 2 * 24 * 10


class _FarSource(ShardSource):
    """A ShardSource whose examples claim to start 2**32 tokens further on (data of > 2**31 tokens)."""

    def __getitem__(self, index):
        return {**super().__getitem__(index), "offset": super().__getitem__(index)["offset"] + 2**32}


def test_token_index_is_int64_end_to_end(tmp_path):
    source = _FarSource(tiny_data(tmp_path))
    batch = next(iter(make_dataset(source, PACK)))
    present = batch["segment_ids"] > 0
    assert batch["token_index"].dtype == np.int64 and batch["token_index"][present].min() >= 2**32
    np.testing.assert_array_equal(source.tokens[batch["token_index"][present] - 2**32], batch["tokens"][present])


def test_cached_features_equal_online_features(tmp_path):
    source = ShardSource(tiny_data(tmp_path))
    cache = build(source, tmp_path / "cache")
    d = TARGET_CFG.hidden_size
    assert cache.features.shape == (len(source.tokens), 3 * d) and cache.meta["tap_layers"] == list(TAPS)
    long = int(np.argmax(source.lengths()))
    assert source.lengths()[long] > PACK.seq_len  # a truncated example: its tail is never computed
    assert not cache.features[source.offsets[long] + PACK.seq_len: source.offsets[long + 1]].any()
    params = tiny_target().params
    checked = 0
    for batch in make_dataset(source, PACK):
        present = batch["segment_ids"] > 0
        ctx, last = feature_cache.gather(cache, batch["token_index"], present)
        online_ctx, online_last = (np.asarray(a) for a in target_features(params, TARGET_CFG, batch, TAPS))
        assert ctx.dtype == last.dtype == ml_dtypes.bfloat16  # as stored: half the bytes of float32
        assert ctx.flags.c_contiguous and last.flags.c_contiguous
        assert ctx.shape == online_ctx.shape and last.shape == online_last.shape
        for cached, online in ((ctx, online_ctx), (last, online_last)):
            cached = cached.astype(np.float32)
            assert not cached[~present].any()  # zeros at padding
            # One bf16 ulp: the cache and the online path pack rows differently, so float rounding
            # may tip a value across a bf16 rounding boundary.
            np.testing.assert_allclose(cached[present], online[present], rtol=2**-7, atol=1e-6)
        checked += int(present.sum())
    assert checked > 0


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_loss_with_the_cache_matches_the_online_loss(tmp_path, kind):
    cfg = tiny_config(tmp_path)  # float32 compute, so the only difference is bf16 storage of the features
    if kind == "eagle3":
        cfg = dataclasses.replace(cfg, drafter=dict(kind="eagle3", num_layers=1, head="none", markov_rank=0,
                                                    confidence=False, ttt_steps=2, target_layer_ids=(0, 2)))
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=str(tmp_path / "cache")))
    trainer = Trainer(cfg, tiny_target(), progress=False)  # builds the cache
    assert feature_cache.is_complete(cfg.data.feature_cache)
    params = trainer.init_state().params
    batch = next(trainer.data)
    cached = trainer.host_batch(batch)
    present = (batch["segment_ids"] > 0)[..., None]
    assert "token_index" not in cached and cached["ctx_features"].shape[-1] == 2 * TARGET_CFG.hidden_size

    def loss(b):
        return float(trainer.eval_step(params, trainer.target_params, trainer.device_batch(b, trainer.eval_sharding))[0])

    online, with_cache = loss(batch), loss(cached)  # device_batch drops token_index: `batch` runs the target
    features = target_features(trainer.target_params, TARGET_CFG, batch, trainer.dcfg.tap_layers)
    rounded = loss({**cached, **{k: np.asarray(v.astype(jnp.bfloat16).astype(jnp.float32)) * present
                                 for k, v in zip(("ctx_features", "target_last_hidden"), features)}})
    shifted = loss({**cached, **{k: np.roll(cached[k], 1, axis=1) for k in ("ctx_features", "target_last_hidden")}})
    # The cache holds the online features rounded to bf16, and nothing else: the loss on the online
    # features rounded to bf16 is the cached loss (up to a rare 1-ulp flip), and within bf16 error
    # of the online loss; features one slot off (an indexing bug) would be far outside both.
    scale = abs(online)
    assert abs(with_cache - rounded) < 1e-5 * scale, (with_cache, rounded)
    assert abs(with_cache - online) < 1e-3 * scale, (with_cache, online)
    assert abs(shifted - with_cache) > 5e-5 * scale, (with_cache, shifted)
    state = trainer.fit(stop_after=2, progress=False)  # the jitted step runs on cached features
    trainer.close()
    log = [json.loads(line) for line in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    assert int(state.step) == 2 and all(np.isfinite(r["loss"]) for r in log)


def test_a_bf16_run_caches_exactly_the_online_features(tmp_path):
    """In a bfloat16 run the online path runs the target with its params cast to bf16 and its own
    (float32) config, and the loss casts the features to bf16: the cache must hold those features,
    not ones computed another way (e.g. with bf16 activations)."""
    cfg = cached_config(tmp_path, compute_dtype="bfloat16")
    trainer = Trainer(cfg, tiny_target(), progress=False)  # builds the cache
    assert trainer.feature_cache.meta["compute_dtype"] == "bfloat16"
    params = trainer.init_state().params
    batch = next(trainer.data)
    cached = trainer.host_batch(batch)
    present = batch["segment_ids"] > 0
    # what make_loss computes online, rounded to bf16 as the loss does
    online = target_features(*target_feature_inputs(trainer.target_params, TARGET_CFG, "bfloat16"), batch,
                             trainer.dcfg.tap_layers)
    for k, value in zip(("ctx_features", "target_last_hidden"), online):
        want = np.asarray(value.astype(jnp.bfloat16)).astype(np.float32)[present]
        got = cached[k].astype(np.float32)[present]
        # equal up to rare 1-ulp flips (packing-dependent rounding); a different precision (bf16
        # activations) differs in far more elements and by many ulps
        assert np.mean(got != want) < 0.02, (k, np.mean(got != want))
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)

    def loss(b):
        return float(trainer.eval_step(params, trainer.target_params, trainer.device_batch(b, trainer.eval_sharding))[0])

    with_cache, online_loss = loss(cached), loss(batch)
    assert abs(with_cache - online_loss) < 2e-5 * abs(online_loss), (with_cache, online_loss)  # bf16 activations: 2e-4
    trainer.close()


def test_feature_cache_dtype_builds_with_those_weights_and_is_checked(tmp_path):
    """data.feature_cache_dtype=bfloat16 in a float32 run: the cache holds the features of the
    target with bf16 weights (what `target_feature_inputs` gives for bfloat16), not the fp32 ones;
    a run that expects other weights refuses it, in words."""
    cfg = cached_config(tmp_path, compute_dtype="float32")
    fast = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache_dtype="bfloat16"))
    trainer = Trainer(fast, tiny_target(), progress=False)
    assert trainer.feature_cache.meta["compute_dtype"] == "bfloat16"
    batch = next(trainer.data)
    cached = trainer.host_batch(batch)
    present = batch["segment_ids"] > 0
    for dtype, close in (("bfloat16", True), ("float32", False)):
        online = target_features(*target_feature_inputs(trainer.target_params, TARGET_CFG, dtype), batch,
                                 trainer.dcfg.tap_layers)
        want = np.asarray(online[0].astype(jnp.bfloat16)).astype(np.float32)[present]
        mismatch = np.mean(cached["ctx_features"].astype(np.float32)[present] != want)
        assert (mismatch < 0.02) == close, (dtype, mismatch)
    trainer.close()
    with pytest.raises(UserError, match="built with the target's weights in bfloat16, this run asks for float32 "
                                        r"\(data.feature_cache_dtype"):
        Trainer(cfg, tiny_target(), progress=False)
    Trainer(fast, tiny_target(), progress=False).close()  # the same setting reopens it


def test_the_cached_step_never_runs_the_target(tmp_path):
    """A cached train step with the target's layers poisoned (NaN) is the clean cached step: only
    the embedding and LM head, which the drafter shares, enter it."""
    trainer = Trainer(cached_config(tmp_path), tiny_target(), progress=False)
    host = next(trainer.data)
    batch = trainer.device_batch(trainer.host_batch(host))
    poisoned = jax.device_put({k: v if k in ("embed", "lm_head") else jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), v)
                               for k, v in tiny_target().params.items()}, trainer.target_shardings)
    clean_state, clean = trainer.train_step(trainer.init_state(), trainer.target_params, batch)
    state, metrics = trainer.train_step(trainer.init_state(), poisoned, batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) == float(clean["loss"])
    for a, b in zip(jax.tree.leaves(params_of(clean_state)), jax.tree.leaves(params_of(state))):
        np.testing.assert_array_equal(a, b)
    _, online = trainer.train_step(trainer.init_state(), poisoned, trainer.device_batch(host))  # runs the target
    assert np.isnan(float(online["loss"]))  # so the poison would show
    trainer.close()


def test_resume_with_the_cache_is_bit_for_bit(tmp_path):
    cache = tmp_path / "cache"  # one cache for both runs: their data folders hold the same tokens
    straight = Trainer(cached_config(tmp_path / "a", cache), tiny_target(), progress=False)
    full = params_of(straight.fit(progress=False))
    straight.close()
    cfg = cached_config(tmp_path / "b", cache)
    first = Trainer(cfg, tiny_target(), progress=False)
    first.fit(stop_after=3, progress=False)
    first.close()
    second = Trainer(cfg, tiny_target(), progress=False)
    resumed = second.fit(resume=True, progress=False)
    second.close()
    assert int(resumed.step) == 6
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(params_of(resumed))):
        np.testing.assert_array_equal(a, b)


def test_a_stale_cache_is_refused(tmp_path):
    cfg = tiny_config(tmp_path)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=str(tmp_path / "cache")))
    Trainer(cfg, tiny_target(), progress=False).close()
    Trainer(cfg, tiny_target(), progress=False).close()  # the same run reopens it
    other_taps = dataclasses.replace(cfg, drafter={**cfg.drafter, "target_layer_ids": (1, 2)})
    with pytest.raises(UserError, match="tap_layers is .* delete the folder"):
        Trainer(other_taps, tiny_target(), progress=False)
    other_len = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=80))
    with pytest.raises(UserError, match="seq_len is 64 there, 80 here"):
        Trainer(other_len, tiny_target(), progress=False)
    spec = feature_cache.cache_spec("tiny", TARGET_CFG, (1, 3), feature_cache.data_fingerprint(tiny_data(tmp_path)),
                                    cfg.data.seq_len)  # taps (1, 3) = target_layer_ids (0, 2)
    with pytest.raises(UserError, match="data is .* tokens in 1 shards of 1 folder.* here"):
        feature_cache.open_feature_cache(cfg.data.feature_cache, spec)


def test_regenerated_data_of_the_same_lengths_is_refused(tmp_path):
    cfg = cached_config(tmp_path)
    Trainer(cfg, tiny_target(), progress=False).close()
    manifest = shards.read_manifest(cfg.data.train_dir)
    shard = os.path.join(cfg.data.train_dir, manifest["shards"][0]["file"])
    with np.load(shard) as z:
        data = dict(z)
    data["tokens"] = data["tokens"] % (TARGET_CFG.vocab_size - 1) + 1  # other tokens, every length the same
    np.savez(shard, **data)
    # A regeneration writes its own manifest: the same counts, the new shard's hash (which the
    # shard reader checks), so only the cache's content fingerprint can tell the data apart.
    manifest["shards"][0]["sha256"] = hashlib.sha256(open(shard, "rb").read()).hexdigest()
    files.atomic_write_json(os.path.join(cfg.data.train_dir, shards.MANIFEST), manifest)
    with pytest.raises(UserError, match="data content differs: the same .* tokens in 1 shards .* other tokens"):
        Trainer(cfg, tiny_target(), progress=False)
    meta_path = os.path.join(cfg.data.feature_cache, "cache.json")
    meta = json.load(open(meta_path))
    for folder in meta["data"]:  # a cache from before content hashes
        del folder["content_blake2b"]
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UserError, match="no content hash there"):
        Trainer(cfg, tiny_target(), progress=False)
    del meta["data"]  # hand-edited
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(UserError, match="data is missing there, .* tokens in 1 shards of 1 folder"):
        Trainer(cfg, tiny_target(), progress=False)


def test_the_fingerprint_hashes_every_folder_s_content(tmp_path):
    a, b = tiny_data(tmp_path, "a", 0), tiny_data(tmp_path, "b", 1)
    both = feature_cache.data_fingerprint(ShardSource([a, b]))
    assert [f["content_blake2b"] for f in both] == [feature_cache.data_fingerprint(x)[0]["content_blake2b"]
                                                    for x in (a, b)]  # per folder, independent of the others
    assert both[0]["content_blake2b"] != both[1]["content_blake2b"]
    assert feature_cache.data_fingerprint([a, b]) == both  # folders are loaded into a ShardSource


def test_an_interrupted_build_leaves_no_complete_cache(tmp_path, monkeypatch):
    source = ShardSource(tiny_data(tmp_path))
    out = tmp_path / "cache"
    calls = []
    online = pipeline.target_features

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return online(*args)

    for attempt in range(2):  # into an empty folder, then over a complete cache
        monkeypatch.setattr(pipeline, "target_features", failing)
        with pytest.raises(RuntimeError, match="killed"):
            build(source, out)
        assert not feature_cache.is_complete(str(out)) and not partials(out)
        with pytest.raises(UserError, match="no complete feature cache"):
            feature_cache.open_feature_cache(str(out))
        monkeypatch.setattr(pipeline, "target_features", online)
        calls.clear()
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()  # a process that is gone
        host = socket.gethostname()
        killed, live, elsewhere = (f"features.npy.partial.{host}.{dead}.0a1b2c",  # what a kill -9 would leave
                                   f"features.npy.partial.{host}.{os.getppid()}.0a1b2c",  # a build running now
                                   f"features.npy.partial.other-host.{dead}.0a1b2c")
        for name in (killed, live, elsewhere):
            (out / name).write_bytes(b"junk")
        cache = build(source, out)
        assert feature_cache.is_complete(str(out)) and partials(out) == sorted([live, elsewhere])
        assert cache.features[source.offsets[1]: source.offsets[2]].any()
        for name in partials(out):
            os.remove(out / name)


_INTERRUPTED_BUILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_feature_cache import build
from dspark_jax.data import feature_cache, pipeline
write, calls = feature_cache._write_batch, []

def stopping(f, *args):
    write(f, *args)
    calls.append(1)
    if len(calls) == 3:  # batches 1 and 2 recorded; batch 3 on disk but not yet recorded
        f.flush()
        {stop}

feature_cache._write_batch = stopping
build(pipeline.ShardSource({data!r}), {out!r}, checkpoint_every_s=0)
"""


@pytest.mark.parametrize("stop", ["os.kill(os.getpid(), signal.SIGKILL)", "raise KeyboardInterrupt"])
def test_a_killed_build_resumes_where_it_stopped(tmp_path, monkeypatch, stop):
    """kill -9 and Ctrl-C part-way: the next build takes the partial file over, computes only the
    batches after the last record, and the cache is byte for byte an uninterrupted build's."""
    data = tiny_data(tmp_path)
    source = ShardSource(data)
    whole = build(source, tmp_path / "whole")
    batches = len(list(feature_cache._packed_rows(np.minimum(source.lengths(), PACK.seq_len), PACK.seq_len, 3)))
    assert batches >= 5
    out = tmp_path / "cache"
    script = _INTERRUPTED_BUILD.format(tests=os.path.dirname(os.path.abspath(__file__)), data=data, out=str(out),
                                       stop=stop)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode != 0 and not feature_cache.is_complete(str(out))
    left = partials(out)
    assert len(left) == 2 and left[1] == left[0] + ".json"  # the partial file and its progress record
    record = json.load(open(out / left[1]))
    assert 0 < record["examples"] and record["bytes"] < os.path.getsize(out / left[0])  # rewritten on resume

    calls = []
    online = pipeline.target_features
    monkeypatch.setattr(pipeline, "target_features", lambda *a: calls.append(1) or online(*a))
    resumed = build(source, out)
    assert len(calls) == batches - 2 and not partials(out)
    assert open(out / "features.npy", "rb").read() == open(tmp_path / "whole" / "features.npy", "rb").read()
    assert np.array_equal(resumed.features, whole.features)

    # A partial file of another cache (other data) is not taken over: it is removed and the build starts over.
    other = tmp_path / "other"
    subprocess.run([sys.executable, "-c", _INTERRUPTED_BUILD.format(
        tests=os.path.dirname(os.path.abspath(__file__)), data=tiny_data(tmp_path, "d2", seed=1), out=str(other),
        stop=stop)], capture_output=True, text=True)
    assert len(partials(other)) == 2
    calls.clear()
    build(source, other)
    assert len(calls) == batches and not partials(other)
    assert open(other / "features.npy", "rb").read() == open(tmp_path / "whole" / "features.npy", "rb").read()


def test_two_builds_into_one_folder_do_not_clash(tmp_path, monkeypatch):
    source = ShardSource(tiny_data(tmp_path))
    out = tmp_path / "cache"
    online = pipeline.target_features
    calls = []

    def with_a_second_build(*args):  # a second build runs, start to end, in the middle of the first
        calls.append(1)
        if len(calls) == 2:
            monkeypatch.setattr(pipeline, "target_features", online)
            build(source, out)
            assert feature_cache.is_complete(str(out)) and len(partials(out)) == 1  # the first build's
        return online(*args)

    monkeypatch.setattr(pipeline, "target_features", with_a_second_build)
    cache = build(source, out)
    assert len(calls) == 2 and feature_cache.is_complete(str(out)) and not partials(out)
    assert cache.features[source.offsets[1]: source.offsets[2]].any()


def test_write_errors_are_one_line_user_errors(tmp_path, monkeypatch):
    source = ShardSource(tiny_data(tmp_path))
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(UserError, match="is a file, not a folder"):
        build(source, a_file)
    with pytest.raises(UserError, match="cannot write the feature cache in .*a_file/sub: Not a directory"):
        build(source, a_file / "sub")
    out = tmp_path / "cache"
    os.makedirs(out)
    written = []

    def full_disk(f, *args):
        written.append(1)
        if len(written) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(f, *args)

    write = feature_cache._write_batch
    monkeypatch.setattr(feature_cache, "_write_batch", full_disk)
    with pytest.raises(UserError, match=r"failed: No space left on device \(it needs 0.0 GiB\); free space"):
        build(source, out)
    assert not partials(out) and not feature_cache.is_complete(str(out))


def test_config_key(tmp_path):
    cfg = load_config("configs/dspark_smollm2-135m.yaml", ["data.feature_cache=runs/feats"])
    assert cfg.data.feature_cache == "runs/feats"
    default = load_config("configs/dspark_smollm2-135m.yaml")
    assert default.data.feature_cache is None
    assert json.loads(json.dumps(config_to_dict(default)))["data"]["feature_cache"] is None
    assert load_config("configs/dspark_smollm2-135m.yaml", ["data.feature_cache=2024"]).data.feature_cache == "2024"
    for off in ("false", "null", "none", "None", "no", "~"):  # switched off, not a folder named "False"
        assert load_config("configs/dspark_smollm2-135m.yaml", [f"data.feature_cache={off}"]).data.feature_cache is None
    with pytest.raises(UserError, match="data.feature_cache must be a string, got true .false, null or none"):
        load_config("configs/dspark_smollm2-135m.yaml", ["data.feature_cache=true"])
    with pytest.raises(UserError, match="run.out_dir must be a string, got false$"):
        load_config("configs/dspark_smollm2-135m.yaml", ["run.out_dir=false"])
