"""The training plan (dspark_jax/training/plan.py): exact parameter counts and sharded bytes against
the real initialised drafter and the trainer's own shardings, hand-computed FLOPs, and plausible
Qwen3-8B numbers on v5p-8 / v6e-8 (relationships, not magic numbers)."""

import dataclasses
import importlib.util
import json
import os
import shlex

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import train
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import sharding
from dspark_jax.drafters import dspark, eagle3
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.training import plan as planmod
from dspark_jax.training.compile_check import DOCUMENTED_SLICES, SHIPPED_TPU_CONFIGS
from dspark_jax.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig, load_config
from dspark_jax.drafters.checkpoint import drafter_logical_axes
from dspark_jax.training.trainer import make_optimizer, make_train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_8B = os.path.join(ROOT, "configs", "dspark_qwen3-8b.yaml")

# A tiny Qwen3-shaped target: every dimension a tensor axis of 2 or 4 divides, none that 3 does.
TARGET = ModelConfig(family="qwen3", vocab_size=128, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=16, intermediate_size=128, max_position_embeddings=256, qk_norm=True)
DRAFTER = dict(kind="dspark", num_layers=2, block_size=4, head="markov", markov_rank=8, confidence=True,
               mask_token_id=3, target_layer_ids=(0, 1))


def tiny(mesh=(-1, 1, 1), rows=4, accum=1, compute="bfloat16", drafter=None, **data) -> TrainConfig:
    data = dict(dict(train_dir="data/x", rows=rows, seq_len=32, blocks_per_row=4, anchors_per_seq=2), **data)
    return TrainConfig(target="tiny", drafter=dict(DRAFTER, **(drafter or {})), data=DataConfig(**data),
                       optim=OptimConfig(grad_accum=accum), run=RunConfig(mesh=mesh, compute_dtype=compute))


def leaves_size(tree) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def test_param_counts_are_the_initialised_drafters():
    cfg = tiny()
    p = planmod.training_plan(cfg, 1, TARGET)
    dcfg = cfg.drafter_config(TARGET, "tiny")
    real = dspark.init_drafter_params(dcfg, jax.random.key(0))
    assert p["drafter"]["params"] == leaves_size(real)
    d, f, q, kv, V, r, L = 64, 128, 64, 32, 128, 8, 2
    layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f + 2 * 16  # norms, q k v o, gate up down, q/k norms
    by_hand = 2 * d * d + 2 * d + L * layer + 2 * V * r + (d + r) + 1  # fc, hidden/final norm, layers, Markov, confidence
    assert p["drafter"]["params"] == by_hand
    assert p["target"]["params"] == leaves_size(decoder.init_params(TARGET, jax.random.key(0)))
    # Eagle3: the same, through its own initialiser
    e3 = tiny(drafter=dict(kind="eagle3", num_layers=1, head="none", markov_rank=0, confidence=False))
    e3_real = eagle3.init_eagle3_params(e3.drafter_config(TARGET, "tiny"), jax.random.key(0))
    assert planmod.training_plan(e3, 1, TARGET)["drafter"]["params"] == leaves_size(e3_real)


def test_bytes_on_one_device_by_hand():
    n_draft = planmod.training_plan(tiny(), 1, TARGET)["drafter"]["params"]
    n_target = planmod.training_plan(tiny(), 1, TARGET)["target"]["params"]
    mem = planmod.training_plan(tiny(), 1, TARGET)["memory_per_device"]
    assert mem["drafter_params"] == 4 * n_draft  # fp32 master weights
    assert mem["optimizer_state"] == 2 * 4 * n_draft  # AdamW: two fp32 moments
    assert mem["gradients"] == 4 * n_draft
    assert mem["drafter_params_compute"] == 2 * n_draft  # the bf16 copy the step computes with
    assert mem["target_params"] == 4 * n_target and mem["target_params_compute"] == 2 * n_target
    assert mem["batch"] == 4 * (4 * 4 * 32 + 4 * 5)  # 4 rows: 4 int32 [32] fields, 4 blocks' start + valid
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    accum = planmod.training_plan(tiny(accum=2), 1, TARGET)["memory_per_device"]
    assert accum["gradients"] == 2 * mem["gradients"]  # the scan's running sum + a micro-batch's gradients
    assert accum["activations"] == mem["activations"]  # one micro-batch at a time
    f32 = planmod.training_plan(tiny(compute="float32"), 1, TARGET)["memory_per_device"]
    assert f32["drafter_params_compute"] == 0 and f32["target_params_compute"] == 0
    bf16_target = planmod.training_plan(tiny(), 1, TARGET, target_dtype="bfloat16")["memory_per_device"]
    assert bf16_target["target_params"] == 2 * n_target and bf16_target["target_params_compute"] == 0


def test_flops_and_tokens_by_hand():
    cfg = tiny(rows=4, accum=2)
    p = planmod.training_plan(cfg, 1, TARGET)
    rows, S, NB, g = 8, 32, 4, 4
    d, f, q, kv, V, r, L, m = 64, 128, 64, 32, 128, 8, 2, 2
    layer_matmul = d * q + 2 * d * kv + q * d + 3 * d * f
    fl = p["flops_per_step"]
    assert p["batch"]["tokens_per_step"] == rows * S and p["batch"]["block_slots_per_step"] == rows * NB * g
    assert fl["drafter_layers"] == 6 * L * layer_matmul * rows * NB * g  # the 6 x params x tokens rule
    assert fl["drafter_attention"] == 3 * L * 4 * (NB * g) * (S + g) * q * rows
    assert fl["drafter_lm_head"] == 4 * rows * NB * g * d * V and fl["target_lm_head"] == 2 * rows * NB * g * d * V
    assert fl["drafter_head"] == 6 * rows * NB * g * r * V
    assert fl["drafter_fc"] == 4 * rows * S * m * d * d
    C = decoder.PACKED_ATTENTION_BLOCK
    assert fl["target_attention"] == rows * TARGET.num_layers * 2 * S * (S + C) * q  # by blocks: S (S + C) / 2 scores
    assert fl["target_matmuls"] == rows * TARGET.num_layers * 2 * S * layer_matmul
    target_forward = fl["target_matmuls"] + fl["target_attention"]
    assert fl["total"] == sum(v for k, v in fl.items() if k != "total")
    cached = planmod.training_plan(tiny(rows=4, accum=2, feature_cache="cache/x"), 1, TARGET)
    assert cached["features"] == "cache" and cached["flops_per_step"]["target_matmuls"] == 0
    assert cached["flops_per_step"]["total"] == fl["total"] - target_forward
    # all micro-batches' cached features sit on the device: 2 (m + 1) d bytes per token
    assert cached["memory_per_device"]["batch"] - p["memory_per_device"]["batch"] == rows * S * 2 * (m + 1) * d
    assert cached["memory_per_device"]["activations"] < p["memory_per_device"]["activations"]


def per_device_elements(mesh, axes, shapes) -> int:
    shards = sharding.tree_shardings(mesh, axes, shapes)
    return sum(int(np.prod(s.shard_shape(shape))) for s, shape in
               zip(jax.tree.leaves(shards), jax.tree.leaves(shapes, is_leaf=sharding.is_spec)))


@pytest.mark.needs_devices(4)
@pytest.mark.parametrize("mesh", [(1, 1, 4), (1, 2, 2), (2, 2, 1), (1, 4, 1), (4, 1, 1)])
def test_sharded_bytes_are_the_trainers_shardings(mesh):
    """The plan's per-device sizes equal the shard shapes of the NamedShardings the Trainer builds."""
    cfg = tiny(mesh=mesh)
    dcfg = cfg.drafter_config(TARGET, "tiny")
    p = planmod.training_plan(cfg, 4, TARGET)
    real_mesh = sharding.make_mesh(*mesh)
    abstract = jax.eval_shape(lambda k: dspark.init_drafter_params(dcfg, k), jax.random.key(0))
    shapes = jax.tree.map(lambda a: a.shape, abstract)
    assert p["drafter"]["params_per_device"] == per_device_elements(real_mesh, drafter_logical_axes(abstract), shapes)
    assert p["memory_per_device"]["target_params"] == 4 * per_device_elements(
        real_mesh, decoder.param_logical_axes(TARGET), decoder.param_shapes(TARGET))
    # the optimizer state, sharded as Trainer.__init__ shards it
    p_sh = sharding.tree_shardings(real_mesh, drafter_logical_axes(abstract), shapes)
    optimizer = make_optimizer(cfg)
    opt = jax.eval_shape(optimizer.init, abstract)
    replicated = NamedSharding(real_mesh, PartitionSpec())
    opt_sh = optax.tree_utils.tree_map_params(optimizer, lambda _, s: s, opt, p_sh,
                                              transform_non_params=lambda _: replicated)
    opt_bytes = sum(int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
                    for a, s in zip(jax.tree.leaves(opt), jax.tree.leaves(opt_sh))
                    if np.issubdtype(a.dtype, np.floating))  # not the int32 step counters
    assert p["memory_per_device"]["optimizer_state"] == opt_bytes
    assert p["batch"]["rows_per_device"] == 4 // (mesh[0] * mesh[1])


def test_sharding_shrinks_bytes_as_the_axes_say():
    one = planmod.training_plan(tiny(), 1, TARGET)
    t4 = planmod.training_plan(tiny(mesh=(1, 1, 4)), 4, TARGET)
    f4 = planmod.training_plan(tiny(mesh=(1, 4, 1)), 4, TARGET)
    d4 = planmod.training_plan(tiny(mesh=(4, 1, 1)), 4, TARGET)
    for name in ("drafter_params", "optimizer_state", "gradients", "target_params"):
        base = one["memory_per_device"][name]
        assert d4["memory_per_device"][name] == base  # data parallel replicates the weights
        assert base / 4 <= t4["memory_per_device"][name] < base  # norms, fc and the confidence head stay whole
        assert base / 4 <= f4["memory_per_device"][name] < base
    # the target's big matrices all have a tensor-sharded axis: close to a quarter
    assert t4["memory_per_device"]["target_params"] < 0.3 * one["memory_per_device"]["target_params"]
    # rows split over the batch axes (data, fsdp), never over tensor
    assert d4["batch"]["rows_per_device"] == f4["batch"]["rows_per_device"] == 1
    assert t4["batch"]["rows_per_device"] == 4
    assert d4["memory_per_device"]["activations"] == one["memory_per_device"]["activations"] / 4
    assert t4["memory_per_device"]["activations"] < one["memory_per_device"]["activations"]
    # FLOPs per step do not depend on the mesh
    assert t4["flops_per_step"] == one["flops_per_step"] == d4["flops_per_step"]
    # an axis that divides nothing replicates (3 divides no dimension of TARGET)
    t3 = planmod.training_plan(tiny(mesh=(1, 1, 3)), 3, TARGET)
    assert t3["memory_per_device"]["target_params"] == one["memory_per_device"]["target_params"]
    assert t3["drafter"]["params_per_device"] == one["drafter"]["params_per_device"]
    # rows that do not divide over the batch axes: the trainer replicates the batch
    odd = planmod.training_plan(tiny(mesh=(4, 1, 1), rows=3), 4, TARGET)
    assert odd["batch"]["batch_replicated"] and odd["batch"]["rows_per_device"] == 3


def test_mesh_resolution_follows_make_mesh():
    assert planmod.resolve_mesh((-1, 1, 4), 4) == (1, 1, 4)
    assert planmod.resolve_mesh((-1, 1, 4), 8) == (2, 1, 4)
    with pytest.raises(Exception, match="needs 4 devices, 2 available"):
        planmod.resolve_mesh((-1, 1, 4), 2)
    assert planmod.resolve_mesh((2, -1, 1), 8) == (2, 4, 1)
    assert planmod.resolve_mesh((1, 1, 1), 8) == (1, 1, 1)
    p = planmod.training_plan(tiny(mesh=(2, 1, 1)), 8, TARGET)
    assert p["devices_used"] == 2 and p["num_devices"] == 8


def test_tpu_slices():
    from dspark_jax.serving.tpu_compile import tpu_slice

    chips = lambda t: (tpu_slice(t).chips, tpu_slice(t).key, tpu_slice(t).topology)  # noqa: E731
    assert chips("v5p-8") == (4, "tpu-v5p", "v5p:2x2x1")  # v5p names count TensorCores, two per chip
    assert chips("v5p-32") == (16, "tpu-v5p", "v5p:2x2x4")
    assert chips("v5p-128") == (64, "tpu-v5p", "v5p:4x4x4") and chips("v5p-512")[2] == "v5p:4x8x8"
    assert chips("v6e-8") == (8, "tpu-v6e", "v6e:2x4")  # v6e names count chips
    assert chips("v5litepod-16") == (16, "tpu-v5e", "v5e:4x4")
    assert chips("v5litepod-256") == (256, "tpu-v5e", "v5e:16x16")
    assert chips("v4-32") == (16, "tpu-v4", "v4:2x2x4")
    for bad, message in (("v9x-8", "unknown TPU accelerator type"), ("v5p-7", "multiples of 2"),
                         ("v5litepod-12", "not 12"), ("v5p-12", "not 6")):
        with pytest.raises(UserError, match=message):
            tpu_slice(bad)


def qwen3_plan(accelerator_type: str, *overrides: str, **kw) -> dict:
    from dspark_jax.serving.tpu_compile import tpu_slice

    tpu = tpu_slice(accelerator_type)
    return planmod.training_plan(load_config(QWEN3_8B, list(overrides)), tpu.chips, accelerator=tpu.key, **kw)


V5P = ()  # launch/README.md's v5p-8 settings: the config as shipped (4 rows x 128 micro-batches)
V6E = ("data.rows=2", "optim.grad_accum=256", "run.mesh=[1,1,8]")  # and v6e-8's


def test_qwen3_8b_is_plausible_on_v5p_8_and_v6e_8():
    p = qwen3_plan("v5p-8", "data.rows=512", "optim.grad_accum=1")  # the step's 512 rows in one micro-batch
    assert p["target"]["shapes_from"].startswith("the Qwen3-8B shapes")  # no checkpoint on this machine
    assert 8.0e9 < p["target"]["params"] < 8.4e9  # Qwen3-8B: 8.19B with its untied LM head
    assert 1.0e9 < p["drafter"]["params"] < 1.3e9  # 5 layers shaped like the target's, fc, Markov rank 256
    assert p["mesh"] == {"data": 1, "fsdp": 1, "tensor": 4} and p["devices_used"] == 4
    mem = p["memory_per_device"]
    # the fp32 target over 4-way tensor parallelism: about a quarter of 8.19B x 4 bytes
    assert 0.24 < mem["target_params"] / (4 * p["target"]["params"]) < 0.27
    assert not p["accelerator"]["fits"]  # 512 rows of 4096 tokens do not fit: hence grad_accum
    assert p["batch"]["tokens_per_step"] == 512 * 4096
    v5p = qwen3_plan("v5p-8", *V5P)
    assert v5p["accelerator"]["fits"] and v5p["batch"]["rows_per_step"] == 512
    assert v5p["memory_per_device"]["total"] < 0.75 * 95e9  # room left for XLA's own buffers
    assert v5p["accelerator"]["max_rows_per_device"] >= 4
    assert v5p["flops_per_step"] == p["flops_per_step"]  # the same global batch, the same work
    v6e = qwen3_plan("v6e-8", *V6E)
    assert v6e["mesh"] == {"data": 1, "fsdp": 1, "tensor": 8}
    assert v6e["accelerator"]["fits"] and v6e["memory_per_device"]["total"] < 0.75 * 32e9
    # twice the tensor axis, half the target (up to the norms, which stay whole)
    assert 0.5 < v6e["memory_per_device"]["target_params"] / v5p["memory_per_device"]["target_params"] < 0.501
    # 8 chips of twice the peak: a quarter of the step time (same FLOPs, same assumed MFU)
    assert v6e["flops_per_step"] == v5p["flops_per_step"]
    assert v6e["accelerator"]["step_seconds"] == pytest.approx(v5p["accelerator"]["step_seconds"] / 4)
    # the default mesh on v6e-8 (2-way data x 4-way tensor) with one row per device also fits
    assert qwen3_plan("v6e-8", "data.rows=2", "optim.grad_accum=256")["accelerator"]["fits"]
    # online features: the frozen target's forward is the larger part of a step
    fl = v5p["flops_per_step"]
    target_forward = fl["target_matmuls"] + fl["target_attention"]
    assert target_forward > fl["total"] - target_forward
    assert 5e15 < fl["total"] - target_forward < 5e16  # the drafter: ~6 x 1.1B x 1.8M block slots plus heads


def test_launch_readme_quotes_the_plan():
    """launch/README.md shows format_plan's output for its two settings verbatim."""
    readme = open(os.path.join(ROOT, "launch", "README.md")).read()
    for accelerator_type, overrides in (("v5p-8", V5P), ("v6e-8", V6E)):
        text = planmod.format_plan(qwen3_plan(accelerator_type, *overrides))
        assert text in readme, f"launch/README.md lacks the plan for {accelerator_type}:\n{text}"
        command = shlex.join(["python", "-m", "dspark_jax.train", "--config", "configs/dspark_qwen3-8b.yaml",
                              "--plan", "--accelerator-type", accelerator_type, *overrides])
        assert command in readme


def test_target_shapes_without_weights(tmp_path):
    name, cfg, source = planmod.target_model_config("smollm2-135m")  # GGUF metadata only
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (576, 30, 49152, True)
    assert "GGUF metadata" in source
    folder = tmp_path / "Qwen3-8B"  # a folder holding only config.json wins over the shape table
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1000, "max_position_embeddings": 4096, "tie_word_embeddings": False}))
    name, cfg, source = planmod.target_model_config(str(folder))
    assert (name, cfg.hidden_size, cfg.num_layers) == ("Qwen3-8B", 256, 8) and source.endswith("config.json")
    name, cfg, source = planmod.target_model_config(str(tmp_path / "elsewhere" / "Qwen3-8B"))  # not there: the table
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size) == (4096, 36, 12288)
    with pytest.raises(Exception, match="cannot read the shapes of target"):
        planmod.target_model_config(str(tmp_path / "mystery-model"))


def test_cli(capsys):
    assert train.main(["--config", QWEN3_8B, "--plan", "--accelerator-type", "v5p-8", *V5P]) == 0
    out = capsys.readouterr().out
    assert "mesh data=1 fsdp=1 tensor=4 on 4 of 4 devices" in out and "fits" in out
    assert train.main(["--config", QWEN3_8B, "--plan", "--devices", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["mesh"] == {"data": 2, "fsdp": 1, "tensor": 4} and "accelerator" not in p
    assert train.main(["--config", QWEN3_8B, "--plan", "--accelerator-type", "v9-8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown TPU accelerator type") and err.count("\n") == 1
    assert train.main(["--config", QWEN3_8B, "--plan", "--devices", "2"]) == 2  # [-1, 1, 4] needs 4
    assert "needs 4 devices, 2 available" in capsys.readouterr().err


def test_cli_reads_a_target_config(tmp_path, capsys):
    hf = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert train.main(["--config", QWEN3_8B, "--plan", "--accelerator-type", "v5p-8", "--target-config",
                         str(tmp_path / "config.json"), "--json", *V5P]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["target"]["shapes_from"] == "given"
    assert p["memory_per_device"] == qwen3_plan("v5p-8", *V5P)["memory_per_device"]  # the same shapes as the table


# ---- against XLA's own accounting of the compiled train step (CPU)

SMALL = ModelConfig(family="qwen3", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                    head_dim=32, intermediate_size=512, max_position_embeddings=4096, qk_norm=True)


def compiled_step(cfg: TrainConfig, target: ModelConfig, layout: str, sharded: bool = False):
    """The trainer's jitted step for cfg (`TrainPrograms`, what Trainer.__init__ runs), compiled from
    shapes alone (nothing allocated); `sharded`: with its in/out shardings on cfg.run.mesh over this
    process's devices, else jitted plainly on one device."""
    from dspark_jax.training.trainer import TrainPrograms

    programs = TrainPrograms(cfg, cfg.drafter_config(target, "t"), target, sharding.make_mesh(*cfg.run.mesh), layout)
    state, target_params, batch = programs.abstract_inputs()
    if not sharded:
        plain = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
        step = make_train_step(cfg, programs.dcfg, target, programs.optimizer)
        return jax.jit(step).lower(plain(state), plain(target_params), plain(batch)).compile()
    return programs.train_step.lower(state, target_params, batch).compile()


EAGLE3 = dict(kind="eagle3", num_layers=1, head="none", markov_rank=0, confidence=False, ttt_steps=3)


@pytest.mark.parametrize("cache,drafter", [(None, {}), ("cache/x", {}), (None, EAGLE3),
                                           (None, dict(EAGLE3, ttt_at_anchors=True))],
                         ids=["dspark-online", "dspark-cached", "eagle3", "eagle3-at-anchors"])
def test_flops_agree_with_xlas_count(cache, drafter):
    """XLA counts a scan's body once, so: one draft layer, the target in the per-layer (unrolled)
    layout, one micro-batch, and the target's attention (a scan over block pairs) left out. Then the
    plan's FLOPs are XLA's to within a few percent."""
    cfg = tiny(rows=4, compute="float32", seq_len=256, blocks_per_row=32, anchors_per_seq=8, feature_cache=cache,
               drafter=dict(dict(num_layers=1), **drafter))
    cost = compiled_step(cfg, SMALL, "per_layer").cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
    plan = planmod.training_plan(cfg, 1, SMALL)["flops_per_step"]
    assert (plan["target_matmuls"] == 0) == bool(cache)
    assert (plan["target_attention"] == 0) == bool(cache)
    assert plan["total"] - plan["target_attention"] == pytest.approx(xla, rel=0.05)



@pytest.mark.needs_devices(4)
def test_qwen3_8b_v5p_setting_against_xla():
    """The walkthrough's v5p-8 step (Qwen3-8B, 4-way tensor parallel, 4 rows) compiled for 4 CPU
    devices: the step's arguments per device are exactly the plan's persistent state, and XLA's
    temporary buffers are the size of the plan's estimate (XLA:CPU's; the TPU compiler differs).
    Measured: 54.1 GB of buffers against the plan's 41.3 GB (the target's attention by blocks);
    on one device, one row, the plan is on the high side (55.6 against 44.6 GB)."""
    cfg = load_config(QWEN3_8B, ["data.rows=4", "optim.grad_accum=1"])  # the accumulation scan aside: one micro-batch
    name, target, _ = planmod.target_model_config(cfg.target)
    compiled = compiled_step(cfg, target, "stacked", sharded=True)
    mem = planmod.training_plan(cfg, 4, target)["memory_per_device"]
    analysis = compiled.memory_analysis()
    persistent = mem["drafter_params"] + mem["optimizer_state"] + mem["target_params"] + mem["batch"]
    assert analysis.argument_size_in_bytes == persistent + 3 * 4  # + the int32 step counters (state, AdamW, schedule)
    estimate = mem["activations"] + mem["gradients"] + mem["drafter_params_compute"] + mem["target_params_compute"]
    assert 0.75 * analysis.temp_size_in_bytes < estimate < 1.3 * analysis.temp_size_in_bytes


# ---- the TPU compiler's verdict (serving/tpu_compile.py, training/compile_check.py)

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason=f"libtpu is not installed: pip install 'jax[tpu]=={jax.__version__}' (the README's test command does)")


@needs_libtpu
@pytest.mark.parametrize("accelerator_type,mesh", [("v5p-8", (-1, 1, 2)), ("v5litepod-16", (-1, 1, 1))],
                         ids=["one-host", "four-hosts"])
def test_train_step_compiles_for_a_tpu_slice(accelerator_type, mesh, tmp_path, capsys):
    """`train --plan --accelerator-type ... --compile` on a tiny config: the TPU compiler's per-chip
    memory of the train and eval steps, their collectives (the data axis all-reduces the gradients),
    and the plan's error against it; v5litepod-16's 16 chips belong to 4 processes (hosts)."""
    from dspark_jax.serving.tpu_compile import slice_devices, tpu_slice

    tpu = tpu_slice(accelerator_type)
    devices = slice_devices(tpu)
    assert len(devices) == tpu.chips and all(d.platform == "tpu" for d in devices)
    assert len({d.process_index for d in devices}) == (1 if accelerator_type == "v5p-8" else 4)
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size,
        num_hidden_layers=TARGET.num_layers, num_attention_heads=TARGET.num_heads,
        num_key_value_heads=TARGET.num_kv_heads, head_dim=TARGET.head_dim, intermediate_size=TARGET.intermediate_size,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)))
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps(dict(
        target="tiny", drafter=DRAFTER, data=dict(train_dir="data/x", rows=16, seq_len=64, blocks_per_row=4,
                                                  anchors_per_seq=2),
        run=dict(mesh=list(mesh), compute_dtype="bfloat16"))))
    assert train.main(["--config", str(config), "--plan", "--accelerator-type", accelerator_type,
                       "--target-config", str(tmp_path / "config.json"), "--compile", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    compiled = found["compiled"]
    assert compiled["topology"] == tpu.topology
    step, loss = compiled["programs"]
    assert (step["name"], loss["name"]) == ("train_step", "eval_step")
    for program in (step, loss):
        assert program["fits"] and 0 < program["per_chip_bytes"] < 1e9 and program["argument_bytes"] > 0
        assert program["flops"] > 0
    assert step["collectives"].get("all-reduce", 0) >= 1  # the gradients' mean over the data axis
    assert step["per_chip_bytes"] > loss["per_chip_bytes"]  # AdamW's moments and the gradients
    assert compiled["plan_error"] == pytest.approx(found["memory_per_device"]["total"] / step["per_chip_bytes"] - 1)
    text = planmod.format_plan(found)  # what the command prints without --json
    assert f"compiled by the TPU compiler for {accelerator_type} ({tpu.topology}" in text
    assert "the plan's total against the compiled train step: " in text


@needs_libtpu
def test_micro_batches_stay_split_over_the_data_axis():
    """With gradient accumulation every micro-batch is spread over the data axis as the batch is: a
    step of 2 micro-batches of 8 rows costs a chip of v5p-8's 4-way data axis what one micro-batch of
    16 rows does (when a micro-batch was a block of consecutive rows, on two of the four chips, XLA
    ran it on all four: 1.33x the flops here; with 4 micro-batches of 4 rows, 2x, and on Qwen3-4B
    34 GB more per chip than the plan)."""
    from dspark_jax.training.compile_check import compile_train_programs
    from dspark_jax.serving.tpu_compile import tpu_slice

    def step(rows, accum):
        cfg = tiny(mesh=(-1, 1, 1), rows=rows, accum=accum, seq_len=64)
        return compile_train_programs(cfg, tpu_slice("v5p-8"), TARGET, "tiny", eval_step=False)[0]

    assert step(8, 2).flops == pytest.approx(step(16, 1).flops, rel=0.05)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED_TPU_CONFIGS)
def test_every_shipped_tpu_config_fits_its_slice(name):
    """Each shipped TPU config, as shipped, compiled by the TPU compiler for its documented slice
    (configs/README.md): the train and eval steps fit with 10% of HBM to spare, and the analytic plan's
    total is within 10% of the compiler's. 2-5 minutes a config on a 2-core CPU."""
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    found = planmod.plan_for(cfg, accelerator_type=DOCUMENTED_SLICES[name.split("_", 1)[1]], compile=True)
    for program in found["compiled"]["programs"]:
        assert program["fits"], (program["name"], program["per_chip_bytes"] / 1e9)
    assert abs(found["compiled"]["plan_error"]) <= 0.10


@needs_libtpu
def test_a_program_traced_for_tpu_takes_no_cpu_path():
    """A bf16 decode pass traced in this CPU process for TPU devices is the TPU's program: none of
    the CPU's choices (the per-layer layout, fp32 activations, bf16 weights moved as uint16 bits,
    our matmul kernel). Traced without `tracing_for`, the same lowering moves the weights as bits:
    the check sees a CPU path where there is one."""
    import jax.numpy as jnp

    from dspark_jax.core.platform import tracing_for
    from dspark_jax.serving.tpu_compile import slice_devices, tpu_slice

    cfg = dataclasses.replace(SMALL, num_layers=2, dtype="bfloat16")
    mesh = sharding.make_mesh(1, 1, -1, devices=slice_devices(tpu_slice("v5p-8")))

    def lowered(layout: str) -> str:
        params = jax.eval_shape(lambda k: decoder.with_layout(decoder.init_params(cfg, k), cfg, layout), jax.random.key(0))
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
                              sharding.param_shardings(mesh, cfg, layout))
        tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec()))

        def decode_step(p, tokens):
            cache = decoder.init_cache(cfg, 1, 64)
            hidden, _, _ = decoder.forward(p, cfg, tokens, cache, jnp.ones((1,), jnp.int32))
            return decoder.logits(p, cfg, hidden)

        return jax.jit(decode_step).lower(params, tokens).as_text()

    with tracing_for("tpu"):
        assert decoder.default_layout() == "stacked" and decoder.activation_dtype("bfloat16") == "bfloat16"
        tpu_text = lowered(decoder.default_layout())
    assert "ui16" not in tpu_text and "dspark_matmul" not in tpu_text
    cpu_text = lowered("stacked")  # this process's choices: the CPU's
    assert "ui16" in cpu_text


@needs_libtpu
def test_plan_total_is_the_tpu_compilers():
    """The plan's memory per chip (arguments, temporaries, the allocation slack) against the TPU
    compiler's for the same step on v5p-8's four chips, data-parallel, at small shapes: within 10%
    (-3% when written; the shipped configs on their slices: `-m slow -k shipped`)."""
    from dspark_jax.serving.tpu_compile import tpu_slice
    from dspark_jax.training.compile_check import compile_train_programs

    cfg = tiny(rows=4, compute="bfloat16", seq_len=512, blocks_per_row=64, anchors_per_seq=8, mesh=(-1, 1, 1))
    step = compile_train_programs(cfg, tpu_slice("v5p-8"), SMALL, "small", eval_step=False)[0]
    plan = planmod.training_plan(cfg, 4, SMALL)["memory_per_device"]
    assert plan["drafter_params"] + plan["optimizer_state"] + plan["target_params"] + plan["batch"] == \
        pytest.approx(step.argument_bytes, rel=0.01)
    assert plan["total"] == pytest.approx(step.argument_bytes + step.temp_bytes, rel=0.10)
