"""Shared by the benchmark scripts: machine description, results files, eval prompts, the speculative run."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys

from dspark_jax.core import host_memory

host_memory.keep_freed_memory()  # as the commands do (before JAX's worker threads start): timings depend on it

from dspark_jax.data.splits import BENCHMARK_DOMAINS as DOMAINS, eval_prompts, mixed_eval_prompts  # noqa: F401
from dspark_jax.engine.sps import machine  # noqa: F401  (results files record it)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def command_line() -> str:
    """This process's command, as the results files record it."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file (<path>.<pid>.tmp), so that a kill never leaves
    half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def finished_cells(name: str, key) -> dict:
    """The cells a resumable benchmark already wrote to <RESULTS_DIR>/<name>.json, by key(cell)
    (empty when there is no such file): a rerun skips them."""
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {key(c): c for c in json.load(f).get("cells", [])}


def write_results(name: str, results: dict, markdown: str, directory: str = RESULTS_DIR) -> tuple[str, str]:
    """Write <directory>/<name>.json and <directory>/<name>.md with the command, machine and date."""
    os.makedirs(directory, exist_ok=True)
    meta = {"command": command_line(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine()}
    json_path = os.path.join(directory, f"{name}.json")
    md_path = os.path.join(directory, f"{name}.md")
    write_atomic(json_path, json.dumps({**meta, **results}, indent=1))
    m = meta["machine"]
    header = (f"Command: `{meta['command']}`  \nDate: {meta['date']}  \n"
              f"Machine: {m['cpu']}, {m['cores']} cores, JAX {m['jax']} ({m['jax_backend']}), malloc: {m['malloc']}\n\n")
    write_atomic(md_path, header + markdown)
    return json_path, md_path


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


def fmt(x, spec=".2f", none="-"):
    """A table cell: `x` formatted, or `none` where there is no value."""
    return none if x is None else format(x, spec)


def products_note(xla_dot: bool) -> str:
    """Which code ran the fp32 few-row products and the decode attention (models/cpu_kernels.py)."""
    from dspark_jax.models import cpu_kernels

    if xla_dot or not cpu_kernels.active():
        return "fp32 products of few rows and decode attention: XLA's ops (our CPU kernels off or unavailable).\n"
    attention = " and decode attention" if cpu_kernels.active("attention") else ""
    return (f"products of up to 32 rows against fp32 or bf16 weights{attention}: our CPU kernels "
            "(dspark_jax/models/cpu_kernels.cc).\n")


def add_speculative_args(parser: argparse.ArgumentParser, out: str) -> None:
    """The options the speculative-decoding benchmarks share (models, engine, output)."""
    parser.add_argument("--drafter", required=True, help="drafter checkpoint folder (trained for --target)")
    parser.add_argument("--target", default="smollm2-135m",
                        help="known target name, Hugging Face folder or .gguf file")
    parser.add_argument("--gamma", type=int, default=None, help="draft tokens per round (default: the drafter's block)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="prefix-survival threshold of the threshold scheduler")
    parser.add_argument("--profile-sps", action="store_true",
                        help="re-profile the SPS tables of the dspark schedulers even if cached in .dspark_cache/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="target and drafter weights (bfloat16: bf16 weights, fp32 activations on a CPU)")
    parser.add_argument("--out", default=out, help="results .md (the .json and .png files go next to it)")


def load_benchmark_target(args):
    """The --target, with compiled programs shared across configurations (see share_compiled_programs)."""
    from dspark_jax.checkpoints.registry import load_target

    share_compiled_programs()
    return load_target(args.target, dtype=args.dtype)


def output_paths(out: str, *plots: str) -> tuple[str, str, list[str]]:
    """--out path/name.md -> (directory, name, [path/name<suffix>.png for each plot suffix])."""
    directory, base = os.path.split(os.path.abspath(out))
    name = os.path.splitext(base)[0]
    return directory, name, [os.path.join(directory, f"{name}{suffix}.png") for suffix in plots]


def write_benchmark(args, settings: tuple[str, ...], rows: list[dict], markdown: str, **extra) -> None:
    """Write --out (.md + .json with the command, machine, date, the chosen settings and the rows)."""
    directory, name, _ = output_paths(args.out)
    chosen = {k: getattr(args, k) for k in settings} | extra
    paths = write_results(name, {"settings": chosen, "rows": rows}, markdown, directory)
    print("wrote", *paths)


def int_list(text: str) -> list[int]:
    """'1,8' -> [1, 8] (for argparse `type=`)."""
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def choose(text: str, known, what: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each one of `known` (else a one-line UserError)."""
    from dspark_jax.core.errors import UserError

    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise UserError(f"unknown {what}(s) {', '.join(unknown) or '(none)'} (known: {', '.join(known)})")
    return chosen


SCHEDULERS = ("fixed", "mtp1", "threshold", "dspark", "dspark-async")  # `decode --scheduler` choices but auto


def speculative_runner(args, target, *, scheduler: str, batch_size: int, profile_sps: bool = False,
                       plain_steps: bool = False):
    """The run of `python -m dspark_jax.decode --drafter ...` (dspark_jax.engine.speculative_run):
    a function (prompt batch, SamplingConfig, seed) -> SpecResult. `args` supplies drafter, gamma,
    threshold and max_new_tokens; the dspark schedulers' SPS table is the one `decode` keeps for
    this batch size under .dspark_cache/ (profiled when missing or when `profile_sps`). scheduler
    "auto" is decode's default for this drafter and batch size; plain_steps as `decode --plain-steps on`."""
    from dspark_jax.engine.decode_settings import DecodeSettings
    from dspark_jax.engine.speculative_run import load_speculative

    return load_speculative(DecodeSettings(
        drafter=args.drafter, scheduler=scheduler, gamma=args.gamma, threshold=args.threshold, max_batch=batch_size,
        max_new_tokens=args.max_new_tokens, json=True, profile_sps=profile_sps,
        plain_steps="on" if plain_steps else "off"), target)


def share_compiled_programs() -> None:
    """A process-private persistent XLA cache (deleted at exit): programs that come out identical
    for several configurations (e.g. the verify pass, which every scheduler shares) compile once.
    Compilation is excluded from the timings either way; this only shortens the run."""
    import atexit
    import shutil
    import tempfile

    import jax

    folder = tempfile.mkdtemp(prefix="dspark-bench-xla-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
