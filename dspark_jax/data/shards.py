"""A datagen output folder (`python -m dspark_jax.datagen`, `training.datagen`): its shards and manifest,
written and read back (checked against the manifest's sha256) by datagen, training and the feature cache.

* `shard-00000.npz` ... one per batch, written atomically (`core.files.atomic_writer`: never half
  written), deflate-compressed and with fixed member dates, so the same arrays give the same bytes
  (small enough to commit to git: docs/training.md). Arrays (all plain dtypes;
  `np.load(path, allow_pickle=False)` works; `read_shard` returns the tokens as int32):
    tokens        uint16 [sum of lengths] prompt ids then response ids of every example, flat
                  (int32 where an id is 65,536 or more; shards of older runs are int32 throughout)
    offsets       int64 [n + 1]           example k is tokens[offsets[k]:offsets[k+1]]
    prompt_lens   int32 [n]               the first prompt_lens[k] ids of example k are the prompt
    finished      bool  [n]               the response ends with a stop token (it is included)
    example_ids   str   [n]               "<set>/<first 16 hex of sha256(prompt text)>"
* `manifest.json`: format, target (name + shape), sampling, max_new_tokens, max_prompt_tokens,
  seed, shard_size, split, sets, limit, planned/done/truncated counts per set, shard list (each with
  the sha256 of its file, checked whenever the shard is read back: a resumed run, training),
  complete.
  A folder made with other settings is refused (one line, exit status 2).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Sequence

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.errors import UserError

FORMAT = "dspark-datagen-v1"
MANIFEST = "manifest.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


# ---------------------------------------------------------------------------- shard files


def write_shard(path: str, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                example_ids: Sequence[str], finished: Sequence[bool]) -> dict:
    """Write one shard atomically (`files.atomic_writer`). Returns its manifest entry."""
    if not (len(prompts) == len(responses) == len(example_ids) == len(finished)):
        raise ValueError("shard columns differ in length")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    offsets = np.zeros(len(lengths) + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    tokens = np.zeros(int(offsets[-1]), np.int64)
    for k, (p, r) in enumerate(zip(prompts, responses)):
        tokens[offsets[k]: offsets[k] + len(p)] = p
        tokens[offsets[k] + len(p): offsets[k + 1]] = r
    # Two bytes a token for every vocabulary under 65,536 (SmolLM2, Llama 2): the data then fits in git.
    tokens = tokens.astype(np.uint16 if tokens.size == 0 or (0 <= tokens.min() and tokens.max() < 2**16) else np.int32)
    arrays = dict(tokens=tokens, offsets=offsets, prompt_lens=np.asarray([len(p) for p in prompts], np.int32),
                  finished=np.asarray(finished, bool), example_ids=np.asarray(list(example_ids), dtype=str))
    buffer = io.BytesIO()
    save_npz(buffer, arrays)
    blob = buffer.getvalue()
    files.atomic_write_bytes(path, blob)
    return shard_entry(os.path.basename(path), blob, arrays)


def shard_entry(name: str, blob: bytes, data: dict[str, np.ndarray]) -> dict:
    """A shard's manifest entry: its counts and the sha256 of its file's bytes."""
    return dict(file=name, num_examples=len(data["prompt_lens"]), num_tokens=int(len(data["tokens"])),
                response_tokens=int(len(data["tokens"]) - data["prompt_lens"].sum()),
                sha256=hashlib.sha256(blob).hexdigest())


def save_npz(f, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez_compressed(f, **arrays)` (the same .npz: deflated zip64 .npy members), but every
    member dated 1980-01-01 instead of now, so that the same arrays give the same bytes: a shard is
    then byte for byte the same whichever run, or process, made it."""
    import zipfile

    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as z:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def read_shard(path: str, sha256: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of one shard (see the module docstring), loaded without pickle, tokens as int32.
    With `sha256` (its manifest entry's), a file whose bytes hash otherwise is refused."""
    data, _ = read_shard_bytes(path, sha256)
    return data


def read_shard_bytes(path: str, sha256: str | None = None) -> tuple[dict[str, np.ndarray], bytes]:
    """`read_shard`, and the file's bytes (for its manifest entry)."""
    blob = files.read_bytes(path)
    if sha256 is not None and hashlib.sha256(blob).hexdigest() != sha256:
        raise UserError(f"corrupt data shard {path}: its sha256 is not the manifest's (changed or damaged since "
                        "it was written)")
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            data = {k: z[k] for k in ("tokens", "offsets", "prompt_lens", "finished", "example_ids")}
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise UserError(f"corrupt data shard {path}: {e}") from None
    n = len(data["prompt_lens"])
    if len(data["offsets"]) != n + 1 or data["offsets"][-1] != len(data["tokens"]):
        raise UserError(f"corrupt data shard {path}: offsets do not match the tokens")
    data["tokens"] = data["tokens"].astype(np.int32)
    return data, blob


def read_json_file(path: str, fmt: str, missing: str, hint: str = "") -> dict:
    """A JSON file with a "format" field (a manifest, a cache's metadata): UserError `missing` if it
    does not exist, a one-line UserError (ending in `hint`) if it is corrupt or of another format."""
    try:
        obj = json.loads(files.read_bytes(path))
    except FileNotFoundError:
        raise UserError(missing) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"corrupt {path}: {e}{hint}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        found = obj.get("format") if isinstance(obj, dict) else None
        raise UserError(f"{path}: unknown format {found!r} (expected {fmt}){hint}")
    return obj


def read_manifest(folder: str) -> dict:
    return read_json_file(os.path.join(folder, MANIFEST), FORMAT,
                          f"{folder} is not a datagen output folder (no {MANIFEST})")
