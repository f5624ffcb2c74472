"""What one training step of a config needs per device, from shapes alone (no weights loaded).

`training_plan(cfg, num_devices, target)` resolves the config's mesh for `num_devices` (a -1 axis
takes the remaining devices, as `sharding.make_mesh` does), shards every parameter with the same
table the trainer uses (`sharding.LOGICAL_TO_MESH` through `sharding.logical_spec`: the drafter's
axes from `drafters.checkpoint.drafter_logical_axes`, the target's from `decoder.param_logical_axes`; a
dimension the mesh axis does not divide stays replicated) and adds up, per device:

* drafter params: fp32 master weights (both drafter kinds are initialised in float32);
* optimizer state: optax AdamW (`trainer.make_optimizer`) keeps two fp32 moments per parameter,
  sharded like the parameter (the clip and the step counters are scalars);
* gradients: fp32, one copy (two with `optim.grad_accum > 1`: the running sum in the scan carry
  and the micro-batch's own);
* drafter params in `run.compute_dtype`: the step casts them (bf16 on TPU) and keeps the copy for
  the backward pass;
* the frozen target: `train` loads it in float32 (`registry.load_target`'s default) and the
  trainer puts ALL of it on the devices, sharded like a decoding target (stacked layer layout, the
  accelerator default), whether or not the features come from a cache: the drafter uses the
  target's embedding and LM head in every step. The step casts it to the compute dtype
  (`trainer.target_feature_inputs`): a second, transient copy;
* the batch: the int32 token-level fields [rows, seq_len], plus, with `data.feature_cache`, the
  cached bf16 features of ALL `grad_accum` micro-batches (2 (m + 1) d bytes per token);
* activations of one micro-batch (the gradient accumulation is a scan: one micro-batch at a time).
  An ESTIMATE, per row of the micro-batch on this device: saved for the backward pass: the fc
  input and output, per draft layer the context keys/values, the block tokens' residual stream,
  q/k/v, the attention output, the MLP's three intermediate-size tensors and the attention
  probabilities [heads, blocks x gamma, seq_len + gamma] (fp32 softmax plus the compute-dtype copy
  the value einsum reads) with `run.remat=none`, the layers' weight products alone with "dots",
  each layer's input alone with "full" (a layer then rebuilds in its backward pass: a transient);
  plus the largest transient of the step: the target's forward pass (online features: the fp32 taps
  and last hidden state, one layer's attention output, one block pair's scores and probabilities,
  and its MLP), one draft layer's attention gradients, or the loss, a phase of its own whose
  vocabulary-wide fp32 arrays (three at once: the draft's and the target's logits and a gradient,
  with `run.logit_chunk` one chunk's) die before the layers' backward pass begins. Tensors with a
  heads / kv_heads / mlp / vocab dimension are divided by the tensor axis when it divides them
  (the weights' sharding propagates to them); the residual stream is replicated across it;
* the allocation slack: a compiler allocates more than the step's live peak (fragmentation,
  buffers held so copies and collectives overlap): +20% of the non-argument bytes above, the mean
  of the TPU compiler's temporaries over this plan's on the shipped configs (1.09-1.29x,
  benchmarks/results/tpu_compile_train.md, where the plan's total is compared per config).
  Against XLA:CPU's buffer assignment (tests/test_plan.py) the estimate is looser: leave a margin.

FLOPs per step count what the step computes, padding included (the shapes are fixed): the drafter's
matmuls over blocks_per_row x block_size block slots per row (forward + backward = 3 x forward for
a matmul whose weights and input both need gradients, 2 x for the frozen LM head and for fc, whose
input is a constant), its attention over the row's seq_len context keys plus the block's own (the
masked keys are computed too), the target's LM head at the block slots (forward only), and with
online features the target's forward over every token (2 x matmul params x tokens plus its
attention by 128-token blocks, counted as if one sequence filled each row: `target_matmuls` and
`target_attention`). `step_seconds = flops / (devices x peak x mfu)`; the MFU is an assumption,
not a measurement.

Shapes-only target: `serving.target_shapes.target_model_config(spec)` (a config.json, GGUF metadata or
known shapes). Pass a `ModelConfig` to `training_plan` to skip that.

`python -m dspark_jax.train --config FILE --plan --accelerator-type v5p-8 [key=value ...]` prints it.
"""

from __future__ import annotations

import dataclasses
import math
import os

from dspark_jax.core.errors import UserError
from dspark_jax.distributed.sharding import MESH_AXES, is_spec, logical_spec
from dspark_jax.serving.target_shapes import target_model_config
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.config import TrainConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT_FIELDS = 4  # tokens, positions, segment_ids, loss_mask: int32 [rows, seq_len] each
DEFAULT_MFU = 0.4  # an assumption, not a measurement

ALLOCATION_OVERHEAD = 0.2  # of the step's non-argument bytes (measured: see training_plan)


def resolve_mesh(mesh: tuple[int, int, int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes of `run.mesh` on `num_devices` devices, as `sharding.make_mesh`
    resolves them (-1 = the remaining devices; the mesh may leave devices unused)."""
    if num_devices < 1:
        raise UserError(f"the plan needs at least one device, got {num_devices}")
    sizes = list(mesh)
    if sizes.count(-1) > 1:
        raise UserError("at most one mesh axis may be -1")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = max(1, num_devices // known)
    if math.prod(sizes) > num_devices or min(sizes) < 1:
        raise UserError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, {num_devices} available")
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class _MeshShape:
    """The part of a jax Mesh that `sharding.logical_spec` reads: its axis sizes."""
    shape: dict


def _per_device(mesh: _MeshShape, axes, shape) -> int:
    """Elements of one device's shard of an array with these logical axes."""
    spec = logical_spec(mesh, axes, shape)
    split = 1
    for entry in spec:
        for a in ((entry,) if isinstance(entry, str) else tuple(entry or ())):
            split *= mesh.shape[a]
    return math.prod(shape) // split


def _tree_sizes(mesh: _MeshShape, axes_tree, shapes_tree) -> tuple[int, int]:
    """(total elements, elements on one device) of a parameter tree."""
    import jax

    pairs = jax.tree.leaves(jax.tree.map(lambda axes, shape: (math.prod(shape), _per_device(mesh, axes, shape)),
                                         axes_tree, shapes_tree, is_leaf=is_spec),
                            is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and all(isinstance(v, int) for v in x))
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


# ------------------------------------------------------------------------------------------------
# The plan


def _shard(size: int, split: int) -> int:
    """The divisor a tensor axis of `split` devices applies to a dimension of `size` (1 when it does not divide)."""
    return split if split > 1 and size % split == 0 else 1


def training_plan(cfg: TrainConfig, num_devices: int, target: ModelConfig | None = None, *,
                  target_name: str | None = None, target_dtype: str = "float32", layout: str = "stacked",
                  accelerator: str | None = None, mfu: float = DEFAULT_MFU) -> dict:
    """Per-device memory, FLOPs and tokens of one training step of `cfg` on `num_devices` devices.

    target: the frozen target's ModelConfig (shapes only); None reads it with `target_model_config`
    (cfg.target). target_dtype: the dtype the target's params are stored in on the devices ("float32":
    what `train` loads). layout: the target's layer layout ("stacked": accelerators; "per_layer":
    CPU). accelerator: a `serving.hardware.ACCELERATORS` key (e.g. "tpu-v5p") to add HBM per chip,
    whether it fits and a step time at `mfu` of the chip's bf16 peak. All sizes are bytes (ints)."""
    import jax

    from dspark_jax.drafters import dspark, eagle3
    from dspark_jax.models import decoder
    from dspark_jax.drafters.checkpoint import drafter_logical_axes

    source = "given"
    if target is None:
        target_name, target, source = target_model_config(cfg.target)
    target_name = target_name or os.path.basename(os.path.normpath(cfg.target))
    if target_dtype not in DTYPE_BYTES:
        raise UserError(f"unknown target dtype {target_dtype!r} (one of {', '.join(DTYPE_BYTES)})")
    dcfg = cfg.drafter_config(target, target_name)
    dcfg.check_target(target, target_name)
    sizes = resolve_mesh(cfg.run.mesh, num_devices)
    data, fsdp, tensor = sizes
    mesh = _MeshShape(dict(zip(MESH_AXES, sizes)))
    cd = DTYPE_BYTES[cfg.run.compute_dtype]
    td = DTYPE_BYTES[target_dtype]

    # --- parameters, exactly as the trainer shards them
    init = eagle3.init_eagle3_params if dcfg.kind == "eagle3" else dspark.init_drafter_params
    abstract = jax.eval_shape(lambda key: init(dcfg, key), jax.random.key(0))
    shapes = jax.tree.map(lambda a: tuple(a.shape), abstract)
    drafter_params, drafter_local = _tree_sizes(mesh, drafter_logical_axes(abstract), shapes)
    target_params, target_local = _tree_sizes(mesh, decoder.param_logical_axes(target, layout),
                                              decoder.param_shapes(target, layout))

    # --- the batch
    R, accum = cfg.data.rows, cfg.optim.grad_accum
    S, NB, g = cfg.data.seq_len, cfg.data.blocks_per_row, dcfg.block_size
    dp = data * fsdp  # the "batch" axis: (data, fsdp)
    step_rows = R * accum
    dp_split = _shard(step_rows, dp)
    rows_dev = math.ceil(R / dp_split)  # rows of one micro-batch on one device
    cached = bool(cfg.data.feature_cache)
    m, d = len(dcfg.target_layer_ids), dcfg.hidden_size
    batch_bytes = (step_rows // dp_split) * (INT_FIELDS * 4 * S + NB * 5)
    feature_bytes = (step_rows // dp_split) * S * 2 * (m + 1) * d if cached else 0

    shapes_cfg = dict(H=dcfg.num_heads, Hkv=dcfg.num_kv_heads, D=dcfg.head_dim, f=dcfg.intermediate_size,
                      V=dcfg.vocab_size, d=d, m=m)
    th = _shard(dcfg.num_heads * dcfg.head_dim, tensor)
    tkv = _shard(dcfg.num_kv_heads * dcfg.head_dim, tensor)
    tf = _shard(dcfg.intermediate_size, tensor)
    tv = _shard(dcfg.vocab_size, tensor)
    if dcfg.kind == "eagle3":
        acts, flops = _eagle3_row(cfg, dcfg, S, NB, cd, th, tkv, tf, tv)
    else:
        acts, flops = _dspark_row(cfg, dcfg, S, NB, g, cd, th, tkv, tf, tv)
    tgt_matmuls, tgt_attention, tgt_transient = _target_row(target, S, m, cached, td, tensor)  # activations in the load dtype too
    per_row = acts["saved"] + max(acts["transient"], tgt_transient)
    activation_bytes = rows_dev * per_row

    memory = {
        "drafter_params": drafter_local * 4,
        "optimizer_state": 2 * drafter_local * 4,
        "gradients": (2 if accum > 1 else 1) * drafter_local * 4,
        "drafter_params_compute": drafter_local * cd if cd != 4 else 0,
        "target_params": target_local * td,
        "target_params_compute": target_local * cd if cd != td else 0,
        "batch": batch_bytes + feature_bytes,
        "activations": activation_bytes,
    }
    # The compiler allocates more than the step's live peak (fragmentation, buffers held for copies
    # and collectives to overlap): the TPU compiler's temporaries were 1.09-1.29x (mean 1.2x) this
    # plan's non-argument bytes on the shipped configs (benchmarks/results/tpu_compile_train.md).
    arguments = ("drafter_params", "optimizer_state", "target_params", "batch")
    memory["allocation_overhead"] = int(ALLOCATION_OVERHEAD * sum(v for k, v in memory.items() if k not in arguments))
    memory["total"] = sum(memory.values())
    drafter_flops = step_rows * sum(flops.values())
    target_flops = step_rows * (tgt_matmuls + tgt_attention)
    plan = {
        "target": {"name": target_name, "shapes_from": source, "params": target_params, "dtype": target_dtype,
                   "layout": layout, **{k: getattr(target, k) for k in ("num_layers", "hidden_size", "vocab_size")}},
        "drafter": {"kind": dcfg.kind, "num_layers": dcfg.num_layers, "block_size": g, "head": dcfg.head,
                    "params": drafter_params, "params_per_device": drafter_local, **shapes_cfg},
        "num_devices": num_devices,
        "mesh": dict(zip(MESH_AXES, sizes)),
        "devices_used": math.prod(sizes),
        "compute_dtype": cfg.run.compute_dtype,
        "features": "cache" if cached else "online",
        "batch": {"rows_per_micro_batch": R, "grad_accum": accum, "rows_per_step": step_rows,
                  "rows_per_device": rows_dev, "seq_len": S, "blocks_per_row": NB,
                  "tokens_per_step": step_rows * S, "block_slots_per_step": step_rows * NB * g,
                  "batch_replicated": dp > 1 and dp_split == 1},
        "memory_per_device": memory,
        "activation_bytes_per_row": per_row,
        "flops_per_step": {**{k: step_rows * v for k, v in flops.items()}, "target_matmuls": step_rows * tgt_matmuls,
                           "target_attention": step_rows * tgt_attention, "total": drafter_flops + target_flops},
    }
    if accelerator is not None:
        plan["accelerator"] = accelerator_estimate(plan, accelerator, mfu)
    return plan


def _dspark_row(cfg: TrainConfig, dcfg, S: int, NB: int, g: int, cd: int, th: int, tkv: int, tf: int, tv: int):
    """(activation bytes {"saved", "transient"}, FLOPs by part) of one packed row, DSpark / DFlash."""
    L, d, H, Hkv, D, f, V = (dcfg.num_layers, dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim,
                             dcfg.intermediate_size, dcfg.vocab_size)
    m, r, T = len(dcfg.target_layer_ids), dcfg.markov_rank, NB * g  # T: block slots of a row
    q, kv = H * D, Hkv * D
    layer_matmul = d * (q + 2 * kv) + q * d + 3 * d * f
    keys = S + g  # a block query's keys: the row's context and the block's own slots
    per_layer = (4 * S * kv / tkv * cd  # context keys (projected, normed, rotated) and values
                 + 4 * T * d * cd  # the block's residual stream and its two norms
                 + (3 * T * q / th + 4 * T * kv / tkv + T * q / th) * cd  # q, k, v (three stages each), attention output
                 + 3 * T * f / tf * cd  # gate, up, act(gate) * up
                 + H / th * T * keys * (4 + cd))  # softmax probabilities (fp32) and their compute-dtype copy
    kept = {"none": per_layer,  # what run.remat keeps of a layer for the backward pass
            # the weight products: context k/v, q/k/v, the attention's output projection, gate, up, down
            "dots": (2 * S * kv / tkv + T * (q / th + 2 * kv / tkv) + 2 * T * d + 2 * T * f / tf) * cd,
            "full": T * d * cd}[cfg.run.remat]  # the layer's input
    recomputed = per_layer if cfg.run.remat != "none" else 0  # one layer's, rebuilt in its backward pass
    # The loss is a phase of its own: its vocabulary-wide fp32 arrays (three at once in the TPU
    # compiler's schedule of the shipped configs, with or without a TV term: the draft's and the
    # target's logits and the gradient) die before the layers' backward pass begins, so they are
    # a transient, never saved beside the layers' residuals. run.logit_chunk: one chunk's at a time.
    Tv = min(cfg.run.logit_chunk, NB) * g if cfg.run.logit_chunk else T
    saved = (S * m * d * cd + 2 * S * d * cd  # fc input (the taps) and output (before / after its norm)
             + L * kept + 2 * T * d * cd  # final norm
             + (T * r * cd if dcfg.uses_markov_table else 0))
    transient = max(2 * H / th * T * keys * 4 + recomputed,  # one draft layer's score and probability gradients
                    3 * Tv * V / tv * 4)  # the loss's phase
    flops = {
        "drafter_fc": 2 * (2 * S * m * d * d),  # forward + weight gradient (the taps are constants)
        "drafter_context_kv": 3 * L * 2 * S * d * 2 * kv,
        "drafter_layers": 3 * L * 2 * T * layer_matmul,  # = 6 x layer params x block slots
        "drafter_attention": 3 * L * 4 * T * keys * q,  # q k^T and p v
        "drafter_lm_head": 2 * 2 * T * d * V,  # the frozen head: forward + input gradient
        "drafter_head": (3 * 2 * T * r * V if dcfg.uses_markov_table else 0)  # Markov bias W1[prev] W2
        + (3 * 2 * T * (2 * r + d) * 3 * r if dcfg.head == "rnn" else 0),
        "target_lm_head": 2 * T * d * V,  # the target's distribution at the block slots (no gradient)
    }
    # recomputed in the backward pass: the attention ("dots"; the rest is kept) or the whole layer
    # ("full"); with logit_chunk the LM heads' and the Markov bias' forward
    flops["recompute"] = ({"none": 0, "dots": flops["drafter_attention"] / 3,
                           "full": (flops["drafter_layers"] + flops["drafter_attention"]
                                    + flops["drafter_context_kv"]) / 3}[cfg.run.remat]
                          + (flops["drafter_lm_head"] / 2 + flops["drafter_head"] / 3 + flops["target_lm_head"]
                             if cfg.run.logit_chunk else 0))
    return {"saved": int(saved), "transient": int(transient)}, flops


def _eagle3_row(cfg: TrainConfig, dcfg, S: int, NB: int, cd: int, th: int, tkv: int, tf: int, tv: int):
    """(activation bytes, FLOPs by part) of one row for Eagle3: `ttt_steps` passes over the whole
    row, LM heads at every position or (ttt_at_anchors) at the anchors only. Coarser than DSpark's."""
    K, L, d, H, Hkv, D, f, V = (dcfg.ttt_steps, dcfg.num_layers, dcfg.hidden_size, dcfg.num_heads,
                                dcfg.num_kv_heads, dcfg.head_dim, dcfg.intermediate_size, dcfg.vocab_size)
    m, q, kv = len(dcfg.target_layer_ids), H * D, Hkv * D
    N = NB if dcfg.ttt_at_anchors else S  # supervised positions per pass
    layer_matmul = 2 * d * (q + 2 * kv) + q * d + 3 * d * f  # q/k/v read [embedding; feature]
    keys = K * S + K * (K - 1) // 2  # over the passes: the context plus the chain so far
    layer = (6 * S * d * cd + (3 * S * q / th + 6 * S * kv / tkv) * cd + 3 * S * f / tf * cd
             + H / th * S * (S + K) * (4 + cd))
    kept = {"none": layer,  # what run.remat keeps of a layer (as `_dspark_row`)
            "dots": (S * (q / th + 2 * kv / tkv) * 2 + 2 * S * d + 2 * S * f / tf) * cd,
            "full": 2 * S * d * cd}[cfg.run.remat]  # its inputs: the residual stream and the embeddings
    saved = S * m * d * cd + S * d * cd + K * L * kept
    # The loss is a phase of its own (as `_dspark_row`'s): every pass's fp32 logits and the target's p
    # (one array for all passes: the draft side is shifted, `eagle3_train_forward`), dead before the
    # layers' backward pass begins (the TPU compiler held K + 1 of them at Qwen3-4B's shapes, data-
    # parallel, and K + 2 at Qwen3-8B's, tensor-parallel: one pass's softmax rebuilt beside them)
    vocab = N * V / tv * 4
    transient = max(2 * H / th * S * (S + K) * 4 + (layer if cfg.run.remat != "none" else 0), (K + 1) * vocab)
    flops = {
        "drafter_fc": 2 * (2 * S * m * d * d),
        "drafter_layers": 3 * K * L * 2 * S * layer_matmul,
        "drafter_attention": 3 * L * 4 * S * keys * q,
        "drafter_lm_head": 2 * K * 2 * N * d * V,
        "target_lm_head": 2 * (N * K if dcfg.ttt_at_anchors else S) * d * V,
    }
    flops["recompute"] = {"none": 0, "dots": flops["drafter_attention"] / 3,
                          "full": (flops["drafter_layers"] + flops["drafter_attention"]) / 3}[cfg.run.remat]
    return {"saved": int(saved), "transient": int(transient)}, flops


def _target_row(target: ModelConfig, S: int, m: int, cached: bool, ab: int, tensor: int) -> tuple[int, int, int]:
    """(matmul FLOPs, attention FLOPs, transient activation bytes) of the frozen target's forward over one
    packed row; zeros with cached features. Its activations are in the target's own dtype (float32
    in `train`). The attention (`decoder.forward_packed`) runs by blocks of C tokens, a query block
    visiting the key blocks from its sequence's first to its own: with one sequence filling a row
    (the most), (S / C) (S / C + 1) / 2 block pairs, S (S + C) / 2 scores."""
    from dspark_jax.models.decoder import PACKED_ATTENTION_BLOCK as C

    if cached:
        return 0, 0, 0
    L, d, H, Hkv, D, f = (target.num_layers, target.hidden_size, target.num_heads, target.num_kv_heads,
                          target.head_dim, target.intermediate_size)
    q, kv = H * D, Hkv * D
    layer_matmul = d * (q + 2 * kv) + q * d + 3 * d * f
    attention = L * 4 * q * S * (S + C) // 2  # q k^T and p v over the visited block pairs
    th, tkv, tf = _shard(q, tensor), _shard(kv, tensor), _shard(f, tensor)
    features = (m + 1) * S * d * ab  # the taps and the last hidden state, kept for the drafter
    layer = (C * C * 2 * 4 * H / th  # fp32 scores and probabilities of one block pair
             + S * q / th * 4  # the fp32 attention output of the row's query blocks
             + S * (4 * d + q / th + 2 * kv / tkv + 3 * f / tf) * ab)
    return int(L * 2 * S * layer_matmul), int(attention), int(features + layer)


def accelerator_estimate(plan: dict, accelerator: str, mfu: float = DEFAULT_MFU) -> dict:
    """HBM per chip, whether the plan's total fits, and a step time at `mfu` of the chip's bf16 peak."""
    from dspark_jax.serving.hardware import ACCELERATORS

    if accelerator not in ACCELERATORS:
        raise UserError(f"unknown accelerator {accelerator!r} (known: {', '.join(sorted(ACCELERATORS))})")
    if not 0 < mfu <= 1:
        raise UserError(f"mfu must be in (0, 1], got {mfu}")
    from dspark_jax.serving.tpu_compile import HBM_MARGIN

    chip = ACCELERATORS[accelerator]
    used = plan["devices_used"]
    seconds = plan["flops_per_step"]["total"] / (used * chip.peak_flops * mfu)
    mem = plan["memory_per_device"]
    # a row's activations come with their share of the allocation slack
    fixed = mem["total"] - mem["activations"] * (1 + ALLOCATION_OVERHEAD)
    # What a program may use of a chip, as the compile check counts it: the plan's "fits" said yes at 88.7
    # of 95 GB where the TPU compiler needed 95.2 (rows 8 of the v5p-8 walkthrough)
    usable = (1 - HBM_MARGIN) * chip.hbm_bytes
    return {"name": chip.name, "key": accelerator, "hbm_bytes": int(chip.hbm_bytes), "peak_flops": chip.peak_flops,
            "mfu": mfu, "mfu_is_assumed": True, "fits": plan["memory_per_device"]["total"] <= usable,
            "usable_fraction": 1 - HBM_MARGIN,
            # rows of a micro-batch one device could hold next to everything else, within the usable HBM
            "max_rows_per_device": max(0, int((usable - fixed)
                                              // (plan["activation_bytes_per_row"] * (1 + ALLOCATION_OVERHEAD)))),
            "step_seconds": seconds, "tokens_per_second": plan["batch"]["tokens_per_step"] / seconds,
            "source": chip.source}


# ------------------------------------------------------------------------------------------------
# Text


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_plan(plan: dict) -> str:
    """The plan as a short text report (decimal GB; FLOPs in PFLOP, TFLOP or GFLOP)."""
    t, dr, b, mem, fl = plan["target"], plan["drafter"], plan["batch"], plan["memory_per_device"], plan["flops_per_step"]
    mesh = plan["mesh"]
    lines = [
        f"target {t['name']}: {t['params'] / 1e9:.2f}B params ({t['dtype']}, shapes from {t['shapes_from']})",
        f"drafter {dr['kind']} ({dr['num_layers']} layers, gamma {dr['block_size']}, head {dr['head']}): "
        f"{dr['params']:,} trainable params, {dr['params_per_device']:,} per device",
        f"mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']} on {plan['devices_used']} of "
        f"{plan['num_devices']} devices; compute {plan['compute_dtype']}; target features {plan['features']}",
        f"batch: {b['rows_per_step']} rows x {b['seq_len']} tokens per step ({b['grad_accum']} micro-batch(es) of "
        f"{b['rows_per_micro_batch']}; {b['rows_per_device']} row(s) per device per micro-batch"
        + (", REPLICATED: the rows do not divide over the batch axes" if b["batch_replicated"] else "") + ")",
        f"tokens per step {b['tokens_per_step']:,}; block slots per step {b['block_slots_per_step']:,}",
        "memory per device:",
    ]
    labels = {"drafter_params": "drafter params (fp32)", "optimizer_state": "AdamW moments (fp32)",
              "gradients": "gradients (fp32)", "drafter_params_compute": f"drafter params ({plan['compute_dtype']} copy)",
              "target_params": f"target params ({t['dtype']})", "target_params_compute":
              f"target params ({plan['compute_dtype']} copy, transient)", "batch": "batch (+ cached features)",
              "activations": "activations (estimate, one micro-batch)",
              "allocation_overhead": f"allocation slack (+{ALLOCATION_OVERHEAD:.0%} of the temporaries)", "total": "total"}
    for k, label in labels.items():
        lines.append(f"  {label:<44} {_gb(mem[k]):>14}")
    target = fl["target_matmuls"] + fl["target_attention"]
    scale, unit = next((s, u) for s, u in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1, "FLOP"))
                       if fl["total"] >= s or s == 1)
    lines.append(f"FLOPs per step: {fl['total'] / scale:,.2f} {unit} (drafter "
                 f"{(fl['total'] - target) / scale:,.2f}, target forward {target / scale:,.2f})")
    acc = plan.get("accelerator")
    if acc:
        lines.append(f"{acc['name']}: {_gb(acc['hbm_bytes'])} HBM per chip -> "
                     f"{'fits' if acc['fits'] else 'DOES NOT FIT'} in {acc['usable_fraction']:.0%} of it "
                     f"(room for {acc['max_rows_per_device']} row(s) "
                     f"per device per micro-batch); at {acc['mfu']:.0%} MFU (assumed) of "
                     f"{acc['peak_flops'] / 1e12:.0f} TFLOP/s bf16: {acc['step_seconds']:,.1f} s/step, "
                     f"{acc['tokens_per_second']:,.0f} tokens/s")
    compiled = plan.get("compiled")
    if compiled:
        from dspark_jax.serving.tpu_compile import ProgramReport, format_reports, tpu_slice

        fields = {f.name for f in dataclasses.fields(ProgramReport)}
        reports = [ProgramReport(**{k: v for k, v in r.items() if k in fields}) for r in compiled["programs"]]
        lines.append(format_reports(reports, tpu_slice(compiled["accelerator_type"])))
        lines.append(f"the plan's total against the compiled train step: {_gb(mem['total'])} vs "
                     f"{_gb(reports[0].per_chip_bytes)} ({compiled['plan_error']:+.0%})")
    return "\n".join(lines)


def plan_for(cfg: TrainConfig, *, devices: int | None = None, accelerator_type: str | None = None,
             accelerator: str | None = None, target_config: str | None = None, mfu: float = DEFAULT_MFU,
             compile: bool = False) -> dict:
    """The plan `train --plan` prints: for `devices` devices, a Cloud TPU slice (`accelerator_type`,
    e.g. v5p-8) or, given neither, the devices this process sees; the target's shapes from
    `target_config` (a config.json) when cfg.target is not on this machine. `compile`: with
    `accelerator_type`, also the TPU compiler's per-chip memory of the train and eval steps
    (`training.compile_check`) and the plan's error against it."""
    chip = tpu = None
    if compile and not accelerator_type:
        raise UserError("--compile compiles for a Cloud TPU slice: give --accelerator-type (e.g. v5p-8)")
    if accelerator_type:
        from dspark_jax.serving.tpu_compile import tpu_slice

        tpu = tpu_slice(accelerator_type)
        devices, chip = tpu.chips, tpu.key
    elif devices is None:
        import jax

        devices = jax.device_count()
    target = None
    if target_config:
        from dspark_jax.checkpoints.hf import read_json
        from dspark_jax.models.config import config_from_hf

        target = config_from_hf(read_json(target_config), source=target_config)
    found = training_plan(cfg, devices, target, accelerator=accelerator or chip, mfu=mfu)
    if compile:
        from dspark_jax.training.compile_check import compile_train_programs

        name, target = (os.path.basename(os.path.normpath(cfg.target)), target) if target else \
            target_model_config(cfg.target)[:2]
        reports = compile_train_programs(cfg, tpu, target, name)
        compiled = reports[0].per_chip_bytes
        found["compiled"] = {"accelerator_type": tpu.accelerator_type, "topology": tpu.topology,
                             "programs": [r.as_dict() for r in reports],
                             "plan_error": found["memory_per_device"]["total"] / compiled - 1}
    return found
