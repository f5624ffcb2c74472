"""Shared fixtures: tiny random Hugging Face models saved to disk, loaded by our loader."""

import contextlib
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# glibc's default malloc for this process and its CLI subprocesses (the commands would set it to keep
# freed memory, core.host_memory): one test process runs programs of hundreds of shapes, and a heap
# that never shrinks would hold the largest of them all run long; test_host_memory sets it per probe.
os.environ.setdefault("DSPARK_MALLOC", "system")
# The suite runs on the CPU; the test extra installs libtpu (the TPU compile tests), with which JAX
# would otherwise try to start a TPU backend in every process and print libtpu's warnings.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several fake CPU devices for the sharding tests; must be set before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# XLA:CPU's code generation without LLVM's optimisations: most of the suite's time is compiling
# programs that then run a few times on tiny models (compilation was 79% of two engine files'
# time; at level 0 a verify program compiles in 2.2 s instead of 4.5). The programs compute the
# same functions (the real models' products run in our own kernels, compiled once by the build);
# DSPARK_TEST_XLA_OPT=2 (or any level) tests the code generation users get (docs/testing.md).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --xla_backend_optimization_level={os.environ.get('DSPARK_TEST_XLA_OPT', '0')}"
ALLOW_FEWER_DEVICES = "DSPARK_ALLOW_FEWER_DEVICES"

# A persistent XLA compilation cache for the run, this process and every CLI subprocess it starts
# (they inherit the environment): the same programs otherwise compile again in every module and
# subprocess. By default it outlives the run, in ~/.cache/dspark_jax/test-xla/<key>, the key naming
# this CPU (model and instruction-set flags: XLA:CPU code compiled for one processor can crash on
# another), the jax and jaxlib versions and the XLA flags; JAX's own key for an entry is the program
# and its compile options, so a changed program never reads an old entry. One folder per pytest-xdist
# worker: JAX writes an entry in place, so two workers compiling one program at once could read each
# other's half-written file (its size-bounded mode locks the folder, but then scans every entry on
# each write: a run with it took longer than one without a cache); the folders share earlier runs'
# entries as hard links made before the workers start. A folder past 3 GB is emptied when a run
# starts. DSPARK_TEST_XLA_CACHE: `0` compiles everything afresh, `run` uses fresh folders deleted at
# the run's end (a cold run), a path replaces ~/.cache/dspark_jax.
_CACHE_SETTING = os.environ.get("DSPARK_TEST_XLA_CACHE", "")
# where the caches kept across runs live (test-xla/, test-tokenizers/ below)
_CACHE_ROOT = _CACHE_SETTING or os.path.join(os.path.expanduser("~"), ".cache", "dspark_jax")
_CACHE_BASE = "DSPARK_TEST_XLA_CACHE_BASE"  # the run's keyed folder, set by the first process, read by the workers
_CACHE_LIMIT = 3 << 30


def _xla_cache_base(root: str) -> str:
    import hashlib
    import importlib.metadata
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            cpu = [line for line in f.read().split("\n\n")[0].splitlines()
                   if line.split(":")[0].strip() in ("vendor_id", "model name", "flags")]
    except OSError:
        cpu = [platform.processor(), platform.machine()]
    key = repr((cpu, importlib.metadata.version("jax"), importlib.metadata.version("jaxlib"), os.environ["XLA_FLAGS"]))
    base = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:16])
    entries = {os.stat(os.path.join(d, f)).st_ino: os.path.getsize(os.path.join(d, f))
               for d, _, files in os.walk(base) for f in files}  # by inode: the folders share entries
    if sum(entries.values()) > _CACHE_LIMIT:
        shutil.rmtree(base, ignore_errors=True)
    _share_entries(base)
    return base


def _share_entries(base: str) -> None:
    """Before the workers start, each worker's folder gets the entries the others wrote in earlier
    runs, as hard links (JAX writes an entry once and never changes it): a file's programs then hit
    whichever worker runs it this time."""
    if not os.path.isdir(base):
        return
    folders = [f.path for f in os.scandir(base) if f.is_dir()]
    names = {f: {n for n in os.listdir(f) if n.endswith("-cache")} for f in folders}
    for folder in folders:
        for other in folders:
            for name in names[other] - names[folder]:
                with contextlib.suppress(OSError):
                    os.link(os.path.join(other, name), os.path.join(folder, name))
                    names[folder].add(name)


if _CACHE_SETTING != "0" and (_CACHE_BASE in os.environ or "JAX_COMPILATION_CACHE_DIR" not in os.environ):
    if _CACHE_BASE not in os.environ:  # the first process of the run (pytest's, or xdist's controller)
        os.environ[_CACHE_BASE] = (tempfile.mkdtemp(prefix="dspark-test-xla-") if _CACHE_SETTING == "run" else
                                   _xla_cache_base(os.path.join(_CACHE_ROOT, "test-xla")))
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(os.environ[_CACHE_BASE],
                                                             os.environ.get("PYTEST_XDIST_WORKER", "main")),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    if "jax" in sys.modules:  # imported before this file (by a plugin): its config has read the environment already
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _CACHE_SETTING == "run" and "PYTEST_XDIST_WORKER" not in os.environ and _CACHE_BASE in os.environ:
        shutil.rmtree(os.environ[_CACHE_BASE], ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", f"needs_devices(n): needs n JAX devices; FAILS with fewer unless {ALLOW_FEWER_DEVICES}=1 "
                                       "(then skips)")


# The files that take longest, longest first (`python tests/durations.py`, docs/testing.md): the two
# workers take files in collection order (`--no-loadscope-reorder`: xdist would otherwise start with
# the files holding the most tests), so a long file never starts last beside an idle worker.
LONGEST_FIRST = ("test_speculative", "test_gemma", "test_plain_steps", "test_notebooks", "test_decode_offline",
                 "test_shipped_drafter", "test_training", "test_drafting", "test_multiprocess_eval",
                 "test_generate", "test_plan", "test_feature_cache", "test_eval", "test_multiprocess_train",
                 "test_dspark_drafter", "test_decoder_cache", "test_multiprocess_decode", "test_cli",
                 "test_gguf", "test_tokenizer")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


def pytest_runtest_setup(item):
    """A test marked needs_devices(n) fails (not skips) when fewer than n devices are visible, so a
    run that silently lost its fake devices cannot pass; DSPARK_ALLOW_FEWER_DEVICES=1 turns it into a skip."""
    marker = item.get_closest_marker("needs_devices")
    if marker is None:
        return
    import jax

    need, have = marker.args[0], jax.device_count()
    if have >= need:
        return
    message = (f"needs {need} JAX devices, {have} visible (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}); run with "
               f"XLA_FLAGS=--xla_force_host_platform_device_count={need} on CPU, or set {ALLOW_FEWER_DEVICES}=1 to skip")
    if os.environ.get(ALLOW_FEWER_DEVICES) == "1":
        pytest.skip(message)
    pytest.fail(message, pytrace=False)

def without_tokenizer_arrays(source: str, out: str) -> None:
    """A copy of a GGUF file with the same tensors (their quantised bytes as they are) and metadata,
    less the tokenizer's arrays (tokens, scores, types, merges: 262k entries each for Gemma 3), with
    the vocabulary size they implied as `<arch>.vocab_size` where the file does not state it.
    transformers' GGUF loader parses every metadata value with gguf-py's reader, a numpy view per
    array element: ~70 of its ~90 s for Gemma 3 (~9 of 18 s for SmolLM2) went to arrays the model
    does not read (the tokenizers are compared in test_tokenizer)."""
    import gguf

    from dspark_jax.checkpoints.gguf import read_gguf

    src = read_gguf(source)
    arch = src.metadata["general.architecture"]
    scalar = lambda v: (gguf.GGUFValueType.BOOL if isinstance(v, bool) else gguf.GGUFValueType.STRING  # noqa: E731
                        if isinstance(v, str) else gguf.GGUFValueType.INT64 if isinstance(v, int)
                        else gguf.GGUFValueType.FLOAT32)
    writer = gguf.GGUFWriter(out, arch)  # writes general.architecture itself
    for key, value in src.metadata.items():
        if key == "general.architecture" or (key.startswith("tokenizer.") and isinstance(value, list)):
            continue
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=scalar(value[0]))
        else:
            writer.add_key_value(key, value, scalar(value))
    if f"{arch}.vocab_size" not in src.metadata:
        writer.add_key_value(f"{arch}.vocab_size", len(src.metadata["tokenizer.ggml.tokens"]),
                             gguf.GGUFValueType.UINT32)
    for t in src.tensors:
        quantised = t.tensor_type.name not in ("F32", "F16")  # data: [..., bytes per row], read as blocks
        writer.add_tensor(t.name, np.asarray(t.data),
                          raw_dtype=gguf.GGMLQuantizationType[t.tensor_type.name] if quantised else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer(tmp_path_factory):
    """path -> transformers' tokenizer converted from that GGUF file: the conversion takes ~1 minute
    for Gemma 3's 262k-token vocabulary, and three test files compare with it. The first worker to
    need it converts it and saves it (`save_pretrained`: the whole fast tokenizer) under a lock; the
    others read that. Saved, like the XLA cache above, in ~/.cache/dspark_jax/test-tokenizers, keyed
    on the file (its size and a hash of its first and last MiB) and the transformers and tokenizers
    versions; DSPARK_TEST_XLA_CACHE=0 or `run`: in a folder of this run."""
    import functools
    import hashlib
    import importlib.metadata
    import pathlib

    import filelock
    import transformers

    if _CACHE_SETTING in ("0", "run"):
        root = tmp_path_factory.getbasetemp()
        if "PYTEST_XDIST_WORKER" in os.environ:  # the workers' base folders share the run's folder
            root = root.parent
    else:
        root = pathlib.Path(_CACHE_ROOT, "test-tokenizers")
        root.mkdir(parents=True, exist_ok=True)

    def file_key(path: str) -> str:
        size, digest = os.path.getsize(path), hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read())
        versions = importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers")
        digest.update(repr((size, versions)).encode())
        return digest.hexdigest()[:16]

    @functools.cache
    def load(path: str):
        folder = root / f"transformers-tokenizer-{file_key(path)}"
        with filelock.FileLock(f"{folder}.lock"):
            if not (folder / "complete").exists():
                tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                                       gguf_file=os.path.basename(path))
                tokenizer.save_pretrained(folder)
                (folder / "complete").write_text("")
                return tokenizer
        return transformers.AutoTokenizer.from_pretrained(folder)

    return load


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_hf_config(family: str):
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama3":
        return transformers.LlamaConfig(
            **TINY, tie_word_embeddings=True,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64), rope_theta=500000.0)
    if family == "qwen2":
        return transformers.Qwen2Config(**TINY, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False)
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory):
    """Return a function family -> (folder, torch model) with random weights saved as safetensors."""
    import torch
    import transformers

    cache = {}

    def make(family: str):
        if family not in cache:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(family)).eval()
            with torch.no_grad():  # non-trivial norms so a dropped norm weight would show
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.add_(0.1 * torch.randn_like(p))
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model.save_pretrained(folder, safe_serialization=True)
            cache[family] = (str(folder), model)
        return cache[family]

    return make


def random_tokens(rng: np.random.Generator, batch: int, length: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=(batch, length), dtype=np.int32)


WORDS = ["<unk>", "<|im_start|>", "<|im_end|>"] + [f"w{i}" for i in range(125)]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def save_tiny_tokenizer(folder) -> None:
    """A 128-word whitespace tokenizer with a ChatML-like template (enough for CLI tests)."""
    import json

    import tokenizers
    from tokenizers import models, pre_tokenizers

    tk = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([tokenizers.AddedToken(w, special=True) for w in WORDS[:3]])
    tk.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}, f)


@pytest.fixture(scope="session")
def tiny_target_folder(tiny_hf_model):
    """A complete tiny Llama checkpoint folder (weights + tokenizer + chat template)."""
    folder, _ = tiny_hf_model("llama")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Free each test module's compiled XLA programs when it ends. XLA CPU maps every compiled
    kernel into memory separately, and a whole suite's worth of per-layer programs outgrows the
    kernel's limit on memory mappings (vm.max_map_count, 65,530 by default), after which a compile
    crashes."""
    yield
    import jax

    from dspark_jax.engine.generate import _COMPILED

    _COMPILED.clear()
    jax.clear_caches()
