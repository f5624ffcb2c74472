"""Training throughput and memory of the SmolLM2-135M drafter configs on this machine.

    python benchmarks/bench_train.py [--configs dspark,dflash,eagle3] [--steps 8] [--data data/smollm2-train]

Each config runs in its own process (so the memory peak is its own) for --steps optimizer steps on
the real regenerated data; the first two steps (compilation) are excluded from the rates. It also
times the frozen target's feature pass alone on the same batches, which is the case for (or
against) caching target features on disk instead of running the target online.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results  # noqa: E402


def run_one(config: str, steps: int, data: str) -> dict:
    import jax
    import numpy as np

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.data.pipeline import target_features
    from dspark_jax.training.config import load_config
    from dspark_jax.training.trainer import Trainer

    out_dir = tempfile.mkdtemp(prefix="bench-train-")
    cfg = load_config(config, [f"optim.steps={steps}", f"data.train_dir={data}", f"run.out_dir={out_dir}",
                               "run.save_every=100000", "run.log_every=1"])
    target = load_target(cfg.target)
    trainer = Trainer(cfg, target)
    state = trainer.init_state()
    times, blocks, tokens = [], 0, 0
    feature_times = []
    for step in range(steps):
        batch = trainer.device_batch(next(trainer.data))
        t = time.perf_counter()
        state, metrics = trainer.train_step(state, trainer.target_params, batch)
        jax.block_until_ready(metrics)
        if step >= 2:
            times.append(time.perf_counter() - t)
            blocks += int(np.asarray(batch["block_valid"]).sum())
            tokens += int((np.asarray(batch["segment_ids"]) > 0).sum())
            t = time.perf_counter()
            jax.block_until_ready(target_features(trainer.target_params, target.config, batch,
                                                  trainer.dcfg.tap_layers))
            feature_times.append(time.perf_counter() - t)
    trainer.close()
    total = sum(times)
    return {"config": os.path.basename(config), "steps_timed": len(times), "s_per_step": total / len(times),
            "blocks_per_s": blocks / total, "packed_tokens_per_s": tokens / total,
            "target_feature_share": sum(feature_times) / total,
            "rows": cfg.data.rows, "seq_len": cfg.data.seq_len, "blocks_per_row": cfg.data.blocks_per_row,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "final_loss": float(np.asarray(metrics["loss"]))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dspark,dflash,eagle3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--data", default="data/smollm2-train")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.data)))
        return
    rows = []
    for name in args.configs.split(","):
        config = f"configs/{name}_smollm2-135m.yaml"
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--steps", str(args.steps),
                               "--data", args.data], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{config} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    md = ["| config | rows x seq_len (blocks/row) | s/step | blocks/s | packed tokens/s | target-feature share | peak RSS (GB) |",
          "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['config']} | {r['rows']} x {r['seq_len']} ({r['blocks_per_row']}) | {r['s_per_step']:.2f} | "
                  f"{r['blocks_per_s']:.1f} | {r['packed_tokens_per_s']:.0f} | {r['target_feature_share']:.0%} | "
                  f"{r['peak_rss_gb']:.1f} |")
    md.append("\nOnline target features (`data.features: online`): the frozen SmolLM2-135M runs inside every "
              "step over the packed rows. 'target-feature share' is the time of that pass alone divided by the "
              "whole step. Compilation (first two steps) excluded.\n")
    paths = write_results("train", {"rows": rows}, "\n".join(md))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
