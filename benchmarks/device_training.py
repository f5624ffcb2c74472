"""Part 4 of benchmarks/accelerator.py, training: bench_train's timed steps (`time_steps`: steps 2..
of a real `Trainer` on packed grain batches of synthetic datagen shards, host batch and transfer
included) of a bf16 DSpark drafter for SmolLM2 (16 x 2048, 128 blocks/row) and for Qwen3-8B (random
target; 1 x 4096, 512 blocks, the config's row shape; all 36 layers, --qwen-train-layers to cut
them, then the full-depth time is estimated by scaling the target's own share), with steps/s,
tokens/s and MFU from a model-FLOP count (see `train_flops`) against 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from device_setup import QWEN3_8B, random_target

if TYPE_CHECKING:
    from accelerator import Run
    from device_setup import Models, Sizes

PEAK_BF16 = {"NVIDIA H200": 989.4e12, "NVIDIA H100": 989.4e12}  # dense bf16 FLOP/s, vendor datasheets (SXM)


def write_synthetic_data(folder: str, target, rows: int, seq_len: int, steps: int, seed: int = 0) -> str:
    """A datagen folder of random token sequences that each fill most of a packed row (prompt of 16-48
    tokens, the rest response), enough for `steps` batches of `rows` rows and then some."""
    import numpy as np

    from dspark_jax.core.files import atomic_write_json
    from dspark_jax.data.shards import FORMAT, MANIFEST, write_shard

    rng = np.random.default_rng(seed)
    cfg = target.config
    n = rows * (steps + 2) + 4
    prompts, responses = [], []
    for _ in range(n):
        p = int(rng.integers(16, 49))
        prompts.append(rng.integers(1, cfg.vocab_size, size=p).tolist())
        responses.append(rng.integers(1, cfg.vocab_size, size=seq_len - p - int(rng.integers(0, 9))).tolist())
    os.makedirs(folder, exist_ok=True)
    entry = write_shard(os.path.join(folder, "shard-00000.npz"), prompts, responses, [str(i) for i in range(n)],
                        [True] * n)
    atomic_write_json(os.path.join(folder, MANIFEST), {
        "format": FORMAT, "target": target.name, "complete": True, "shards": [entry],
        "target_shape": dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers)})
    return folder


def train_flops(tcfg, dcfg, rows: int, seq_len: int, blocks: int) -> tuple[float, float]:
    """Model FLOPs of one DSpark drafter training step: (weight matmuls only, + attention).

    T = rows x seq_len target tokens, N = rows x blocks x gamma drafter slots (padding included: what
    the step computes). Frozen target: forward over T tokens (2 x its layer weights per token) and its
    LM head at the N slots. Drafter (trained, x3 for forward + backward): its layers at the N slots,
    the fused context (fc over m taps, each layer's k/v projection) at the T tokens, the Markov
    table's W2 at the N slots; the frozen LM head under the draft logits: forward + input gradient
    (x2). Attention, counted causal (keys before the query: S/2 on average, each row one sequence):
    target 4 x H x D x S/2 per token and layer; drafter 4 x H x D x (S/2 + gamma) per slot and layer, x3.
    Embedding look-ups, norms, softmaxes and the confidence head are left out."""
    def layer(d, q, kv, inter):  # multiply-adds per token of one decoder layer
        return 2 * d * q + 2 * d * kv + 3 * d * inter

    d, V, L, S = tcfg.hidden_size, tcfg.vocab_size, tcfg.num_layers, seq_len
    T, g = rows * seq_len, dcfg.block_size
    N = rows * blocks * g
    dq, dkv = dcfg.num_heads * dcfg.head_dim, dcfg.num_kv_heads * dcfg.head_dim
    r = dcfg.markov_rank if dcfg.uses_markov_table else 0
    m = len(dcfg.target_layer_ids)
    target = 2 * L * layer(d, tcfg.num_heads * tcfg.head_dim, tcfg.num_kv_heads * tcfg.head_dim,
                           tcfg.intermediate_size) * T + 2 * d * V * N
    drafter = 2 * (N * dcfg.num_layers * layer(dcfg.hidden_size, dq, dkv, dcfg.intermediate_size)
                   + T * (m * d * dcfg.hidden_size + dcfg.num_layers * dcfg.hidden_size * 2 * dkv) + N * r * V)
    weights = target + 3 * drafter + 2 * (2 * dcfg.hidden_size * V * N)
    attention = (4 * L * tcfg.num_heads * tcfg.head_dim * T * S / 2
                 + 3 * 4 * dcfg.num_layers * dq * N * (S / 2 + g))
    return float(weights), float(weights + attention)


def peak_flops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if device_kind.startswith(k)), None)


def train_item(models: Models, key: str, s: Sizes, device_kind: str) -> dict:
    import shutil

    import bench_train

    from dspark_jax.training.config import default_tap_layers

    rows, seq_len, blocks, anchors = s.tr_shapes[key]
    model = models.get(key)
    target, overrides, layers_note = model.target, list(model.overrides), None
    full_layers = target.config.num_layers
    if key == QWEN3_8B and s.tr_qwen_layers < full_layers:
        # Fewer target layers (memory): a random target of that depth, taps spread over it as in the config.
        cfg = target.config.replace(num_layers=s.tr_qwen_layers)
        target = random_target(QWEN3_8B, cfg, s.layout)
        taps = default_tap_layers(s.tr_qwen_layers, len(model.dcfg.target_layer_ids))
        overrides.append(f"drafter.target_layer_ids=[{','.join(map(str, taps))}]")
        layers_note = f"{s.tr_qwen_layers} of {full_layers} target layers"
    tmp = tempfile.mkdtemp(prefix="dspark-acc-train-")
    trainer = None
    try:
        data = write_synthetic_data(os.path.join(tmp, "data"), target, rows, seq_len, s.tr_steps)
        overrides += [f"data.rows={rows}", f"data.seq_len={seq_len}", f"data.blocks_per_row={blocks}",
                      f"data.anchors_per_seq={anchors}", 'data.eval_dir=""', "run.compute_dtype=bfloat16",
                      "run.mesh=[1,1,1]"]
        trainer = bench_train.make_trainer(model.config, s.tr_steps, data, None, target=target, overrides=overrides)
        out = bench_train.time_steps(trainer, s.tr_steps, cached=False)
        dcfg = trainer.dcfg
    finally:
        if trainer is not None:
            trainer.close()
            shutil.rmtree(trainer.cfg.run.out_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        del trainer
    flops_w, flops_a = train_flops(target.config, dcfg, rows, seq_len, blocks)
    peak = peak_flops(device_kind)
    step = out["s_per_step"]
    res = {"model": key, "target_layers": target.config.num_layers, "rows": rows, "seq_len": seq_len,
           "blocks_per_row": blocks, "anchors_per_seq": anchors, "gamma": dcfg.block_size,
           "drafter": f"{dcfg.num_layers} layers, {dcfg.head} head rank {dcfg.markov_rank}", **out,
           "steps_per_s": 1 / step, "target_tokens_per_s": rows * seq_len / step,
           "drafter_slots_per_s": rows * blocks * dcfg.block_size / step,
           "model_tflop_per_step": flops_w / 1e12, "model_tflop_per_step_with_attention": flops_a / 1e12,
           "peak_tflops": peak / 1e12 if peak else None,
           "mfu": flops_w / step / peak if peak else None, "mfu_with_attention": flops_a / step / peak if peak else None}
    if layers_note:
        # Only the frozen target's pass grows with its depth: scale that share of the step.
        target_s = out["target_feature_share"] * step
        full_step = step + target_s * (full_layers / target.config.num_layers - 1)
        fw, fa = train_flops(target.config.replace(num_layers=full_layers), dcfg, rows, seq_len, blocks)
        res.update(note=layers_note, full_target_layers=full_layers, estimated_full_depth_s_per_step=full_step,
                   estimated_full_depth_mfu=fw / full_step / peak if peak else None,
                   estimated_full_depth_mfu_with_attention=fa / full_step / peak if peak else None)
    return res


def part_training(run: Run, models: Models) -> None:
    s = run.sizes
    for key in s.tr_models:
        run.item(key, lambda key=key: train_item(models, key, s, run.meta["device"]))
    run.finish("training")


def md_training(items: list[dict], device_kind: str) -> list[str]:
    from common import fmt

    peak = peak_flops(device_kind)
    peak_note = (f"Peak: {peak / 1e12:.0f} TFLOP/s dense bf16 (datasheet)." if peak else
                 "No bf16 peak known for this device: no MFU.")
    md = ["| model | target layers | rows x seq (blocks/row) | steps/s | s/step | target tokens/s | drafter slots/s | "
          "target-feature share | model TFLOP/step (weights / + attention) | MFU (weights / + attention) | final loss |",
          "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for it in items:
        r = it["result"]
        md.append(f"| {r['model']} | {r['target_layers']} | {r['rows']} x {r['seq_len']} ({r['blocks_per_row']}) | "
                  f"{r['steps_per_s']:.2f} | {r['s_per_step']:.3f} | {r['target_tokens_per_s']:.0f} | "
                  f"{r['drafter_slots_per_s']:.0f} | {r['target_feature_share']:.0%} | "
                  f"{r['model_tflop_per_step']:.2f} / {r['model_tflop_per_step_with_attention']:.2f} | "
                  f"{fmt(r['mfu'], '.1%')} / {fmt(r['mfu_with_attention'], '.1%')} | {r['final_loss']:.3f} |")
        if r.get("note"):
            md.append(f"| {r['model']}, full depth (estimated) | {r['full_target_layers']} | | "
                      f"{1 / r['estimated_full_depth_s_per_step']:.2f} | {r['estimated_full_depth_s_per_step']:.3f} | | | | | "
                      f"{fmt(r['estimated_full_depth_mfu'], '.1%')} / "
                      f"{fmt(r['estimated_full_depth_mfu_with_attention'], '.1%')} | |")
    md.append(f"\nbf16 compute (fp32 master weights, AdamW), online target features, one device; a step is timed from "
              f"the host batch (grain packing of synthetic datagen shards) to the finished update (bench_train."
              f"time_steps: steps 2.. of {items[0]['result']['steps_timed'] + 2 if items else '?'}). Model FLOPs: "
              f"`train_flops` (weights: frozen target forward + its LM head at the block slots, drafter x3, the frozen "
              f"LM head under the draft logits x2; + attention, causal). {peak_note} A full-depth row scales the "
              f"measured target pass (target-feature share) to all layers; the drafter's part does not change.\n")
    return md
