"""The compile checks users run before they rent a slice: `train --plan --accelerator-type v5p-8
--compile` (the train and eval steps) and `decode --compile-for v5e-8` (the speculative engine's
programs, `serving.decode_compile`), compiled by the TPU compiler from shapes alone.

The programs are the Trainer's own (`trainer.TrainPrograms`: the same step, optimizer, shardings and
mesh axes), jitted over the slice's devices (`serving.tpu_compile.slice_devices`) and traced with
the TPU's choices (`core.platform.tracing_for`): the target in the stacked layer layout, in the
float32 that `train` loads it in, the drafter in fp32 with its compute-dtype copy. The compiler's
per-chip memory is the number that decides whether the config fits; the analytic plan is an
estimate beside it.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.core.platform import tracing_for
from dspark_jax.distributed import sharding
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.serving.tpu_compile import ProgramReport, TpuSlice, program_report, quiet_cache, slice_devices
from dspark_jax.training.config import TrainConfig

# The Cloud TPU slice each shipped TPU config (configs/<method>_<target>.yaml) is compiled for and
# documented with (configs/README.md), by target: the fewest v5p chips its mesh's tensor axis and the
# HBM margin allow (Qwen3-14B's tensor axis of 8 needs 8 chips: v5p-16, two hosts).
DOCUMENTED_SLICES = {"qwen3-4b": "v5p-8", "qwen3-8b": "v5p-8", "qwen3-14b": "v5p-16", "gemma3-12b": "v5p-8"}
SHIPPED_TPU_CONFIGS = tuple(f"{method}_{target}" for target in ("qwen3-4b", "qwen3-8b", "qwen3-14b")
                            for method in ("dspark", "dflash", "eagle3")) + ("dspark_gemma3-12b",)


def compile_train_programs(cfg: TrainConfig, tpu: TpuSlice, target: ModelConfig, target_name: str,
                           *, eval_step: bool = True) -> list[ProgramReport]:
    """The compiler's reports of the train step (and the eval step) of `cfg` on `tpu`."""
    import jax

    from dspark_jax.training.trainer import TrainPrograms

    devices = slice_devices(tpu)
    dcfg = cfg.drafter_config(target, target_name)
    dcfg.check_target(target, target_name)
    with tracing_for("tpu"), quiet_cache():
        mesh = sharding.make_mesh(*cfg.run.mesh, devices=devices)
        programs = TrainPrograms(cfg, dcfg, target, mesh, decoder.default_layout())
        state, target_params, batch = programs.abstract_inputs()
        reports = [program_report("train_step", programs.train_step.lower(state, target_params, batch).compile(), tpu)]
        if eval_step:
            eval_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=programs.eval_sharding),
                                      programs.abstract_batch(cfg.data.rows))
            compiled = programs.eval_step.lower(state.params, target_params, eval_batch).compile()
            reports.append(program_report("eval_step", compiled, tpu))
    return reports


def decode_check(settings) -> tuple[list[ProgramReport], TpuSlice, dict]:
    """`decode --compile-for`: (the reports, the slice, what was compiled) for a run with these
    `DecodeSettings`: the target's shapes from --target (a folder's config.json, a GGUF's metadata or
    a known name), the drafter's from --drafter (a drafter folder, or a training config whose
    drafter section and target give them), the engine's settings as that drafter resolves them."""
    import os

    from dspark_jax.checkpoints.registry import default_drafter_path
    from dspark_jax.core.errors import UserError
    from dspark_jax.drafters.checkpoint import read_drafter_config
    from dspark_jax.engine.decode_settings import DEFAULT_MAX_BATCH, with_drafter
    from dspark_jax.engine.sps import token_buckets
    from dspark_jax.serving.decode_compile import DecodeShapes, compile_decode_programs
    from dspark_jax.serving.target_shapes import target_model_config
    from dspark_jax.serving.tpu_compile import tpu_slice
    from dspark_jax.training.config import load_config

    tpu = tpu_slice(settings.compile_for)
    name, target, source = target_model_config(settings.target)
    drafter = default_drafter_path(name) if settings.drafter == "default" else settings.drafter
    if not drafter or drafter == "none":
        raise UserError("--compile-for compiles the speculative engine: give --drafter (a drafter folder or a "
                        "training config, e.g. configs/dspark_qwen3-8b.yaml)")
    if drafter.endswith((".yaml", ".yml")):
        dcfg = load_config(drafter, []).drafter_config(target, name)
    elif os.path.isdir(drafter):
        dcfg = read_drafter_config(drafter)
    else:
        raise UserError(f"--drafter {drafter}: not a drafter folder or a training config (.yaml)")
    dcfg.check_target(target, name)
    settings = with_drafter(settings, dcfg)
    rows = settings.max_batch or DEFAULT_MAX_BATCH
    buckets = None if settings.scheduler == "fixed" else token_buckets(rows * (settings.gamma + 1))
    shapes = DecodeShapes(rows=rows, prompt_tokens=settings.compile_prompt_tokens,
                          max_new_tokens=settings.max_new_tokens, gamma=settings.gamma, dtype=settings.dtype,
                          verify_buckets=buckets, greedy=settings.temperature == 0)
    reports = compile_decode_programs(tpu, target, dcfg, shapes)
    about = {"accelerator_type": tpu.accelerator_type, "topology": tpu.topology, "target": name,
             "target_shapes": source, "drafter": drafter, "scheduler": settings.scheduler,
             **dataclasses.asdict(shapes)}
    return reports, tpu, about
