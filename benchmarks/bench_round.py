"""Where a decoding step's time goes: the target's forward at 1..8 new tokens, and a speculative round
split into its parts, for each decoder layer layout, in one run.

    python benchmarks/bench_round.py [--layouts per_layer,stacked] [--dtypes float32,bfloat16] [--context 256]
        [--cache 512] [--repeats 15] [--batch 1] [--draft-vocab 8192,16384]

Rows (batch --batch, default 1, SmolLM2-135M with the shipped drafter in each --dtypes, medians of --repeats, compilation excluded):
* `forward T=n`: the target's extend pass over n new tokens at --context committed tokens, LM head
  on the last position, the cache donated (what a plain decode step or a padded verify pass costs);
* `forward T=1, long`: the same decode step at a context of --long-context tokens;
* `target pass, verify's outputs`: the target's pass over the anchor + gamma drafts with what the
  verify pass needs of it: the logits of every position and the drafter's tap features;
* `draft`: the drafter's pass for one row (backbone, head scan, confidence, schedule), with the
  params the engine decodes with (`LoadedDrafter.decoding_params`: the shipped drafter's bf16 weights
  in its decoding layout);
* `verify + commit`: the verify pass over the anchor + gamma drafts, acceptance, cache commit;
* `round`: a whole round as the engine runs it (host round trip included);
* with --draft-vocab N,...: `draft` and `round` again, per N, with the shipped drafter given the N most frequent
  response tokens of --data as its draft vocabulary (`python -m dspark_jax.draft_vocab`).
The ratios below them: verify + commit over the target's pass with its outputs, the round over
draft + verify, the round over a plain step (`forward T=1`), and `forward T=8 / forward T=1`.

Every row's program runs once per repeat in turn (round-robin), so a slow phase of the machine
touches every row alike and the ratios are measured side by side.

--profile adds, per layout and dtype, where `forward T=1`, `forward T=8`, `draft` and `verify + commit`
spend their time:
a `jax.profiler` trace of a few executions, each op's time summed by kind (our kernels' products by
weight shape, the decode attention, XLA's own ops).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import int_list, products_note, write_results  # noqa: E402


def interleaved_ms(timers: dict, repeats: int) -> dict[str, float]:
    """{name: median wall ms} of timers {name: (run, make)}: each run(*make()) once per repeat in
    turn, after one warm-up round; make() is untimed."""
    import jax

    times = {name: [] for name in timers}
    for i in range(repeats + 1):
        for name, (run, make) in timers.items():
            args = make()
            jax.block_until_ready(args)
            t0 = time.perf_counter()
            jax.block_until_ready(run(*args))
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def median_ms(run, make, repeats: int) -> float:
    """Median wall ms of run(*make()) over `repeats` calls after one warm-up; make() is untimed."""
    return interleaved_ms({"": (run, make)}, repeats)[""]


def op_kinds(program) -> dict[str, str]:
    """{HLO instruction name: kind} for a compiled program's top-level instructions: our products
    named by their weight's shape and dtype, our decode attention, and everything else as XLA's."""
    kinds = {}
    for line in program.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if not m:
            continue
        kind = "XLA ops (fusions, copies, reductions)"
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and target.group(1).startswith("dspark_matmul"):
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", line.split("operand_layout_constraints=", 1)[-1])
            dtype, dims = shapes[1] if len(shapes) > 1 else ("?", "?")
            kind = f"product, weights {dtype}[{dims}]"
        elif target and target.group(1).startswith("dspark_decode_attention"):
            kind = "decode attention (our kernel)"
        kinds.setdefault(m.group(1), kind)
    return kinds


def op_profile(program, make, runs: int = 5) -> dict[str, dict]:
    """{kind: {"ms": per execution, "calls": per execution}} of `program` (jax.stages.Compiled) over
    `runs` traced executions on inputs from make() (made before the trace, untraced)."""
    import jax

    kinds = op_kinds(program)
    inputs = [make() for _ in range(runs)]
    jax.block_until_ready(inputs)
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for args in inputs:
            jax.block_until_ready(program(*args))
        jax.profiler.stop_trace()
        traces = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(traces[0]) as f:
            events = json.load(f)["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        kind = kinds.get(e.get("name")) if e.get("ph") == "X" else None
        if kind:
            total[kind] += e["dur"] / 1e3 / runs
            calls[kind] += 1 / runs
    return {k: {"ms": total[k], "calls": calls[k]} for k, _ in total.most_common()}


def forward_program(target, tokens: int, context: int, cache_len: int, batch: int = 1):
    """(compiled step, make) for the target's extend pass: see forward_ms."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.models import decoder

    cfg, params = target.config, target.params

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, new):
        hidden, cache, _ = decoder.forward(params, cfg, new, cache, jnp.full((batch,), tokens, jnp.int32))
        return jnp.argmax(decoder.logits(params, cfg, hidden[:, -1]), -1), cache

    def make():
        cache = decoder.cache_for(params, cfg, batch, cache_len)
        cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
        return params, cache, jnp.ones((batch, tokens), jnp.int32)

    return step.lower(*make()).compile(), make


def forward_ms(target, tokens: int, context: int, cache_len: int, repeats: int, batch: int = 1) -> float:
    """The target's extend pass over `tokens` new tokens per row for `batch` rows at `context`
    committed tokens (cache donated), LM head and argmax on the last position: a plain decode step
    for tokens=1."""
    return median_ms(*forward_program(target, tokens, context, cache_len, batch), repeats)


def verify_outputs_program(target, tap_layers, tokens: int, context: int, cache_len: int, batch: int = 1):
    """(compiled pass, make): the target's extend pass over `tokens` new tokens per row returning
    what a verify pass uses of it, the logits of every position and the tap features (cache donated)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.models import decoder

    cfg, params = target.config, target.params

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, new):
        hidden, cache, taps = decoder.forward(params, cfg, new, cache, jnp.full((batch,), tokens, jnp.int32), tap_layers)
        return decoder.logits(params, cfg, hidden), jnp.concatenate(list(taps), -1), cache

    def make():
        cache = decoder.cache_for(params, cfg, batch, cache_len)
        cache = dataclasses.replace(cache, lengths=jnp.full((batch,), context, jnp.int32))
        return params, cache, jnp.ones((batch, tokens), jnp.int32)

    return step.lower(*make()).compile(), make


def round_timers(target, drafter, context: int, repeats: int, batch: int = 1, profile: dict | None = None,
                 label: str = "") -> dict:
    """Timers (see interleaved_ms) of the draft, verify + commit and the whole round for `batch`
    rows (the same prompt), fixed gamma = the block size, greedy; names suffixed with `label`.
    `drafter`: anything with .config and .params. With `profile` (a dict), profile["draft"] and
    profile["verify + commit"] get their `op_profile`."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine.speculative import SpecConfig, round_program, spec_draft, spec_prefill, spec_verify
    from dspark_jax.engine.generate import bucket, compiled

    tcfg, dcfg = target.config, drafter.config
    cfg = SpecConfig(gamma=dcfg.block_size)
    statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    max_new = (repeats + 2) * 3 * (cfg.gamma + 1)
    # the engine's cache length (`generate.pad_prompts`): a bucket, a multiple of 16 that our decode
    # attention kernel needs (792 positions here would run XLA's attention in the verify pass)
    max_len = bucket(context + max_new + cfg.gamma + 1, minimum=64)
    prompt = jnp.asarray([[(7 * i) % 1000 + 10 for i in range(context)]] * batch, jnp.int32)

    def fresh():
        return spec_prefill(target.params, drafter.params, prompt, jnp.full((batch,), context, jnp.int32),
                            jnp.full((batch,), max_new, jnp.int32), jax.random.key(0), max_len=max_len, **statics)

    state = fresh()
    run_draft = compiled(spec_draft, (target.params, drafter.params, state, None), statics)
    run_verify = compiled(spec_verify, (target.params, drafter.params, state, run_draft.out_info), statics)
    run_round = round_program(target.params, drafter.params, state, None, **statics)
    holder = {"state": fresh()}  # the verify and round timers step it on (each donates it)

    def draft_args():
        return (target.params, drafter.params, holder["state"], None)

    def verify(tp, dp, st, drafted):
        holder["state"], stats = run_verify(tp, dp, st, drafted)
        return holder["state"]

    def whole(tp, dp, st, temps):
        holder["state"], _ = run_round(tp, dp, st, temps)
        return holder["state"]

    if profile is not None:
        profile["draft"] = op_profile(run_draft, draft_args)

        def verify_args():  # a state of its own per execution: the verify pass donates it
            state = fresh()
            return target.params, drafter.params, state, run_draft(target.params, drafter.params, state, None)

        profile["verify + commit"] = op_profile(run_verify, verify_args)
    timers = {"draft": (run_draft, draft_args),
              "verify + commit": (verify, lambda: draft_args()[:3] + (run_draft(*draft_args()),)),
              "round": (whole, draft_args)}
    return {f"{name}{label}": timer for name, timer in timers.items()}


def profile_markdown(results: list[dict]) -> str:
    """One table per layout and dtype: ms per execution (calls) of each op kind, per profiled program."""
    out = []
    for r in results:
        programs = list(r["profile"])
        kinds = list(dict.fromkeys(k for p in programs for k in r["profile"][p]))
        out += [f"\nWhere the time goes, {r['layout']}, {r['dtype']} (ms per execution, calls; a traced run of 5):\n",
                "| op kind | " + " | ".join(programs) + " |", "|---|" + "---:|" * len(programs)]
        for k in kinds:
            cells = [r["profile"][p].get(k) for p in programs]
            out.append(f"| {k} | " + " | ".join(f"{c['ms']:.2f} ({c['calls']:.0f})" if c else "-" for c in cells) + " |")
        out.append("| sum | " + " | ".join(f"{sum(c['ms'] for c in r['profile'][p].values()):.2f}" for p in programs) + " |")
    return "\n".join(out) + "\n"


RATIOS = {  # name: (numerator rows, denominator rows)
    "verify + commit / target pass with its outputs": (("verify + commit",), ("target pass, verify's outputs",)),
    "round / (draft + verify + commit)": (("round",), ("draft", "verify + commit")),
    "round / plain step": (("round",), ("forward T=1",)),
    "verify 8 / decode 1": (("forward T=8",), ("forward T=1",)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="per_layer,stacked")
    ap.add_argument("--dtypes", default="float32",
                    help="weight dtypes, one column each per layout (bfloat16: bf16 weights, fp32 activations on a CPU)")
    ap.add_argument("--context", type=int, default=256, help="committed tokens before the measured step")
    ap.add_argument("--cache", type=int, default=512, help="KV-cache length (positions)")
    ap.add_argument("--long-context", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--batch", type=int, default=1, help="request rows decoded together (the same prompt in each)")
    ap.add_argument("--draft-vocab", type=int_list, default=[],
                    help="comma-separated N: also time the draft and the round with an N-token draft vocabulary from --data "
                         "(0: the whole vocabulary, whatever the shipped drafter has)")
    ap.add_argument("--data", default="datasets/smollm2-135m/train", help="the drafter's training data (--draft-vocab)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--name", default="round", help="results file name")
    ap.add_argument("--profile", action="store_true",
                    help="also trace forward T=1 and T=8, the draft and the verify pass: time per op kind (products by weight shape, attention, XLA ops)")
    ap.add_argument("--xla-dot", action="store_true",
                    help="fp32 few-row products through XLA's dot instead of our CPU kernel (DSPARK_CPU_KERNELS=0)")
    args = ap.parse_args()
    if args.xla_dot:
        os.environ["DSPARK_CPU_KERNELS"] = "0"  # read when the first program is traced

    from dspark_jax.checkpoints.registry import default_drafter_path, load_target
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.training.draft_vocab import with_draft_vocabulary

    results = []
    for layout, dtype in [(lay, dt) for lay in args.layouts.split(",") for dt in args.dtypes.split(",")]:
        target = load_target("smollm2-135m", dtype=dtype, layout=layout)
        loaded = load_drafter(default_drafter_path("smollm2-135m"), target.config, "smollm2-135m")
        drafter = dataclasses.replace(loaded, params=loaded.decoding_params(target))  # what the engine decodes with
        B = args.batch
        timers = {f"forward T={n}": forward_program(target, n, args.context, args.cache, B) for n in (1, 2, 4, 8)}
        timers["forward T=1, long"] = forward_program(target, 1, args.long_context, args.long_context + 128, B)
        timers["target pass, verify's outputs"] = verify_outputs_program(
            target, loaded.config.tap_layers, loaded.config.block_size + 1, args.context, args.cache, B)
        profile = {} if args.profile else None
        timers.update(round_timers(target, drafter, args.context, args.repeats, B, profile=profile))
        for n in args.draft_vocab:
            small = with_draft_vocabulary(loaded, args.data, n)
            small = dataclasses.replace(small, params=small.decoding_params(target))
            timers.update({k: v for k, v in round_timers(target, small, args.context, args.repeats, B,
                                                        label=f", {f'{n}-token draft' if n else 'whole'} vocabulary").items()
                           if not k.startswith("verify")})  # the verify pass is the same program
        row = {"layout": layout, "dtype": dtype, **interleaved_ms(timers, args.repeats)}
        for name, (num, den) in RATIOS.items():
            row[name] = sum(row[k] for k in num) / sum(row[k] for k in den)
        if args.profile:
            for n in (1, 8):
                profile[f"forward T={n}"] = op_profile(*forward_program(target, n, args.context, args.cache))
            row["profile"] = profile
        results.append(row)
        print({k: v for k, v in row.items() if k != "profile"}, flush=True)

    keys = [k for k in results[0] if k not in ("layout", "dtype", "profile")]
    md = [f"| ms (batch {args.batch}) | " + " | ".join(f"{r['layout']}, {r['dtype']}" for r in results) + " |",
          "|---|" + "---:|" * len(results)]
    for k in keys:
        fmt = "{:.2f}x" if k in RATIOS else "{:.1f}"
        md.append(f"| {k} | " + " | ".join(fmt.format(r[k]) for r in results) + " |")
    md.append(f"\nSmolLM2-135M-Instruct (weights in the column's dtype, activations fp32), shipped DSpark drafter (gamma = its block size), greedy; context "
              f"{args.context} tokens in a {args.cache}-position cache (`long`: {args.long_context} in "
              f"{args.long_context + 128}); medians of {args.repeats}, every program run once per repeat in turn; "
              "nothing else ran on the machine.\n")
    md.append(products_note(args.xla_dot))
    if args.profile:
        md.append(profile_markdown(results))
    paths = write_results(args.name, {"rows": results, "context": args.context, "cache": args.cache},
                          "\n".join(md), **({"directory": args.out} if args.out else {}))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
