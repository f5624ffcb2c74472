"""The training loop: it learns, it resumes bit-for-bit, and sharding does not change the step."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from dspark_jax.checkpoints.registry import Target
from dspark_jax.data.shards import FORMAT, MANIFEST, write_shard
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig, load_config
from dspark_jax.training.losses import LossWeights
from dspark_jax.training.trainer import Trainer

TARGET_CFG = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=8, intermediate_size=48, max_position_embeddings=256, qk_norm=True)


def tiny_target() -> Target:
    return Target("tiny", "", TARGET_CFG, decoder.init_params(TARGET_CFG, jax.random.key(0), scale=0.3), None)


def write_tiny_data(folder, n=24, seed=0):
    """Responses that follow a simple rule (next = prev + 1 mod 64), so there is something to learn."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(n):
        prompts.append(rng.integers(1, 64, size=int(rng.integers(3, 8))).tolist())
        start = int(rng.integers(1, 64))
        responses.append([(start + i) % 64 for i in range(int(rng.integers(12, 30)))])
    os.makedirs(folder, exist_ok=True)
    entry = write_shard(os.path.join(folder, "shard-00000.npz"), prompts, responses,
                        [str(i) for i in range(n)], [True] * n)
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "target": "tiny", "target_shape": {"vocab_size": 64}, "shards": [entry]}, f)


def tiny_config(tmp_path, **optim) -> TrainConfig:
    data_dir = str(tmp_path / "data")
    if not os.path.exists(data_dir):
        write_tiny_data(data_dir)
    return TrainConfig(
        target="tiny",
        drafter=dict(kind="dspark", num_layers=1, block_size=4, head="markov", markov_rank=8, confidence=True,
                     mask_token_id=0, target_layer_ids=(0, 2)),
        loss=LossWeights(decay=4.0),
        data=DataConfig(train_dir=data_dir, rows=2, seq_len=64, blocks_per_row=8, anchors_per_seq=4),
        optim=OptimConfig(**{"lr": 3e-3, "steps": 6, "warmup_frac": 0.1, **optim}),
        run=RunConfig(out_dir=str(tmp_path / "run"), log_every=1, save_every=3, compute_dtype="float32",
                      mesh=(1, 1, 1)))


def params_of(state):
    return jax.tree.map(np.asarray, jax.device_get(state.params))


def test_resume_is_bit_for_bit(tmp_path):
    straight = Trainer(tiny_config(tmp_path / "a"), tiny_target())
    full = params_of(straight.fit(progress=False))
    straight.close()

    cfg = tiny_config(tmp_path / "b")
    first = Trainer(cfg, tiny_target())
    first.fit(stop_after=3, progress=False)  # "killed" after step 3 (checkpoint at 3)
    first.close()
    second = Trainer(cfg, tiny_target())  # a fresh process would build everything anew
    resumed = second.fit(resume=True, progress=False)
    second.close()
    assert int(resumed.step) == 6
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(params_of(resumed))):
        np.testing.assert_array_equal(a, b)
    steps = [json.loads(l)["step"] for l in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_training_reduces_the_loss(tmp_path):
    cfg = tiny_config(tmp_path, steps=40, lr=1e-2)
    write_tiny_data(str(tmp_path / "eval"), n=8, seed=1)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, save_every=1000, eval_every=20, eval_batches=2),
                              data=dataclasses.replace(cfg.data, eval_dir=str(tmp_path / "eval")))
    trainer = Trainer(cfg, tiny_target())
    trainer.fit(progress=False)
    trainer.close()
    log = [json.loads(l) for l in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    first, last = np.mean([r["loss"] for r in log[:5]]), np.mean([r["loss"] for r in log[-5:]])
    assert last < 0.9 * first, (first, last)
    assert log[-1]["expected_tau"] > log[0]["expected_tau"]
    assert {"loss_ce", "loss_tv", "loss_conf", "grad_norm", "accuracy_per_position", "blocks_per_s"} <= set(log[-1])
    evals = [r for r in log if "eval_expected_tau" in r]  # held-out tau proxy at steps 20 and 40
    assert [r["step"] for r in evals] == [20, 40]
    assert len(evals[-1]["eval_acceptance_per_position"]) == 4 and np.isfinite(evals[-1]["eval_loss"])


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_remat_and_logit_chunks_change_memory_not_the_step(tmp_path, kind):
    """run.remat and run.logit_chunk change what the backward pass keeps, not the step: two steps
    under each give the default's metrics and weights (to fp32 rounding; dropping the recompute or
    a chunk's blocks would not)."""
    eagle3 = dict(kind="eagle3", num_layers=1, head="none", markov_rank=0, confidence=False, ttt_steps=3,
                  target_layer_ids=(0, 2))

    def two_steps(**run):
        cfg = tiny_config(tmp_path / kind)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **run),
                                  **(dict(drafter=eagle3, loss=LossWeights.dflash()) if kind == "eagle3" else {}))
        trainer = Trainer(cfg, tiny_target(), progress=False)
        state, metrics = trainer.init_state(), []
        for _ in range(2):
            batch, _ = trainer.next_batch()
            state, m = trainer.train_step(state, trainer.target_params, batch)
            metrics.append(jax.device_get(m))
        trainer.close()
        return params_of(state), metrics

    want_params, want_metrics = two_steps()
    for run in (dict(remat="full", logit_chunk=3), dict(remat="dots", logit_chunk=1)):  # 3: chunks of 2 of 8
        params, metrics = two_steps(**run)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), metrics, want_metrics)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), params, want_params)


@pytest.mark.needs_devices(4)  # fails with fewer devices unless DSPARK_ALLOW_FEWER_DEVICES=1 (tests/conftest.py)
def test_sharded_step_equals_single_device(tmp_path):
    results = []
    for mesh in [(1, 1, 1), (2, 1, 2)]:
        cfg = tiny_config(tmp_path / str(mesh), steps=2)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, mesh=mesh, save_every=1000))
        trainer = Trainer(cfg, tiny_target())
        assert trainer.mesh.devices.size == int(np.prod(mesh))
        results.append(params_of(trainer.fit(progress=False)))
        trainer.close()
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_config_files_load_and_overrides(tmp_path):
    for name in os.listdir("configs"):
        if name.endswith(".yaml"):
            cfg = load_config(os.path.join("configs", name))
            assert cfg.drafter["kind"] in ("dspark", "eagle3")
    cfg = load_config("configs/dspark_smollm2-135m.yaml", ["optim.lr=1e-3", "data.rows=2", "drafter.markov_rank=32"])
    assert cfg.optim.lr == 1e-3 and cfg.data.rows == 2 and cfg.drafter["markov_rank"] == 32
    from dspark_jax.core.errors import UserError
    with pytest.raises(UserError, match="unknown optim setting"):
        load_config("configs/dspark_smollm2-135m.yaml", ["optim.learning_rate=1"])
    with pytest.raises(UserError, match="no such config file"):
        load_config(str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("drafter", [
    dict(kind="eagle3", num_layers=1, head="none", markov_rank=0, confidence=False, ttt_steps=3, target_layer_ids=(0, 2)),
    dict(kind="eagle3", num_layers=1, head="none", markov_rank=0, confidence=False, ttt_steps=3, target_layer_ids=(0, 2),
         ttt_at_anchors=True),
    dict(kind="dspark", num_layers=1, block_size=4, head="none", markov_rank=0, confidence=False, mask_token_id=0,
         target_layer_ids=(0, 2)),
])
def test_eagle3_and_dflash_train(tmp_path, drafter):
    cfg = dataclasses.replace(tiny_config(tmp_path, steps=12, lr=1e-2), drafter=drafter,
                              loss=LossWeights.dflash())
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, save_every=1000))
    trainer = Trainer(cfg, tiny_target())
    trainer.fit(progress=False)
    trainer.close()
    log = [json.loads(l) for l in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    assert all(np.isfinite(r["loss"]) for r in log)
    assert np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
    gamma = drafter["ttt_steps"] if drafter["kind"] == "eagle3" else drafter["block_size"]
    assert all(len(r["acceptance_per_position"]) == gamma and 1.0 <= r["expected_tau"] <= 1.0 + gamma for r in log)


def test_a_draft_vocabulary_is_picked_from_the_data_and_trains(tmp_path):
    """drafter.draft_vocab_size = N: the trainer drafts over the N most frequent response tokens of
    train_dir (here a folder of two datagen folders), trains, and exports the ids with the drafter."""
    from dspark_jax.drafters.checkpoint import load_drafter, save_drafter

    cfg = tiny_config(tmp_path, steps=12, lr=1e-2)
    write_tiny_data(str(tmp_path / "both" / "a"), n=24)
    write_tiny_data(str(tmp_path / "both" / "b"), n=8, seed=3)
    write_tiny_data(str(tmp_path / "held-out"), n=8, seed=4)
    cfg = dataclasses.replace(cfg, drafter={**cfg.drafter, "draft_vocab_size": 40},
                              data=dataclasses.replace(cfg.data, train_dir=str(tmp_path / "both"),
                                                       eval_dir=str(tmp_path / "held-out")),
                              run=dataclasses.replace(cfg.run, save_every=1000))
    trainer = Trainer(cfg, tiny_target(), progress=False)
    assert len(trainer.train_source) == 24 + 8
    assert len(trainer.dcfg.draft_vocab) == 40 and 0.5 < trainer.draft_vocab_coverage < 1.0
    from dspark_jax.data.pipeline import ShardSource

    counts = ShardSource(str(tmp_path / "held-out")).response_token_counts(64)
    assert trainer.draft_vocab_eval_coverage == pytest.approx(counts[list(trainer.dcfg.draft_vocab)].sum() / counts.sum())
    assert 0.3 < trainer.draft_vocab_eval_coverage < 1.0
    state = trainer.fit(progress=False)
    trainer.close()
    log = [json.loads(l) for l in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    assert all(np.isfinite(r["loss"]) for r in log)
    assert np.mean([r["loss"] for r in log[-3:]]) < np.mean([r["loss"] for r in log[:3]])
    save_drafter(str(tmp_path / "drafter"), trainer.dcfg, params_of(state))  # as python -m dspark_jax.train does
    assert load_drafter(str(tmp_path / "drafter")).config.draft_vocab == trainer.dcfg.draft_vocab


def test_init_from_drafter_starts_from_its_weights(tmp_path):
    from dspark_jax.core.errors import UserError
    from dspark_jax.drafters.checkpoint import save_drafter

    target = tiny_target()
    source = Trainer(tiny_config(tmp_path), target, progress=False)
    trained = params_of(source.init_state(seed=5))  # any weights other than a fresh seed-0 init
    save_drafter(str(tmp_path / "drafter"), source.dcfg, trained)
    fresh = params_of(source.init_state(seed=0))
    source.close()

    trainer = Trainer(tiny_config(tmp_path, init_from_drafter=str(tmp_path / "drafter")), target, progress=False)
    state = trainer.init_state(seed=0)
    started = params_of(state)
    jax.tree.map(np.testing.assert_array_equal, started, trained)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(started), jax.tree.leaves(fresh)))
    assert int(state.step) == 0
    trainer.close()

    # a draft vocabulary given to it after training: the run adopts it
    vocab = tuple(range(0, 64, 2))
    save_drafter(str(tmp_path / "small"), source.dcfg.replace(draft_vocab_size=32, draft_vocab=vocab), trained)
    trainer = Trainer(tiny_config(tmp_path, init_from_drafter=str(tmp_path / "small")), target, progress=False)
    assert trainer.dcfg.draft_vocab == vocab
    jax.tree.map(np.testing.assert_array_equal, params_of(trainer.init_state(seed=0)), trained)
    trainer.close()

    other = tiny_config(tmp_path, init_from_drafter=str(tmp_path / "drafter"))
    other = dataclasses.replace(other, drafter={**other.drafter, "markov_rank": 4})
    with pytest.raises(UserError, match="markov_rank differs"):
        Trainer(other, target, progress=False)
    with pytest.raises(UserError, match="set one"):
        tiny_config(tmp_path, init_from_drafter=str(tmp_path / "drafter"), init_from_target=True)
    with pytest.raises(UserError, match="no drafter checkpoint"):
        Trainer(tiny_config(tmp_path, init_from_drafter=str(tmp_path / "nowhere")), target, progress=False)


def test_a_sitting_stops_at_its_time_budget_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    """run.time_budget_s: the run stops after the step that leaves no room for another, with a
    checkpoint and a held-out evaluation there; started from a drafter, its step-0 record is that
    drafter's score on the same held-out batches; --resume goes on to optim.steps."""
    import itertools

    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.training import trainer as trainer_module
    from dspark_jax.training.trainer import lr_schedule

    target = tiny_target()
    source = Trainer(tiny_config(tmp_path), target, progress=False)
    save_drafter(str(tmp_path / "drafter"), source.dcfg, params_of(source.init_state(seed=5)))
    source.close()
    write_tiny_data(str(tmp_path / "eval"), n=8, seed=1)
    cfg = tiny_config(tmp_path, init_from_drafter=str(tmp_path / "drafter"), schedule="constant", warmup_steps=2)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, time_budget_s=35.0, save_every=1000, eval_batches=1),
                              data=dataclasses.replace(cfg.data, eval_dir=str(tmp_path / "eval")))
    clock = itertools.count(0.0, 10.0)  # the budget's clock reads 0 at the start, then 10 s more at each step
    monkeypatch.setattr(trainer_module.TimeBudget, "clock", staticmethod(lambda: next(clock)))
    first = Trainer(cfg, target, progress=False)
    stopped = first.fit(progress=False)
    first.close()
    log = [json.loads(l) for l in open(os.path.join(cfg.run.out_dir, "metrics.jsonl"))]
    assert int(stopped.step) == 3 < cfg.optim.steps  # 30 s spent: another 10 s step would pass 35 s
    assert log[0]["step"] == 0 and "eval_expected_tau" in log[0] and "loss" not in log[0]
    assert log[-1]["step"] == 3 and log[-1]["time_budget_spent"] and "eval_expected_tau" in log[-1]
    assert trainer_module._finished_steps(cfg.run.out_dir) == [3]
    monkeypatch.undo()
    unlimited = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, time_budget_s=0.0))
    second = Trainer(unlimited, target, progress=False)
    assert int(second.fit(resume=True, allow_schedule_change=True, progress=False).step) == cfg.optim.steps
    second.close()
    lr = lr_schedule(cfg.optim)
    assert [float(lr(i)) for i in (0, 1, 2, 100)] == pytest.approx([0.0, 1.5e-3, 3e-3, 3e-3])


def test_init_from_target_copies_the_last_target_layers(tmp_path):
    cfg = tiny_config(tmp_path, init_from_target=True)
    target = tiny_target()
    trainer = Trainer(cfg, target, progress=False)
    params = params_of(trainer.init_state())
    stacked = decoder.with_layout(target.params, TARGET_CFG, "stacked")["layers"]
    copied = [name for name in params["layers"] if name in stacked]
    assert len(copied) >= 6, copied
    for name in copied:
        np.testing.assert_array_equal(params["layers"][name], np.asarray(stacked[name][-1:]))
    random = params_of(Trainer(tiny_config(tmp_path / "r"), target, progress=False).init_state())
    assert sum(not np.array_equal(random["layers"][n], params["layers"][n]) for n in copied) >= 4
    trainer.close()
