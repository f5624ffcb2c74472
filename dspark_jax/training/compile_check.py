"""`train --plan --accelerator-type v5p-8 --compile`: the train and eval steps compiled by the TPU
compiler for the slice, from shapes alone, before anyone rents it.

The programs are the Trainer's own (`trainer.TrainPrograms`: the same step, optimizer, shardings and
mesh axes), jitted over the slice's devices (`serving.tpu_compile.slice_devices`) and traced with
the TPU's choices (`core.platform.tracing_for`): the target in the stacked layer layout, in the
float32 that `train` loads it in, the drafter in fp32 with its compute-dtype copy. The compiler's
per-chip memory is the number that decides whether the config fits; the analytic plan is an
estimate beside it.
"""

from __future__ import annotations

from dspark_jax.core.platform import tracing_for
from dspark_jax.distributed import sharding
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.serving.tpu_compile import ProgramReport, TpuSlice, program_report, quiet_cache, slice_devices
from dspark_jax.training.config import TrainConfig


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
