"""The speculative engine's decoding programs compiled by the TPU compiler for Cloud TPU slices, on this CPU.

    JAX_PLATFORMS=cpu python benchmarks/tpu_compile.py [--slices v5e-8,v6e-8,v5p-8] [--rows 1,32] \\
        [--target qwen3-8b] [--drafter configs/dspark_qwen3-8b.yaml] [--prompt-tokens 1024] \\
        [--max-new-tokens 1024] [--name tpu_compile]

Per slice and request slots: every program `decode --compile-for` compiles (prefill, the plain
step, the round, the draft, each verify bucket of the scheduler the slots get), with the compiler's
memory per chip, its collectives, matmul flops and HBM bytes per execution with loop trip counts
(`serving.hlo_cost`), the roofline time, and HBM bytes against the program's arguments (weights,
caches, state: a decode step that reads each once moves about as many bytes as that).
Needs libtpu (the test extra installs it); runs nothing on a TPU. Resumable: a (slice, rows) cell
already in the results JSON is kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slices", default="v5e-8,v6e-8,v5p-8")
    ap.add_argument("--rows", type=common.int_list, default=[1, 32])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--drafter", default="configs/dspark_qwen3-8b.yaml")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--name", default="tpu_compile")
    args = ap.parse_args()

    from dspark_jax.engine.decode_settings import DecodeSettings
    from dspark_jax.training.compile_check import decode_check

    cells = common.finished_cells(args.name, lambda c: (c["accelerator_type"], c["rows"]))
    for accelerator in args.slices.split(","):
        for rows in args.rows:
            if (accelerator, rows) in cells:
                continue
            settings = DecodeSettings(target=args.target, drafter=args.drafter, dtype="bfloat16", max_batch=rows,
                                      max_new_tokens=args.max_new_tokens, compile_for=accelerator,
                                      compile_prompt_tokens=args.prompt_tokens)
            start = time.time()
            reports, tpu, about = decode_check(settings)
            cells[(accelerator, rows)] = {**about, "compile_s": time.time() - start,
                                          "programs": [r.as_dict() for r in reports]}
            print(f"{accelerator} x {rows} rows: {len(reports)} programs in {time.time() - start:.0f} s", flush=True)
            common.write_results(args.name, {"cells": list(cells.values())}, markdown(list(cells.values())))
    common.write_results(args.name, {"cells": list(cells.values())}, markdown(list(cells.values())))


def simulated(cell: dict) -> dict[str, float]:
    """The serving simulator's roofline bytes per chip (`serving.hardware.Roofline`: weights once, every
    request's KV cache at the compiled cache length, ideal tensor parallelism) of the verify buckets
    and the draft, by program name, for Qwen3-8B."""
    from dspark_jax.engine.generate import pad_prompts
    from dspark_jax.serving.hardware import ACCELERATORS, TARGETS, Roofline
    from dspark_jax.serving.target_shapes import target_model_config
    from dspark_jax.serving.tpu_compile import tpu_slice

    if cell["target"] != "qwen3-8b":
        return {}
    tpu = tpu_slice(cell["accelerator_type"])
    tcfg = target_model_config("qwen3-8b")[1]
    max_len = pad_prompts(tcfg, [[0] * cell["prompt_tokens"]], cell["max_new_tokens"], slack=cell["gamma"] + 1)[2]
    roof = Roofline(ACCELERATORS[tpu.key], TARGETS["qwen3-8b"], gamma=cell["gamma"], kv_len=max_len, chips=tpu.chips)
    out = {f"verify {n} tokens": float(roof.verify_pass(n, cell["rows"])["bytes"]) / tpu.chips
           for n in cell["verify_buckets"] or ()}
    out["draft"] = roof.draft_pass(cell["rows"])["bytes"] / tpu.chips
    return out


def markdown(cells: list[dict]) -> str:
    lines = ["Qwen3-8B with the DSpark drafter of `configs/dspark_qwen3-8b.yaml`, bf16, tensor parallel over every "
             "chip of the slice (`decode --compile-for`), compiled by the TPU compiler on a CPU. Per chip and "
             "execution: the compiler's memory (args + temporaries + outputs), matmul GFLOP and HBM GB with every "
             "loop's trip count (a loop of data-dependent length, marked *, counted once: the plain-step run is "
             "reported per step, chunked attention over the context per chunk), HBM bytes per argument byte, the "
             "roofline time. `verify N` = the verify pass over a bucket of N scheduled tokens. Simulator GB: the "
             "serving simulator's roofline (`serving/hardware.py`) of the same pass per chip, at the compiled cache "
             "length.", ""]
    for c in cells:
        lines += [f"### {c['accelerator_type']} ({c['topology']}), {c['rows']} request slot(s), "
                  f"{c['prompt_tokens']} + {c['max_new_tokens']} tokens, scheduler {c['scheduler']}", "",
                  "| program | memory GB | fits | collectives | GFLOP | HBM GB | bytes/args | roofline ms | bound "
                  "| simulator GB |",
                  "|---|---:|:-:|---|---:|---:|---:|---:|---|---:|"]
        sim = simulated(c)
        for p in c["programs"]:
            collectives = ", ".join(f"{n} {k}" for k, n in p["collectives"].items()) or "none"
            star = "*" if p["dynamic_loops"] else ""
            lines.append(f"| {p['name']} | {p['per_chip_bytes'] / 1e9:.2f} | {'yes' if p['fits'] else 'NO'} | "
                         f"{collectives} | {p['flops'] / 1e9:,.1f} | {p['bytes_accessed'] / 1e9:.2f}{star} | "
                         f"{p['bytes_accessed'] / p['argument_bytes']:.2f} | {1e3 * p['roofline_s']:.2f} | "
                         f"{p['bound']} | {common.fmt(sim[p['name']] / 1e9 if p['name'] in sim else None)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
