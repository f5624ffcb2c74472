"""The on-disk target feature cache: token indices, equality with the online path, staleness, atomicity."""

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from test_data import fake_examples, write_fake_dataset
from test_training import TARGET_CFG, tiny_config, tiny_target

from dspark_jax.data import feature_cache, pipeline
from dspark_jax.data.pipeline import PackingConfig, ShardSource, make_dataset, target_features
from dspark_jax.errors import UserError
from dspark_jax.training.config import config_to_dict, load_config
from dspark_jax.training.trainer import Trainer

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


def test_token_index_points_at_the_tokens(tmp_path):
    source = ShardSource([tiny_data(tmp_path, "a", 0), tiny_data(tmp_path, "b", 1)])  # 2 folders x 2 shards
    count = 0
    for batch in make_dataset(source, PACK):
        present = batch["segment_ids"] > 0
        np.testing.assert_array_equal(source.tokens[batch["token_index"][present]], batch["tokens"][present])
        assert not batch["token_index"][~present].any()
        count += int(present.sum())
    assert count > 0 and source.tokens.size > 2 * 24 * 10


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
        assert ctx.dtype == last.dtype == np.float32
        assert ctx.shape == online_ctx.shape and last.shape == online_last.shape
        for cached, online in ((ctx, online_ctx), (last, online_last)):
            assert not cached[~present].any()  # zeros at padding
            np.testing.assert_allclose(cached[present], online[present], rtol=2**-8, atol=1e-6)  # bf16 rounding
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
        assert not feature_cache.is_complete(str(out)) and not os.path.exists(out / "features.npy.partial")
        with pytest.raises(UserError, match="no complete feature cache"):
            feature_cache.open_feature_cache(str(out))
        monkeypatch.setattr(pipeline, "target_features", online)
        calls.clear()
        with open(out / "features.npy.partial", "wb") as f:  # what a kill -9 would leave
            f.write(b"junk")
        cache = build(source, out)
        assert feature_cache.is_complete(str(out)) and not os.path.exists(out / "features.npy.partial")
        assert cache.features[source.offsets[1]: source.offsets[2]].any()


def test_config_key(tmp_path):
    cfg = load_config("configs/dspark_smollm2-135m.yaml", ["data.feature_cache=runs/feats"])
    assert cfg.data.feature_cache == "runs/feats"
    default = load_config("configs/dspark_smollm2-135m.yaml")
    assert default.data.feature_cache is None
    assert json.loads(json.dumps(config_to_dict(default)))["data"]["feature_cache"] is None
    assert load_config("configs/dspark_smollm2-135m.yaml", ["data.feature_cache=2024"]).data.feature_cache == "2024"
