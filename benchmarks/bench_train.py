"""Training throughput and memory of the SmolLM2-135M drafter configs on this machine, with online
target features and (with --feature-cache) with the on-disk feature cache, side by side.

    python benchmarks/bench_train.py [--configs dspark,dflash,eagle3] [--steps 8] [--data data/smollm2-train]
                                     [--feature-cache data/smollm2-train-features] [--out benchmarks/results/train.md]

Each config runs in its own process (so the memory peak is its own) for --steps optimizer steps on
the real regenerated data; the first two steps (compilation) are excluded from the rates. A step is
timed from the host batch to the finished update (the transfer to the device included). It also
times the frozen target's feature pass alone on the same batches, which is the case for (or
against) caching target features on disk instead of running the target online.

With --feature-cache DIR (a cache of the same --data: `data.feature_cache`, built by a separate
process first when DIR holds no complete cache) each config's process trains two states from the
same initialisation on the same batches, and on every step times both: online (the step runs the
target) and cached (the host gathers the batch's features from DIR, `Trainer.host_batch`, and the
step skips the target; the gather and the larger transfer count in the cached time: like the
training loop, nothing overlaps them with the device's work), alternating which goes first. The
machine is noisy, so the ratio is only meaningful from one such paired run.
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

from common import output_paths, write_results  # noqa: E402


def make_trainer(config: str, steps: int, data: str, feature_cache: str | None, target=None, overrides=()):
    """The Trainer of `config` on `data` (opening the feature cache, building it if missing), with
    `target` (default: the config's, loaded) and further `key=value` config overrides."""
    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.training.config import load_config
    from dspark_jax.training.trainer import Trainer

    out_dir = tempfile.mkdtemp(prefix="bench-train-")
    overrides = [f"optim.steps={steps}", f"data.train_dir={data}", f"run.out_dir={out_dir}",
                 "run.save_every=100000", "run.log_every=1", *overrides]
    if feature_cache:
        overrides.append(f"data.feature_cache={feature_cache}")
    cfg = load_config(config, overrides)
    return Trainer(cfg, load_target(cfg.target) if target is None else target)


def time_steps(trainer, steps: int, cached: bool) -> dict:
    """Run `steps` steps of `trainer` and time steps 2.. (0 and 1 compile).

    Always the online variant (the batch without features; the step runs the target). With `cached`
    (the trainer has a feature cache) also the cached variant on the same host batch, from its own
    state (the jitted step donates its state argument; both start from the same initialisation), the
    two alternating which goes first. Also the target's feature pass alone on each online batch
    (compiled in step 0 like the steps)."""
    import jax
    import numpy as np

    from dspark_jax.data.pipeline import target_features
    from dspark_jax.training.trainer import target_feature_inputs

    # the target as the online step runs it (params in the compute dtype)
    feature_params, feature_cfg = target_feature_inputs(trainer.target_params, trainer.target.config,
                                                        trainer.cfg.run.compute_dtype)
    states = {"online": trainer.init_state()}
    if cached:
        states["cached"] = trainer.init_state()
    times = {variant: [] for variant in states}
    metrics: dict = {}
    gather_times, feature_times = [], []
    blocks = tokens = 0
    for step in range(steps):
        batch = next(trainer.data)  # host arrays, token_index included
        order = list(states) if step % 2 == 0 else list(reversed(states))
        for variant in order:
            t = time.perf_counter()
            if variant == "cached":
                features = trainer.host_batch(batch)
                gather = time.perf_counter() - t
                device = trainer.device_batch(features)
            else:
                device = online = trainer.device_batch(batch)  # drops token_index: no features
            states[variant], metrics[variant] = trainer.train_step(states[variant], trainer.target_params, device)
            jax.block_until_ready((states[variant], metrics[variant]))
            if step >= 2:
                times[variant].append(time.perf_counter() - t)
                if variant == "cached":
                    gather_times.append(gather)
        t = time.perf_counter()  # every step, so that its compilation too falls in steps 0 and 1
        jax.block_until_ready(target_features(feature_params, feature_cfg, online, trainer.dcfg.tap_layers))
        if step >= 2:
            feature_times.append(time.perf_counter() - t)
            blocks += int(np.asarray(batch["block_valid"]).sum())
            tokens += int((np.asarray(batch["segment_ids"]) > 0).sum())
    total = sum(times["online"])
    result = {"steps_timed": len(times["online"]), "s_per_step": total / len(times["online"]),
              "blocks_per_s": blocks / total, "packed_tokens_per_s": tokens / total,
              "target_feature_share": sum(feature_times) / total,
              "final_loss": float(np.asarray(metrics["online"]["loss"]))}
    if cached:
        cached_total = sum(times["cached"])
        result.update({"s_per_step_cached": cached_total / len(times["cached"]), "speedup": total / cached_total,
                       "host_gather_ms": 1e3 * sum(gather_times) / len(gather_times),
                       "final_loss_cached": float(np.asarray(metrics["cached"]["loss"])),
                       "step_s_online": times["online"], "step_s_cached": times["cached"]})
    return result


def run_one(config: str, steps: int, data: str, feature_cache: str | None) -> dict:
    trainer = make_trainer(config, steps, data, feature_cache)
    result = time_steps(trainer, steps, cached=feature_cache is not None)
    trainer.close()
    cfg = trainer.cfg
    return {"config": os.path.basename(config), **result,
            "rows": cfg.data.rows, "seq_len": cfg.data.seq_len, "blocks_per_row": cfg.data.blocks_per_row,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def build_cache(config: str, data: str, feature_cache: str) -> dict:
    """Build the cache (what the Trainer does at startup when it is missing), in a process of its own
    so that neither its time nor its memory count in a config's measurements."""
    t = time.perf_counter()
    trainer = make_trainer(config, 1, data, feature_cache)
    trainer.close()
    return {"feature_cache": feature_cache, "build_s": time.perf_counter() - t}


def markdown(rows: list[dict], cached: bool) -> str:
    old = ("blocks/s", "packed tokens/s", "target-feature share", "peak RSS (GB)")
    if cached:
        head = ("config", "rows x seq_len (blocks/row)", "s/step online", "s/step cached", "speedup",
                "host gather ms") + old
    else:
        head = ("config", "rows x seq_len (blocks/row)", "s/step") + old
    md = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        cells = [r["config"], f"{r['rows']} x {r['seq_len']} ({r['blocks_per_row']})", f"{r['s_per_step']:.2f}"]
        if cached:
            cells += [f"{r['s_per_step_cached']:.2f}", f"{r['speedup']:.2f}x", f"{r['host_gather_ms']:.1f}"]
        cells += [f"{r['blocks_per_s']:.1f}", f"{r['packed_tokens_per_s']:.0f}", f"{r['target_feature_share']:.0%}",
                  f"{r['peak_rss_gb']:.1f}"]
        md.append("| " + " | ".join(cells) + " |")
    md.append("\nOnline target features (the default, no `data.feature_cache`): the frozen SmolLM2-135M runs inside every "
              "step over the packed rows. 'target-feature share' is the time of that pass alone divided by the "
              "whole step. A step is timed from the host batch to the finished update; compilation (first two "
              "steps) excluded.\n")
    if cached:
        md.append("Side by side, in one process per config on the same batches: 'online' as above (blocks/s, "
                  "packed tokens/s, target-feature share are of the online steps); 'cached' gathers the batch's "
                  "features from the on-disk cache (`data.feature_cache`) on the host, moves them to the device "
                  "and runs the step without the target, alternating with the online step which goes first. "
                  "'s/step cached' includes the gather and the transfer; 'host gather ms' is the gather alone; "
                  "speedup = s/step online / s/step cached. Peak RSS is of the process running both (two train "
                  "states, both compiled steps, and the pages of the cache it read).\n")
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dspark,dflash,eagle3")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--data", default="data/smollm2-train")
    ap.add_argument("--feature-cache", metavar="DIR",
                    help="also time every step with the on-disk feature cache in DIR (data.feature_cache; it must "
                         "be for the same --data and the configs' target, tap layers and seq_len), side by side "
                         "with the online step; built first when DIR holds no complete cache (over the full data "
                         "that takes minutes: the target runs once over every token, ~1k tokens/s on 2 CPU cores)")
    ap.add_argument("--out", default="benchmarks/results/train.md",
                    help="results .md (the .json goes next to it)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        if args.build:
            print(json.dumps(build_cache(args.one, args.data, args.feature_cache)))
        else:
            print(json.dumps(run_one(args.one, args.steps, args.data, args.feature_cache)))
        return
    configs = [f"configs/{name}_smollm2-135m.yaml" for name in args.configs.split(",")]
    cache_arg = ["--feature-cache", args.feature_cache] if args.feature_cache else []
    results: dict = {}
    if args.feature_cache:
        from dspark_jax.data.feature_cache import is_complete

        results["feature_cache"] = {"dir": args.feature_cache, "build_s": None}
        if not is_complete(args.feature_cache):
            print(f"building the feature cache of {args.data} in {args.feature_cache} first", file=sys.stderr)
            proc = subprocess.run([sys.executable, __file__, "--one", configs[0], "--build", "--data", args.data,
                                   *cache_arg], stdout=subprocess.PIPE, text=True)  # progress on stderr
            if proc.returncode:
                sys.exit(f"building the feature cache in {args.feature_cache} failed (see above)")
            results["feature_cache"]["build_s"] = json.loads(proc.stdout.strip().splitlines()[-1])["build_s"]
    rows = []
    for config in configs:
        proc = subprocess.run([sys.executable, __file__, "--one", config, "--steps", str(args.steps),
                               "--data", args.data, *cache_arg], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{config} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    directory, name, _ = output_paths(args.out)
    paths = write_results(name, {**results, "rows": rows}, markdown(rows, args.feature_cache is not None), directory)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
