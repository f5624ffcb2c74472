"""Part 2 of benchmarks/accelerator.py, breakdown: one round at batch 1, 128, 32, 8 and gamma 4, 8,
16 (random drafters of the model's shape with block size gamma; context 512): drafter backbone, the
sequential head's scan (none / Markov / Markov + confidence / RNN + confidence, each as
`dspark.propose` minus the backbone), the dspark and dspark-async schedules, the target's verify
pass, accept + commit, the whole round on the device and as the engine runs it (host time = the
difference), and the head's share of the round (the paper: 0.2-1.3%); then bench_head_cost's
direct check (whole rounds with the head vs without, alternating) at two points. Qwen3-8B shape
first, then SmolLM2.
"""

from __future__ import annotations

import statistics
import time
import types
from typing import TYPE_CHECKING

from device_setup import random_drafter_params
from device_sps import target_pass_ms

if TYPE_CHECKING:
    from accelerator import Run
    from device_setup import Model, Models, Sizes


def head_variants(model: Model, cache: dict) -> dict:
    """name -> (drafter config at the model's block size, params in the target dtype) of the head
    variants: dflash (no head, no confidence), markov, dspark (Markov + confidence), rnn (+ confidence).
    Parameters do not depend on the block size, so one set per variant serves every gamma."""
    key = ("variants", model.key)
    if key not in cache:
        r = model.dcfg.markov_rank or 64
        heads = {"dflash": dict(head="none", markov_rank=0, confidence=False),
                 "markov": dict(head="markov", markov_rank=r, confidence=False),
                 "dspark": dict(head="markov", markov_rank=r, confidence=True),
                 "rnn": dict(head="rnn", markov_rank=r, confidence=True)}
        out = {}
        for name, head in heads.items():
            dcfg = model.dcfg.replace(**head)
            out[name] = (dcfg, random_drafter_params(dcfg, model.target.config.dtype))
        cache[key] = out
    return cache[key]


def backbone_logits(dparams, dcfg, target_params, tcfg, cache, anchors):
    """The first half of `dspark.propose`: the block's one parallel backbone pass + the target's LM head."""
    import jax.numpy as jnp

    from dspark_jax.drafters import dspark
    from dspark_jax.models import decoder

    offsets = jnp.arange(dcfg.block_size, dtype=jnp.int32)
    block_tokens = jnp.where(offsets == 0, anchors[:, None], jnp.int32(dcfg.mask_token_id))[:, None]
    block_positions = (cache.lengths[:, None] + offsets)[:, None]
    ctx_visible = (jnp.arange(cache.max_len) < cache.lengths[:, None])[:, None, :]
    hidden = dspark._backbone(dparams, dcfg, target_params, block_tokens, block_positions,
                              lambda lp, layer: (cache.k[layer], cache.v[layer]), ctx_visible)[:, 0]
    return decoder.logits(target_params, tcfg, hidden)


def breakdown_item(model: Model, batch: int, gamma: int, s: Sizes, cache: dict) -> dict:
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_round import interleaved_ms, median_ms, round_timers
    from dspark_jax.drafters import dspark
    from dspark_jax.engine import scheduler as S
    from dspark_jax.engine.generate import bucket
    from dspark_jax.engine.speculative import SpecConfig, round_program, schedule, spec_prefill
    from dspark_jax.engine.sps import SPSTable, token_buckets
    from dspark_jax.models.sampling import SamplingConfig

    target, tcfg, reps = model.target, model.target.config, s.bd_repeats
    tp = target.params
    variants = {k: (c.replace(block_size=gamma), p) for k, (c, p) in head_variants(model, cache).items()}
    dcfg, dparams = variants["dspark"]
    # Draft (backbone + head scan + confidence + fixed schedule), verify + commit, the round: bench_round's.
    drafter = types.SimpleNamespace(config=dcfg, params=dparams)
    out = {f"{k}_ms": v for k, v in interleaved_ms(round_timers(target, drafter, s.bd_context, reps, batch=batch),
                                                   reps).items()}
    out = {k.replace(" + ", "_").replace(" ", "_"): v for k, v in out.items()}  # draft_ms, verify_commit_ms, round_ms
    # A state of the same shape as round_timers' (its prefill and round programs are reused).
    cfg = SpecConfig(gamma=gamma)
    max_new = (reps + 2) * 3 * (gamma + 1)
    max_len = bucket(s.bd_context + max_new + gamma + 1, minimum=64)
    prompt = jnp.asarray([[(7 * i) % 1000 + 10 for i in range(s.bd_context)]] * batch, jnp.int32)
    state = spec_prefill(tp, dparams, prompt, jnp.full((batch,), s.bd_context, jnp.int32),
                         jnp.full((batch,), max_new, jnp.int32), jax.random.key(0), tcfg=tcfg, dcfg=dcfg, cfg=cfg,
                         max_len=max_len)
    # The round as the engine runs it (speculative_generate's loop body): stats to the host, done check.
    run_round = round_program(tp, dparams, state, None, tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        state, stats = run_round(tp, dparams, state, None)
        {k: np.asarray(v) for k, v in dc.asdict(stats).items()}
        bool(jnp.all(state.done))
        if i:
            times.append(time.perf_counter() - t)
    out["engine_round_ms"] = 1e3 * statistics.median(times)
    # The drafter's pieces, on this state's drafter cache (all variants share the backbone's shapes).
    dcache, anchors, key = state.draft.cache, state.anchor, jax.random.key(0)
    bb = jax.jit(lambda dp, tp, c, a: backbone_logits(dp, dcfg, tp, tcfg, c, a))
    out["backbone_ms"] = median_ms(bb, lambda: (dparams, tp, dcache, anchors), reps)

    def propose_program(vcfg):
        return jax.jit(lambda dp, tp, c, a, k: dspark.propose(dp, vcfg, tp, tcfg, c, a, k, SamplingConfig()))

    for name, (vcfg, vparams) in variants.items():
        out[f"propose_{name}_ms"] = median_ms(propose_program(vcfg), lambda vparams=vparams: (vparams, tp, dcache,
                                                                                            anchors, key), reps)
    # The confidence schedulers (with an SPS table of the right buckets; its values do not change the cost).
    buckets = token_buckets(batch * (gamma + 1))
    table = SPSTable(buckets, tuple(1.0 / (1.0 + 0.01 * b) for b in buckets))
    conf = jax.random.normal(jax.random.key(2), (batch, gamma), jnp.float32)
    active = jnp.ones((batch,), bool)

    def schedule_program(policy):
        pcfg = SpecConfig(gamma=gamma, policy=policy, sps=table)
        return jax.jit(lambda c, a, st: schedule(pcfg, c, None, a, st))

    for policy in ("dspark", "dspark_async"):
        out[f"schedule_{policy}_ms"] = median_ms(schedule_program(policy),
                                                 lambda: (conf, active, S.init_async_state(batch)), reps)
    # The target's verify pass alone (padded [B, gamma + 1] as spec_round runs it), cache donated: last,
    # since it consumes the state's cache.
    verify_tokens = jnp.concatenate([state.anchor[:, None], jnp.ones((batch, gamma), jnp.int32)], axis=1)
    out["verify_ms"] = target_pass_ms(target, dcfg.tap_layers, state.cache, verify_tokens,
                                      jnp.full((batch,), gamma + 1, jnp.int32), None, reps)
    del state
    p = out
    p["scan_dflash_ms"] = p["propose_dflash_ms"] - p["backbone_ms"]  # sampling each slot, no head
    p["markov_head_ms"] = p["propose_markov_ms"] - p["propose_dflash_ms"]
    p["confidence_ms"] = p["propose_dspark_ms"] - p["propose_markov_ms"]
    p["rnn_head_ms"] = p["propose_rnn_ms"] - p["propose_dflash_ms"]  # RNN head + confidence
    p["accept_commit_ms"] = p["verify_commit_ms"] - p["verify_ms"]
    p["host_ms"] = p["engine_round_ms"] - p["round_ms"]
    p["head_share_dspark"] = (p["propose_dspark_ms"] - p["propose_dflash_ms"]) / p["round_ms"]
    p["head_share_rnn"] = p["rnn_head_ms"] / (p["round_ms"] + p["propose_rnn_ms"] - p["propose_dspark_ms"])
    p["schedule_share"] = p["schedule_dspark_async_ms"] / p["round_ms"]
    return {"model": model.key, "batch": batch, "gamma": gamma, "context": s.bd_context,
            "drafter": f"{dcfg.num_layers} layers, rank {dcfg.markov_rank}", **p}


def direct_head_share(model: Model, batch: int, gamma: int, s: Sizes, cache: dict) -> dict:
    """bench_head_cost's check: whole rounds with the DSpark head vs the same drafter without (DFlash)."""
    from bench_head_cost import time_round_variants

    variants = {k: (c.replace(block_size=gamma), p) for k, (c, p) in head_variants(model, cache).items()
                if k in ("dspark", "dflash")}
    prompt = [(7 * i) % 1000 + 10 for i in range(s.bd_context)]
    timings = time_round_variants(model.target, prompt, batch, gamma, variants, s.bd_direct_rounds,
                                  max_new_tokens=8 * (gamma + 1))
    with_head, without = (statistics.median(timings[n]) for n in ("dspark", "dflash"))
    return {"model": model.key, "batch": batch, "gamma": gamma, "round_ms_dspark": 1e3 * with_head,
            "round_ms_dflash": 1e3 * without, "head_share": (with_head - without) / with_head}


def part_breakdown(run: Run, models: Models) -> None:
    s, cache = run.sizes, {}
    for key in s.bd_models:
        for batch in s.bd_batches:
            for gamma in s.bd_gammas:
                run.item(f"{key} batch {batch} gamma {gamma}",
                         lambda key=key, b=batch, g=gamma: breakdown_item(models.get(key), b, g, s, cache))
    for key in s.bd_models[:1]:
        for batch, gamma in s.bd_direct:
            run.item(f"{key} batch {batch} gamma {gamma}: direct head share",
                     lambda key=key, b=batch, g=gamma: direct_head_share(models.get(key), b, g, s, cache))
    cache.clear()
    run.finish("breakdown")


BD_COLUMNS = [("backbone", "backbone_ms"), ("scan, no head", "scan_dflash_ms"), ("Markov head", "markov_head_ms"),
              ("confidence", "confidence_ms"), ("RNN head + conf.", "rnn_head_ms"),
              ("sched. dspark", "schedule_dspark_ms"), ("sched. async", "schedule_dspark_async_ms"),
              ("draft", "draft_ms"), ("verify", "verify_ms"), ("accept + commit", "accept_commit_ms"),
              ("round", "round_ms"), ("host", "host_ms")]


def md_breakdown(items: list[dict]) -> list[str]:
    rows = [i["result"] for i in items if "head_share_dspark" in i["result"]]
    direct = [i["result"] for i in items if "round_ms_dflash" in i["result"]]
    md = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: (r["batch"], r["gamma"]))
        md += [f"**{model}** (drafter {mine[0]['drafter']}, context {mine[0]['context']}), ms:", "",
               "| batch | gamma | " + " | ".join(c for c, _ in BD_COLUMNS) + " | head share (Markov + conf.) | "
               "head share (RNN + conf.) |", "|---:|---:|" + "---:|" * (len(BD_COLUMNS) + 2)]
        for r in mine:
            md.append(f"| {r['batch']} | {r['gamma']} | " + " | ".join(f"{r[k]:.3f}" for _, k in BD_COLUMNS)
                      + f" | {100 * r['head_share_dspark']:.2f}% | {100 * r['head_share_rnn']:.2f}% |")
        md.append("")
    if rows:
        md.append("Medians, compilation excluded, greedy. backbone = the block's parallel pass + the target's LM head "
                  "(the first half of `dspark.propose`); scan, no head = `propose` of the same drafter without head "
                  "(DFlash) minus the backbone (sampling every slot); Markov head / confidence / RNN head = the "
                  "difference they make to `propose`; sched. = `speculative.schedule` (survival + Algorithm 1, or the "
                  "async top-K + global search); draft = `spec_draft` (backbone + Markov head + confidence + fixed "
                  "schedule); verify = the target's pass over [B, gamma + 1] (cache donated); accept + commit = "
                  "`spec_verify` minus verify; round = `spec_round` on the device (bench_round); host = the engine's "
                  "round (speculative_generate's loop body: stats to the host, done check) minus round. Head share = "
                  "(propose with head - propose without) / round; the paper's claim is 0.2-1.3%.\n")
    if direct:
        md += ["Direct check (bench_head_cost: whole rounds, head on vs off, alternating, fresh prefill each):", "",
               "| model | batch | gamma | round with head ms | round without ms | head share |", "|---|---:|---:|---:|---:|---:|"]
        md += [f"| {r['model']} | {r['batch']} | {r['gamma']} | {r['round_ms_dspark']:.3f} | {r['round_ms_dflash']:.3f} | "
               f"{100 * r['head_share']:+.2f}% |" for r in direct]
        md.append("")
    return md
