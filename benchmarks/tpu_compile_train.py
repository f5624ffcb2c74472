"""Every shipped TPU training config compiled by the TPU compiler for its slice, on this CPU.

    JAX_PLATFORMS=cpu python benchmarks/tpu_compile_train.py [--configs dspark_qwen3-8b,...] \\
        [--name tpu_compile_train]

Per config (`configs/<name>.yaml` as shipped) and the slice `compile_check.DOCUMENTED_SLICES`
gives it, `train --plan --accelerator-type SLICE --compile`'s numbers: the compiler's memory per chip
of the train and eval steps against HBM (fits = within 90%), the collectives, matmul flops and HBM
bytes per step with every loop's trip count, the roofline step time and the MFU it allows, and the
analytic plan's per-chip total beside the compiler's (its error; the plan is recomputed whenever the
results are written, so it follows the plan's model without recompiling). A config whose target
has no shapes on this machine is reported as such. Needs libtpu (the test extra installs it); runs
nothing on a TPU. Resumable: a config already in the results JSON is kept (delete its cell to
compile it again).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def load(name: str):
    from dspark_jax.training.config import load_config

    return load_config(os.path.join(CONFIGS, f"{name}.yaml"), [])


def compile_config(name: str) -> dict:
    from dspark_jax.core.errors import UserError
    from dspark_jax.serving.target_shapes import target_model_config
    from dspark_jax.serving.tpu_compile import tpu_slice
    from dspark_jax.training.compile_check import DOCUMENTED_SLICES, compile_train_programs

    cfg = load(name)
    slice_ = DOCUMENTED_SLICES[name.split("_", 1)[1]]
    start = time.time()
    try:
        target_name, target, _ = target_model_config(cfg.target)
        reports = compile_train_programs(cfg, tpu_slice(slice_), target, target_name)
    except UserError as e:
        return {"config": name, "slice": slice_, "error": str(e)}
    return {"config": name, "slice": slice_, "compile_s": time.time() - start,
            "settings": {"rows": cfg.data.rows, "grad_accum": cfg.optim.grad_accum, "seq_len": cfg.data.seq_len,
                         "mesh": list(cfg.run.mesh), "remat": cfg.run.remat, "logit_chunk": cfg.run.logit_chunk},
            "programs": [r.as_dict() for r in reports]}


def with_plan(cell: dict) -> dict:
    """The cell with the analytic plan of its config today (`train --plan`, no compile: cheap, so the
    table follows the plan's model without recompiling) and its error against the compiler."""
    from dspark_jax.training.plan import plan_for

    if "error" in cell:
        return cell
    found = plan_for(load(cell["config"]), accelerator_type=cell["slice"])
    total = found["memory_per_device"]["total"]
    return {**cell, "mesh": found["mesh"], "plan_total": total,
            "plan_error": total / cell["programs"][0]["per_chip_bytes"] - 1}


def markdown(cells: list[dict]) -> str:
    lines = ["Each shipped TPU config as it is in `configs/`, compiled for its slice by the TPU compiler on a CPU "
             "(`python -m dspark_jax.train --config configs/NAME.yaml --plan --accelerator-type SLICE --compile`). "
             "Per chip: the train step's memory (arguments + temporaries + outputs) against HBM, fits = within 90% "
             "of it; matmul PFLOP per chip with every loop's trip count and the step time they take at the chip's "
             "bf16 peak (a lower bound: the HBM bytes model, `serving/hlo_cost.py`, is not validated on training "
             "steps, and on the data-parallel ones it reports bytes no step could move, so no roofline time is "
             "given); the analytic plan's total (`train --plan`, recomputed whenever this table is written) and its "
             "error against the compiler's.", "",
             "| config | slice | mesh (data, fsdp, tensor) | rows x micro-batches | remat | train step GB / HBM | "
             "fits | eval step GB | PFLOP / step | s / step at peak | plan GB (error) |",
             "|---|---|---|---:|---|---:|:-:|---:|---:|---:|---:|"]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['config']} | {c['slice']} | not compiled: {c['error']} |||||||||")
            continue
        s, (train, *rest) = c["settings"], c["programs"]
        mesh = ", ".join(str(v) for v in c["mesh"].values())
        lines.append(f"| {c['config']} | {c['slice']} | {mesh} | {s['rows']} x {s['grad_accum']} | {s['remat']} | "
                     f"{train['per_chip_bytes'] / 1e9:.1f} / {train['hbm_bytes'] / 1e9:.0f} | "
                     f"{'yes' if train['fits'] else 'NO'} | "
                     f"{common.fmt(rest[0]['per_chip_bytes'] / 1e9 if rest else None)} | "
                     f"{train['flops'] / 1e15:,.2f} | {train['flops'] / train['peak_flops']:,.1f} | "
                     f"{c['plan_total'] / 1e9:.1f} ({c['plan_error']:+.0%}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=None, help="default: every shipped TPU config")
    ap.add_argument("--name", default="tpu_compile_train")
    args = ap.parse_args()

    cells = common.finished_cells(args.name, lambda c: c["config"])
    from dspark_jax.training.compile_check import SHIPPED_TPU_CONFIGS

    for name in args.configs.split(",") if args.configs else SHIPPED_TPU_CONFIGS:
        if name in cells:
            continue
        cells[name] = compile_config(name)
        print(json.dumps({k: v for k, v in cells[name].items() if k != "programs"}), flush=True)
        write(args.name, cells)
    write(args.name, cells)


def write(name: str, cells: dict) -> None:
    planned = [with_plan(c) for c in cells.values()]
    common.write_results(name, {"cells": planned}, markdown(planned))


if __name__ == "__main__":
    main()
