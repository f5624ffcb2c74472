"""On-disk cache of the frozen target's features: drafter training without the target in the loop.

A drafter trains on two target outputs per packed slot: `ctx_features` (the residual streams after
the tap layers, concatenated) and `target_last_hidden` (the final-normed hidden state). Online,
every step runs the target over the packed rows for them (`pipeline.target_features`); with
`data.feature_cache: DIR` they are computed once, stored here, and each step reads its slots back
(the trainer gathers them on the host, so the step skips the target).

What is stored. Row t holds the features of token t of `ShardSource.tokens` (all examples of the
data folders, concatenated in folder and shard order; packed batches carry this index as
`token_index`):

    row t = [ctx_features (m * d, the taps in tap_layers order) | target_last_hidden (d)],  F = (m + 1) * d

computed by the target on the token's own example (positions from 0). Attention is causal, so a
token's features depend only on its prefix and equal those of the same token in any packed training
row (up to rounding). Training truncates examples at seq_len, so only tokens at in-example position
< seq_len are computed; the rows of later tokens stay zero. Size: 2 * (m + 1) * d bytes per token.

Folder:
    features.npy   uint16 [num_tokens, F]: bfloat16 bit patterns (numpy has no bfloat16 dtype), a
                   plain .npy read back with np.load(mmap_mode="r"); no pickle anywhere
    cache.json     format, target + target_shape, tap_layers, d, F, seq_len, data (per data folder:
                   its shard files and their token counts), num_tokens, dtype, compute_dtype, created

Building (`build_feature_cache`). Examples (cut at seq_len) are packed first-fit, in data order,
into [rows, seq_len] rows exactly like training rows (segment ids, positions restarting at 0), run
through `pipeline.target_features` and written in order to `features.npy.partial`, which is renamed
to `features.npy` when complete; `cache.json` is written last (and removed when a rebuild starts),
so a folder is complete iff it has `cache.json`, and a killed build leaves nothing that looks
complete: the next build starts over.

Opening (`open_feature_cache`) checks cache.json against the run (target, tap layers, data,
seq_len: `cache_spec`); a cache built for something else is a one-line UserError, never silently
wrong features. `gather` reads a batch's rows (float32, zeros at padding).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.data import pipeline
from dspark_jax.data.datagen import read_json_file, read_manifest, write_json_atomic
from dspark_jax.errors import UserError

FORMAT = "dspark-feature-cache-v1"
FEATURES = "features.npy"
META = "cache.json"
_PARTIAL = FEATURES + ".partial"

# ---------------------------------------------------------------------------- what a cache is for


def data_fingerprint(data: pipeline.ShardSource | str | Sequence[str]) -> list[dict]:
    """Per data folder, in order: the shard files read, their token counts and the folder's total
    (from the manifests).

    A ShardSource gives the shards it actually loaded; folders are read from their manifests now."""
    if isinstance(data, pipeline.ShardSource):
        entries = data.shard_entries
    else:
        folders = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        entries = [read_manifest(folder)["shards"] for folder in folders]
    return [{"shards": [e["file"] for e in shards], "shard_tokens": [int(e["num_tokens"]) for e in shards],
             "num_tokens": int(sum(e["num_tokens"] for e in shards))} for shards in entries]


def cache_spec(target_name: str, target_cfg, tap_layers: Sequence[int], data: list[dict], seq_len: int) -> dict:
    """The fields of cache.json a run must match (JSON values, so they compare with what is read back)."""
    shape = {k: getattr(target_cfg, k) for k in ("family", "vocab_size", "hidden_size", "num_layers", "num_heads",
                                                 "num_kv_heads", "head_dim", "intermediate_size")}
    return json.loads(json.dumps(dict(target=target_name, target_shape=shape, tap_layers=[int(t) for t in tap_layers],
                                      data=data, seq_len=int(seq_len))))


def _describe(key: str, value) -> str:
    if key == "data":
        return (f"{sum(f['num_tokens'] for f in value)} tokens in "
                f"{sum(len(f['shards']) for f in value)} shards of {len(value)} folder(s)")
    return json.dumps(value)


@dataclasses.dataclass(frozen=True)
class FeatureCache:
    path: str
    meta: dict  # cache.json
    features: np.ndarray  # uint16 [num_tokens, F] (bfloat16 bits), memory-mapped

    @property
    def ctx_dim(self) -> int:  # m * d
        return self.meta["F"] - self.meta["d"]


# ---------------------------------------------------------------------------- reading


def is_complete(out_dir: str) -> bool:
    return os.path.exists(os.path.join(out_dir, META))


def open_feature_cache(out_dir: str, expected: dict | None = None) -> FeatureCache:
    """The complete cache in `out_dir`, checked against `expected` (a `cache_spec`) when given."""
    meta = read_json_file(os.path.join(out_dir, META), FORMAT, f"no complete feature cache in {out_dir} (no {META})",
                          f"; delete {out_dir} to rebuild the cache")
    for key, want in (expected or {}).items():
        if meta.get(key) != want:
            raise UserError(f"feature cache {out_dir} does not match this run: {key} is {_describe(key, meta.get(key))} "
                            f"there, {_describe(key, want)} here; delete the folder to rebuild it or set "
                            f"data.feature_cache to another folder")
    path = os.path.join(out_dir, FEATURES)
    try:
        features = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"corrupt feature cache {path}: {e}; delete {out_dir} to rebuild it") from None
    if features.dtype != np.uint16 or features.shape != (meta["num_tokens"], meta["F"]):
        raise UserError(f"corrupt feature cache {path}: {features.dtype} {features.shape}, expected uint16 "
                        f"{(meta['num_tokens'], meta['F'])}; delete {out_dir} to rebuild it")
    return FeatureCache(out_dir, meta, features)


def gather(cache: FeatureCache, token_index: np.ndarray, present_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ctx_features float32 [B, S, m*d], target_last_hidden float32 [B, S, d]) of a batch's slots
    (token_index, present_mask [B, S]: `batch["token_index"]`, `batch["segment_ids"] > 0`); zeros
    where not present."""
    present = np.asarray(present_mask, bool)
    index = np.where(present, np.asarray(token_index, np.int64), 0)
    rows = cache.features[index.reshape(-1)]  # reads only these rows of the memory map
    values = rows.view(ml_dtypes.bfloat16).astype(np.float32).reshape(index.shape + (rows.shape[-1],))
    values[~present] = 0.0
    return values[..., : cache.ctx_dim], values[..., cache.ctx_dim:]


# ---------------------------------------------------------------------------- building


def _packed_rows(lengths: np.ndarray, seq_len: int, rows: int):
    """First-fit packing in data order of examples of `lengths` (<= seq_len): yields (first example,
    end example, [row of each example], [slot of each example]) per batch; examples [first, end)
    fill at most `rows` rows of seq_len."""
    first, n = 0, len(lengths)
    while first < n:
        free, row_of, slot_of, i = [seq_len] * rows, [], [], first
        while i < n:
            length = int(lengths[i])
            r = next((r for r in range(rows) if free[r] >= length), None)
            if r is None:
                break
            row_of.append(r)
            slot_of.append(seq_len - free[r])
            free[r] -= length
            i += 1
        yield first, i, row_of, slot_of
        first = i


def _write_batch(f, source: pipeline.ShardSource, first: int, end: int, row_of, slot_of, seq_len: int,
                 features: jax.Array) -> None:
    """Write the rows of tokens offsets[first]:offsets[end] (zeros past seq_len in an example)."""
    values = np.asarray(features).view(np.uint16)  # [rows, S, F] bfloat16 bits
    base = int(source.offsets[first])
    chunk = np.zeros((int(source.offsets[end]) - base, values.shape[-1]), np.uint16)
    for k, (r, s) in enumerate(zip(row_of, slot_of)):
        start = int(source.offsets[first + k]) - base
        n = min(int(source.offsets[first + k + 1]) - base - start, seq_len)
        chunk[start: start + n] = values[r, s: s + n]
    f.write(chunk.tobytes())


@jax.jit
def _bf16_rows(ctx: jax.Array, last: jax.Array) -> jax.Array:
    return jnp.concatenate([ctx, last], axis=-1).astype(jnp.bfloat16)  # [rows, S, F]


def build_feature_cache(target_params, target_cfg, tap_layers: Sequence[int], source: pipeline.ShardSource,
                        seq_len: int, out_dir: str, rows: int = 8, progress: bool = True, *,
                        target_name: str | None = None, batch_sharding=None) -> FeatureCache:
    """Compute and store the features of every token of `source` (see the module docstring).

    The target runs as given (its params and `target_cfg.dtype` set the compute dtype; the trainer
    passes the run's compute dtype, as in the online path); values are stored as bfloat16.
    `target_name` defaults to the data's target; `batch_sharding` places each [rows, seq_len] batch
    (default: jit's choice). Returns the opened cache."""
    tap_layers = tuple(int(t) for t in tap_layers)
    d = target_cfg.hidden_size
    F = (len(tap_layers) + 1) * d
    num_tokens = len(source.tokens)
    os.makedirs(out_dir, exist_ok=True)
    meta_path, partial, final = (os.path.join(out_dir, n) for n in (META, _PARTIAL, FEATURES))
    for stale in (meta_path, final, partial):  # cache.json first: from here on the folder is incomplete
        if os.path.exists(stale):
            os.remove(stale)
    size = num_tokens * F * 2
    free = shutil.disk_usage(out_dir).free
    if free < size:
        raise UserError(f"the feature cache needs {size / 2**30:.1f} GiB ({2 * F} bytes x {num_tokens} tokens), "
                        f"{out_dir} has {free / 2**30:.1f} GiB free: point data.feature_cache elsewhere")

    spec = cache_spec(target_name or source.target_name, target_cfg, tap_layers, data_fingerprint(source), seq_len)
    lengths = np.minimum(source.lengths(), seq_len)

    bar = tqdm(total=int(lengths.sum()), disable=not progress, desc="feature cache", unit="tok", unit_scale=True)
    try:
        with open(partial, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint16)),
                                                     "fortran_order": False, "shape": (num_tokens, F)})
            pending = None  # write batch i while the target computes batch i + 1
            for first, end, row_of, slot_of in _packed_rows(lengths, seq_len, rows):
                tokens, positions, segment_ids = (np.zeros((rows, seq_len), np.int32) for _ in range(3))
                for k, (r, s) in enumerate(zip(row_of, slot_of)):
                    i = first + k
                    n = int(lengths[i])
                    tokens[r, s: s + n] = source.tokens[source.offsets[i]: source.offsets[i] + n]
                    positions[r, s: s + n] = np.arange(n)
                    segment_ids[r, s: s + n] = k + 1
                batch = dict(tokens=tokens, positions=positions, segment_ids=segment_ids)
                if batch_sharding is not None:
                    batch = jax.device_put(batch, batch_sharding)
                out = _bf16_rows(*pipeline.target_features(target_params, target_cfg, batch, tap_layers))
                if pending is not None:
                    _write_batch(f, source, *pending)
                    bar.update(int(lengths[pending[0]: pending[1]].sum()))
                pending = (first, end, row_of, slot_of, seq_len, out)
            if pending is not None:
                _write_batch(f, source, *pending)
                bar.update(int(lengths[pending[0]: pending[1]].sum()))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    finally:
        bar.close()
    os.replace(partial, final)
    meta = dict(format=FORMAT, **spec, d=d, F=F, num_tokens=num_tokens, dtype="bfloat16",
                compute_dtype=str(target_cfg.dtype), created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    write_json_atomic(meta_path, meta)
    return open_feature_cache(out_dir, spec)
