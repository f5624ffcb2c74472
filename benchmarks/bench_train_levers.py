"""Training levers side by side: step time, blocks/s and held-out expected tau after the same CPU budget.

    python benchmarks/bench_train_levers.py [--config configs/dspark_smollm2-135m.yaml] \
        [--data data/smollm2-train] [--first-shards N] [--eval-data data/smollm2-eval] [--budget-s 480] \
        [--levers base,vocab8k,vocab16k,init,rows16] [--eval-batches 16] [--name train_levers]

With --budget-s 0 only the step times are measured.

Each lever is a set of config overrides on the same base config (LEVERS below). For each, in its own
process: a short run times the step (steps 3.. of --timing-steps; the first two compile), which
gives how many steps fit in --budget-s; then a fresh run from the same seed trains exactly that
many steps (its learning-rate schedule ends there, as a run of that length would) on the same data
stream and measures the held-out teacher-forced tau proxy (`eval_expected_tau`) on the first
--eval-batches batches of --eval-data, the same batches for every lever. Levers that change what
a batch holds (rows, anchors) see other batches; the budget is what they are compared at.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results  # noqa: E402

LEVERS = {
    "base": [],
    "vocab4k": ["drafter.draft_vocab_size=4096"],
    "vocab8k": ["drafter.draft_vocab_size=8192"],
    "vocab16k": ["drafter.draft_vocab_size=16384"],
    "init": ["optim.init_from_target=true"],
    "rows16": ["data.rows=16"],
    "anchors8": ["data.anchors_per_seq=8"],
    "anchors32": ["data.anchors_per_seq=32", "data.blocks_per_row=64"],
    # target features read from a cache built once (data.feature_cache, --feature-cache; not timed)
    "cache": ["data.feature_cache={feature_cache}"],
    "cache_vocab8k": ["data.feature_cache={feature_cache}", "drafter.draft_vocab_size=8192"],
    "bf16": ["run.compute_dtype=bfloat16"],
    "bf16_vocab8k": ["run.compute_dtype=bfloat16", "drafter.draft_vocab_size=8192"],
    "vocab8k_init": ["drafter.draft_vocab_size=8192", "optim.init_from_target=true"],
    "cache_vocab16k": ["data.feature_cache={feature_cache}", "drafter.draft_vocab_size=16384"],
    "cache_vocab32k": ["data.feature_cache={feature_cache}", "drafter.draft_vocab_size=32768"],
    "cache_init": ["data.feature_cache={feature_cache}", "optim.init_from_target=true"],
    "cache_vocab16k_init": ["data.feature_cache={feature_cache}", "drafter.draft_vocab_size=16384",
                            "optim.init_from_target=true"],
    # bf16 drafter math on fp32 features: the cache holds the fp32 target's features (stored bf16)
    "cache_vocab16k_init_bf16": ["data.feature_cache={feature_cache}", "drafter.draft_vocab_size=16384",
                                 "optim.init_from_target=true", "run.compute_dtype=bfloat16"],
}


def run_lever(args, overrides: list[str]) -> dict:
    """Time the step, then train for the budget and evaluate (in this process)."""
    import json as _json

    import numpy as np

    from bench_train import make_trainer

    common = [f"data.eval_dir={args.eval_data}", f"run.eval_batches={args.eval_batches}", "run.eval_every=0",
              *overrides]
    trainer = make_trainer(args.config, args.timing_steps, args.data, None, overrides=common)
    target = trainer.target
    state = trainer.init_state(trainer.cfg.data.seed)
    times, blocks = [], 0
    for i in range(args.timing_steps):
        batch, batch_blocks = trainer.next_batch()
        t = time.perf_counter()
        state, metrics = trainer.train_step(state, trainer.target_params, batch)
        float(metrics["loss"])  # waits for the step
        if i >= 2:
            times.append(time.perf_counter() - t)
            blocks += batch_blocks
    trainer.close()
    step_s = float(np.median(times))
    steps = max(1, int(args.budget_s / step_s))
    coverage = trainer.draft_vocab_coverage
    timing = {"overrides": overrides, "step_s": step_s, "blocks_per_s": blocks / sum(times),
              "draft_vocab_coverage": coverage}
    if args.budget_s <= 0:  # step times only
        return timing

    trainer = make_trainer(args.config, steps, args.data, None, target=target, overrides=common)
    t = time.perf_counter()
    trainer.fit(progress=False)
    wall = time.perf_counter() - t
    trainer.close()
    log = [_json.loads(line) for line in open(os.path.join(trainer.cfg.run.out_dir, "metrics.jsonl"))]
    last = log[-1]
    return {**timing, "steps": steps, "train_wall_s": wall,
            "train_expected_tau_last": float(np.mean([r["expected_tau"] for r in log[-10:]])),
            "eval_expected_tau": last.get("eval_expected_tau"),
            "eval_acceptance_per_position": last.get("eval_acceptance_per_position")}


def first_shards(data: str, count: int, folder: str) -> str:
    """A view of the first `count` shards of the datagen folder `data` in `folder` (links to the
    shards and a manifest listing only them): a slice of a large run to compare levers on."""
    from dspark_jax.core import files

    manifest = json.load(open(os.path.join(data, "manifest.json")))
    shards = manifest["shards"][:count]
    if len(shards) < count:
        sys.exit(f"error: {data} has {len(shards)} shards, fewer than --first-shards {count}")
    os.makedirs(folder, exist_ok=True)
    for shard in shards:
        link = os.path.join(folder, shard["file"])
        if not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(data, shard["file"])), link)
    view = dict(manifest, shards=shards, complete=False, num_examples=sum(s["num_examples"] for s in shards),
                num_tokens=sum(s["num_tokens"] for s in shards),
                response_tokens=sum(s["response_tokens"] for s in shards))
    files.atomic_write_json(os.path.join(folder, "manifest.json"), view)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/dspark_smollm2-135m.yaml")
    ap.add_argument("--data", default="data/smollm2-train")
    ap.add_argument("--eval-data", default="data/smollm2-eval")
    ap.add_argument("--budget-s", type=float, default=480.0, help="training seconds per lever (0: step times only)")
    ap.add_argument("--levers", default="base,vocab8k,vocab16k,init,rows16")
    ap.add_argument("--timing-steps", type=int, default=8)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--feature-cache", default="data/smollm2-train-features",
                    help="the levers' feature cache folder (built on first use for --data)")
    ap.add_argument("--first-shards", type=int, default=0,
                    help="train on the first N shards of the datagen folder --data only (a view in "
                         "data/views/NAME-firstN, reused by later runs)")
    ap.add_argument("--name", default="train_levers")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this lever, print its JSON
    args = ap.parse_args()
    if args.one:
        overrides = [o.format(feature_cache=args.feature_cache) for o in LEVERS[args.one]]
        print("RESULT " + json.dumps(run_lever(args, overrides)), flush=True)
        return
    if args.first_shards:
        name = f"{os.path.basename(args.data.rstrip('/'))}-first{args.first_shards}"
        args.data = first_shards(args.data, args.first_shards, os.path.join("data", "views", name))
    names = [n.strip() for n in args.levers.split(",") if n.strip()]
    unknown = [n for n in names if n not in LEVERS]
    if unknown:
        sys.exit(f"error: unknown lever(s) {', '.join(unknown)} (known: {', '.join(LEVERS)})")
    rows = []
    for name in names:  # one process each: the memory and compiled programs of one lever do not weigh on the next
        cmd = [sys.executable, os.path.abspath(__file__), "--one", name, "--config", args.config, "--data", args.data,
               "--eval-data", args.eval_data, "--budget-s", str(args.budget_s), "--timing-steps",
               str(args.timing_steps), "--eval-batches", str(args.eval_batches), "--feature-cache", args.feature_cache]
        out = subprocess.run(cmd, capture_output=True, text=True)
        found = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode or not found:
            sys.exit(f"error: lever {name} failed:\n{out.stderr[-3000:]}")
        row = {"lever": name, **json.loads(found[-1][len("RESULT "):])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    trained = args.budget_s > 0
    md = ["| lever | overrides | step s | blocks/s | draft vocab coverage |"
          + (" steps in budget | train tau (last 10) | held-out tau |" if trained else ""),
          "|---|---|---:|---:|---:|" + ("---:|---:|---:|" if trained else "")]
    for r in rows:
        cov = "" if r["draft_vocab_coverage"] is None else f"{100 * r['draft_vocab_coverage']:.2f}%"
        line = f"| {r['lever']} | {' '.join(r['overrides']) or '-'} | {r['step_s']:.2f} | {r['blocks_per_s']:.1f} | {cov} |"
        if trained:
            line += f" {r['steps']} | {r['train_expected_tau_last']:.3f} | {r['eval_expected_tau']:.3f} |"
        md.append(line)
    md.append(f"\nStep time: the median of steps 3..{args.timing_steps} (from the host batch to the finished "
              f"update), config {args.config} with the overrides, on {args.data}; target features computed in the step "
              "(online) unless the lever reads a feature cache.")
    if trained:
        md.append(f"Each lever then trains for {args.budget_s:.0f} s of this machine's CPU (steps = budget / median "
                  f"step time) from the same seed; held-out tau: the teacher-forced expected accepted length on the "
                  f"first {args.eval_batches} batches of {args.eval_data} (eval split), after the last step.")
    md.append("")
    paths = write_results(args.name, {"rows": rows, "budget_s": args.budget_s},
                          "\n".join(md), **({"directory": args.out} if args.out else {}))
    print("wrote", *paths)


if __name__ == "__main__":
    main()
