"""`decode --compile-for v5e-8`: the speculative engine's programs compiled by the TPU compiler for a
Cloud TPU slice, from the shapes alone, before anyone rents it.

The programs are the engine's own jitted functions (`engine.speculative`) with the arguments the
tensor layout gives them (`engine.offline`): the target's weights and the drafter's split over one
(1, 1, chips) mesh by their logical axes, traced with the TPU's choices (`core.platform.tracing_for`),
and the decoding state as the prefill program hands it on (its output shardings). Per program: the
prefill of the first `rows` requests and of one admitted later, the plain target step (a run of
them is one program: reported per step), the draft, the verify of every token bucket the scheduler
may pick, and the whole round (draft and verify in one program, as the fixed scheduler runs it).
"""

from __future__ import annotations

import dataclasses

from dspark_jax.core.platform import tracing_for
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.models.config import ModelConfig
from dspark_jax.serving.tpu_compile import ProgramReport, TpuSlice, program_report, quiet_cache, slice_devices


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    """What the programs are compiled for."""

    rows: int  # request slots decoding together
    prompt_tokens: int  # each request's prompt
    max_new_tokens: int
    gamma: int
    dtype: str  # the weights' (and, on a TPU, the activations')
    verify_buckets: tuple[int, ...] | None  # None: only the padded [rows, gamma + 1] round
    greedy: bool = True


def compile_decode_programs(tpu: TpuSlice, tcfg: ModelConfig, dcfg: DrafterConfig, shapes: DecodeShapes,
                            on_program=None) -> list[ProgramReport]:
    """The compiler's report of each decoding program; `on_program(report)` as each one is done."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.distributed import sharding
    from dspark_jax.drafters import dspark
    from dspark_jax.drafters.checkpoint import drafter_logical_axes, param_shapes
    from dspark_jax.engine import speculative as spec
    from dspark_jax.engine.generate import pad_prompts
    from dspark_jax.models import decoder
    from dspark_jax.models.sampling import SamplingConfig

    tcfg = dataclasses.replace(tcfg, dtype=shapes.dtype)
    tokens, _, max_len = pad_prompts(tcfg, [[0] * shapes.prompt_tokens], shapes.max_new_tokens, slack=shapes.gamma + 1)
    width = tokens.shape[1]  # the prompt's length bucket
    cfg = spec.SpecConfig(gamma=shapes.gamma, sampling=SamplingConfig(0.0 if shapes.greedy else 1.0))
    statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    reports = []

    def report(name, lowered):
        compiled = lowered.compile()
        reports.append(program_report(name, compiled, tpu))
        if on_program is not None:
            on_program(reports[-1])
        return compiled

    with tracing_for("tpu"), quiet_cache():
        mesh = sharding.make_mesh(tensor=-1, devices=slice_devices(tpu))
        whole = NamedSharding(mesh, PartitionSpec())
        placed = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
        layout = decoder.default_layout()
        target = jax.eval_shape(lambda k: decoder.with_layout(decoder.init_params(tcfg, k), tcfg, layout),
                                jax.random.key(0))
        target = placed(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(shapes.dtype)), target),
                        sharding.param_shardings(mesh, tcfg, layout))
        drafter = jax.eval_shape(lambda: jax.tree.map(lambda s: jnp.zeros(s, jnp.float32), param_shapes(dcfg),
                                                      is_leaf=lambda x: isinstance(x, tuple)))
        if dcfg.kind == "dspark":
            drafter = jax.eval_shape(lambda p, t: dspark.with_draft_head(dspark.decoding_layout(p, dcfg, shapes.dtype),
                                                                         dcfg, t, tcfg), drafter, target)
        else:
            drafter = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.dtype(shapes.dtype)), drafter)
        drafter = placed(drafter, sharding.tree_shardings(mesh, drafter_logical_axes(drafter),
                                                          jax.tree.map(lambda a: tuple(a.shape), drafter)))
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=whole)
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=whole)  # noqa: E731

        def prefill(rows):
            return spec.spec_prefill.lower(target, drafter, ints(rows, width), ints(rows), ints(rows), key, None,
                                           max_len=max_len, **statics)

        first = report(f"prefill {shapes.rows} x {width}", prefill(shapes.rows))
        if shapes.rows > 1:
            report(f"prefill 1 x {width}", prefill(1))
        state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), first.out_info)
        temps = jax.ShapeDtypeStruct((shapes.gamma,), jnp.float32, sharding=whole)  # STS, one per draft position
        report("plain step", spec.spec_plain.lower(target, drafter, state, ints(), **statics))
        report("round", spec.spec_round.lower(target, drafter, state, temps, **statics))
        if shapes.verify_buckets:
            draft = report("draft", spec.spec_draft.lower(target, drafter, state, temps, **statics))
            drafted = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), draft.out_info)
            for n in shapes.verify_buckets:
                report(f"verify {n} tokens", spec.spec_verify.lower(target, drafter, state, drafted, bucket=n, **statics))
    return reports
