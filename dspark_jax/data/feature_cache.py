"""On-disk cache of the frozen target's features: drafter training without the target in the loop.

A drafter trains on two target outputs per packed slot: `ctx_features` (the residual streams after
the tap layers, concatenated) and `target_last_hidden` (the final-normed hidden state). Online,
every step runs the target over the packed rows for them (`pipeline.target_features`); with
`data.feature_cache: DIR` they are computed once, stored here, and each step reads its slots back
(the trainer gathers them on the host, so the step skips the target). The folder may be a gs://
URL (`core.files`): the cache is then built in host memory, uploaded once, and read back whole into
memory (a local cache is memory-mapped instead).

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
                   its shard files, their token counts and `content_blake2b`, a hash of the folder's
                   tokens, example boundaries and prompt lengths), num_tokens, dtype, compute_dtype
                   (what the target's params were cast to), activation_dtype, created

Building (`build_feature_cache`). Examples (cut at seq_len) are packed first-fit, in data order,
into [rows, seq_len] rows exactly like training rows (segment ids, positions restarting at 0), run
through `pipeline.target_features` and written in order to `features.npy.partial.<host>.<pid>.<id>`
(a name of this build's own, so concurrent builds never write into one file) by the target run as
the online path runs it (the trainer passes `trainer.target_feature_inputs`), which is renamed to
`features.npy` when complete; `cache.json` is written last (and removed when a rebuild starts), so
a folder is complete iff it has `cache.json`, and a killed build leaves nothing that looks complete.
A build resumes: about every `checkpoint_every_s` seconds it syncs its partial file and records,
next to it (`<partial>.json`), how many examples and bytes are on disk for which cache (the
`cache_spec`). A later build on the same host takes over the partial file of a build whose process
is gone (killed, or stopped with Ctrl-C) if it was building this very cache and continues after
its last record: the bytes are those of an uninterrupted build (the packing is deterministic).
Other partial files of dead builds on this host are removed; a live build's file, or another
host's, is left alone. Write errors (a full disk, an unwritable folder) are one-line
UserErrors and remove the partial file. A build into an object store (gs://) is written whole at
the end and does not resume.

Opening (`open_feature_cache`) checks cache.json against the run (target, tap layers, data with
its content hash, seq_len: `cache_spec`); a cache built for something else is a one-line
UserError, never silently wrong features. `gather` reads a batch's rows (bfloat16, zeros at
padding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import shutil
import socket
import sys
import time
import uuid
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.core import files
from dspark_jax.data import pipeline
from dspark_jax.data.shards import read_json_file
from dspark_jax.core.errors import UserError

FORMAT = "dspark-feature-cache-v1"
FEATURES = "features.npy"
META = "cache.json"
_PARTIAL = FEATURES + ".partial"  # + ".<host>.<pid>.<random>": one file per build

# ---------------------------------------------------------------------------- what a cache is for


def content_hash(source: pipeline.ShardSource, first: int, end: int) -> str:
    """blake2b (128 bits, hex) of examples [first, end) of `source`: their count, tokens (int32),
    boundaries (offsets from the first, int64) and prompt lengths (int32), little-endian. Two
    datasets with the same shards and lengths but other tokens hash differently. About 1 GB/s."""
    offsets = source.offsets[first: end + 1]
    h = hashlib.blake2b(digest_size=16)
    h.update(np.array([end - first, offsets[-1] - offsets[0]], "<i8").tobytes())
    h.update(np.ascontiguousarray(source.tokens[offsets[0]: offsets[-1]], "<i4").data)
    h.update(np.ascontiguousarray(offsets - offsets[0], "<i8").data)
    h.update(np.ascontiguousarray(source.prompt_lens[first:end], "<i4").data)
    return h.hexdigest()


def data_fingerprint(data: pipeline.ShardSource | str | Sequence[str]) -> list[dict]:
    """Per data folder, in order: the shard files read, their token counts, the folder's total and
    `content_blake2b` (`content_hash` of its examples).

    Pass the ShardSource the run trains on (the trainer does): the fingerprint is then of exactly
    the data loaded; folders are loaded into one first."""
    source = data if isinstance(data, pipeline.ShardSource) else pipeline.ShardSource(data)
    return [{"shards": [e["file"] for e in shards], "shard_tokens": [int(e["num_tokens"]) for e in shards],
             "num_tokens": int(sum(e["num_tokens"] for e in shards)),
             "content_blake2b": content_hash(source, first, end)}
            for shards, (first, end) in zip(source.shard_entries, source.folder_examples)]


def cache_spec(target_name: str, target_cfg, tap_layers: Sequence[int], data: list[dict], seq_len: int) -> dict:
    """The fields of cache.json a run must match (JSON values, so they compare with what is read back)."""
    shape = {k: getattr(target_cfg, k) for k in ("family", "vocab_size", "hidden_size", "num_layers", "num_heads",
                                                 "num_kv_heads", "head_dim", "intermediate_size")}
    return json.loads(json.dumps(dict(target=target_name, target_shape=shape, tap_layers=[int(t) for t in tap_layers],
                                      data=data, seq_len=int(seq_len))))


def _describe(key: str, value) -> str:
    if value is None:
        return "missing"
    if key == "data":
        try:
            return (f"{sum(int(f['num_tokens']) for f in value)} tokens in "
                    f"{sum(len(f['shards']) for f in value)} shards of {len(value)} folder(s)")
        except (TypeError, KeyError, ValueError):  # a hand-edited cache.json
            pass
    return json.dumps(value)


def _mismatch(key: str, there, here) -> str:
    """What differs, in words: `key` is <there> there, <here> here (or, for data of the same size,
    that the content differs)."""
    a, b = _describe(key, there), _describe(key, here)
    if key == "compute_dtype":
        return (f"it was built with the target's weights in {there}, this run asks for {here} "
                f"(data.feature_cache_dtype, by default the run's compute dtype)")
    if key == "data" and a == b:
        try:
            hashed = all("content_blake2b" in f for f in there)
        except TypeError:
            hashed = True
        if not hashed:
            return (f"data has the same shards and token counts but no content hash there (the cache was built "
                    f"before content hashes were recorded), so its tokens cannot be checked against {b} here")
        return f"data content differs: the same {a} there and here, but other tokens (content hash)"
    return f"{key} is {a} there, {b} here"


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
    return files.exists(os.path.join(out_dir, META))


def open_feature_cache(out_dir: str, expected: dict | None = None) -> FeatureCache:
    """The complete cache in `out_dir`, checked against `expected` (a `cache_spec`) when given."""
    meta = read_json_file(os.path.join(out_dir, META), FORMAT, f"no complete feature cache in {out_dir} (no {META})",
                          f"; delete {out_dir} to rebuild the cache")
    for key, want in (expected or {}).items():
        if meta.get(key) != want:
            raise UserError(f"feature cache {out_dir} does not match this run: {_mismatch(key, meta.get(key), want)}; "
                            f"delete the folder to rebuild it or set data.feature_cache to another folder")
    path = os.path.join(out_dir, FEATURES)
    try:
        if files.is_url(path):  # no memory map of an object: the whole array in host memory
            features = np.load(io.BytesIO(files.read_bytes(path)), allow_pickle=False)
        else:
            features = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"corrupt feature cache {path}: {e}; delete {out_dir} to rebuild it") from None
    if features.dtype != np.uint16 or features.shape != (meta["num_tokens"], meta["F"]):
        raise UserError(f"corrupt feature cache {path}: {features.dtype} {features.shape}, expected uint16 "
                        f"{(meta['num_tokens'], meta['F'])}; delete {out_dir} to rebuild it")
    return FeatureCache(out_dir, meta, features)


def gather(cache: FeatureCache, token_index: np.ndarray, present_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ctx_features [B, S, m*d], target_last_hidden [B, S, d]) of a batch's slots (token_index,
    present_mask [B, S]: `batch["token_index"]`, `batch["segment_ids"] > 0`), as stored: bfloat16
    (ml_dtypes) C-contiguous arrays, zeros where not present. The loss casts them to the compute
    dtype on the device, so nothing is gained by widening them here."""
    present = np.asarray(present_mask, bool)
    index = np.where(present, np.asarray(token_index, np.int64), 0)
    rows = cache.features[index.reshape(-1)]  # a copy of only these rows of the memory map
    rows[~present.reshape(-1)] = 0  # bfloat16 +0.0 is all zero bits
    values = rows.view(ml_dtypes.bfloat16).reshape(index.shape + (rows.shape[-1],))
    return np.ascontiguousarray(values[..., : cache.ctx_dim]), np.ascontiguousarray(values[..., cache.ctx_dim:])


# ---------------------------------------------------------------------------- building


def _packed_rows(lengths: np.ndarray, seq_len: int, rows: int, first: int = 0):
    """First-fit packing in data order of examples of `lengths` (<= seq_len): yields (first example,
    end example, [row of each example], [slot of each example]) per batch; examples [first, end)
    fill at most `rows` rows of seq_len. Each batch depends only on where it starts, so a build
    resumed at a batch boundary packs what an uninterrupted one would."""
    n = len(lengths)
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


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def _partial_name() -> str:
    """This build's own partial file name: features.npy.partial.<host>.<pid>.<random>."""
    return f"{_PARTIAL}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}"


def _process_alive(pid: int) -> bool:
    if os.name != "posix":  # no signal-0 probe: assume it runs
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _dead_partials(out_dir: str) -> list[str]:
    """The partial files of builds on this host whose process is gone (a kill leaves its partial
    file and progress record behind); a live build's file, or another host's, is not listed."""
    host, dead = socket.gethostname(), []
    for name in os.listdir(out_dir):
        if not name.startswith(_PARTIAL + ".") or name.endswith(".json"):
            continue
        owner = name[len(_PARTIAL) + 1:].rsplit(".", 2)  # host (may hold dots), pid, random
        if len(owner) == 3 and owner[0] == host and owner[1].isdigit() and not _process_alive(int(owner[1])):
            dead.append(name)
    return dead


def _read_progress(path: str) -> dict | None:
    try:
        with open(path) as f:
            record = json.load(f)
        return record if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def _take_over_dead_partials(out_dir: str, spec: dict, partial: str) -> tuple[int, int]:
    """Rename the furthest dead partial file of this very cache to `partial` (this build's name) and
    remove the other dead ones; (examples, bytes) it holds for sure, (0, 0) when none is usable."""
    best, done, dead = None, (0, 0), _dead_partials(out_dir)
    for name in dead:
        record = _read_progress(os.path.join(out_dir, name + ".json"))
        try:
            usable = (record is not None and record.get("spec") == spec
                      and os.path.getsize(os.path.join(out_dir, name)) >= int(record["bytes"]))
            progress = (int(record["examples"]), int(record["bytes"])) if usable else None
        except (OSError, KeyError, TypeError, ValueError):
            progress = None
        if progress is not None and progress[1] > done[1]:
            best, done = name, progress
    for name in dead:
        if name == best:
            try:  # the rename claims it: a build racing for the same file gets FileNotFoundError
                os.rename(os.path.join(out_dir, name), os.path.join(out_dir, partial))
                os.rename(os.path.join(out_dir, name + ".json"), os.path.join(out_dir, partial + ".json"))
            except FileNotFoundError:
                done = (0, 0)
        with contextlib.suppress(FileNotFoundError):  # removed by another build meanwhile
            os.remove(os.path.join(out_dir, name))
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, name + ".json"))
    return done


def _float_dtypes(tree) -> str:
    return ",".join(sorted({str(a.dtype) for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)}))


def build_feature_cache(target_params, target_cfg, tap_layers: Sequence[int], source: pipeline.ShardSource,
                        seq_len: int, out_dir: str, rows: int = 8, progress: bool = True, *,
                        target_name: str | None = None, batch_sharding=None,
                        checkpoint_every_s: float = 60.0) -> FeatureCache:
    """Compute and store the features of every token of `source` (see the module docstring),
    continuing a killed build of the same cache on this host where it stopped.

    The target runs exactly as given: `target_params` in their dtype, activations in
    `target_cfg.dtype`. To get the online path's features, pass what it uses:
    `trainer.target_feature_inputs(params, cfg, compute_dtype)` (the params cast to the run's
    compute dtype, the target's own config), as the trainer does. Values are stored as bfloat16.
    `target_name` defaults to the data's target; `batch_sharding` places each [rows, seq_len] batch
    (default: jit's choice); `checkpoint_every_s`: how often the progress a resume starts from is
    synced to disk. Errors writing `out_dir` (a file there, no permission, a full disk) are
    one-line UserErrors. Returns the opened cache."""
    tap_layers = tuple(int(t) for t in tap_layers)
    d = target_cfg.hidden_size
    F = (len(tap_layers) + 1) * d
    num_tokens = len(source.tokens)
    if files.exists(out_dir) and not files.is_dir(out_dir):
        raise UserError(f"the feature cache {out_dir} is a file, not a folder: point data.feature_cache elsewhere")
    spec = cache_spec(target_name or source.target_name, target_cfg, tap_layers, data_fingerprint(source), seq_len)
    spec["rows"] = int(rows)  # the packing of the build, which a resumed build must share
    meta_path, final = os.path.join(out_dir, META), os.path.join(out_dir, FEATURES)
    size, local = num_tokens * F * 2, not files.is_url(out_dir)
    partial, resumed = _partial_name(), (0, 0)
    try:
        files.makedirs(out_dir)
        for stale in (meta_path, final):  # cache.json first: from here on the folder is incomplete
            files.remove(stale)
        if local:  # an object store has no partial files (an upload is whole) nor a free-space figure
            resumed = _take_over_dead_partials(out_dir, spec, partial)
        free = shutil.disk_usage(out_dir).free if local else size
    except OSError as e:
        raise UserError(f"cannot write the feature cache in {out_dir}: {_reason(e)}; point data.feature_cache "
                        f"elsewhere") from None
    if free < size - resumed[1]:
        raise UserError(f"the feature cache needs {size / 2**30:.1f} GiB ({2 * F} bytes x {num_tokens} tokens), "
                        f"{out_dir} has {free / 2**30:.1f} GiB free: point data.feature_cache elsewhere")
    lengths = np.minimum(source.lengths(), seq_len)
    first = resumed[0]
    if first and progress:
        print(f"resuming the feature cache build of {out_dir} at example {first} of {len(lengths)}",
              file=sys.stderr, flush=True)

    def compute(first, end, row_of, slot_of):
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
        return _bf16_rows(*pipeline.target_features(target_params, target_cfg, batch, tap_layers))

    bar = tqdm(total=int(lengths.sum()), initial=int(lengths[:first].sum()), disable=not progress,
               desc="feature cache", unit="tok", unit_scale=True)

    def fill(f, checkpoint) -> None:
        """Write from example `first` on; `checkpoint(examples)` after each batch written."""
        pending = None  # write batch i while the target computes batch i + 1
        for first_, end, row_of, slot_of in _packed_rows(lengths, seq_len, rows, first):
            out = compute(first_, end, row_of, slot_of)
            if pending is not None:
                _write_batch(f, source, *pending)
                bar.update(int(lengths[pending[0]: pending[1]].sum()))
                checkpoint(pending[1])
            pending = (first_, end, row_of, slot_of, seq_len, out)
        if pending is not None:
            _write_batch(f, source, *pending)
            bar.update(int(lengths[pending[0]: pending[1]].sum()))

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint16)),
                                                  "fortran_order": False, "shape": (num_tokens, F)})
    try:
        if local:
            _fill_resumably(os.path.join(out_dir, partial), final, header.getvalue(), resumed, spec, fill,
                            checkpoint_every_s)
        else:
            with files.atomic_writer(final) as f:
                f.write(header.getvalue())
                fill(f, lambda examples: None)
    except OSError as e:
        hint = " (it needs {:.1f} GiB)".format(size / 2**30) if e.errno in _DISK_FULL else ""
        raise UserError(f"writing the feature cache in {out_dir} failed: {_reason(e)}{hint}; free space or "
                        f"point data.feature_cache elsewhere") from None
    finally:
        bar.close()
    del spec["rows"]
    meta = dict(format=FORMAT, **spec, d=d, F=F, num_tokens=num_tokens, dtype="bfloat16",
                compute_dtype=_float_dtypes(target_params), activation_dtype=str(target_cfg.dtype),
                created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    try:
        files.atomic_write_json(meta_path, meta)
    except OSError as e:
        raise UserError(f"writing {meta_path} failed: {_reason(e)}; free space or point data.feature_cache "
                        f"elsewhere") from None
    return open_feature_cache(out_dir, spec)


def _fill_resumably(partial: str, final: str, header: bytes, resumed: tuple[int, int], spec: dict, fill,
                    every_s: float) -> None:
    """Write the cache into `partial` (continuing at `resumed` = (examples, bytes) when not (0, 0)),
    recording progress in `partial`.json, then rename it to `final`. A kill or Ctrl-C leaves both
    for the next build to continue; any other error removes them."""
    record = partial + ".json"
    if resumed[1]:  # bytes past the record are written again, with the same values
        f = open(partial, "r+b")
        f.seek(resumed[1])
    else:
        f = open(partial, "xb")
        f.write(header)
    last = [time.monotonic()]

    def checkpoint(examples: int) -> None:
        if time.monotonic() - last[0] < every_s:
            return
        f.flush()
        os.fsync(f.fileno())  # the bytes first, then the record that vouches for them
        files.atomic_write_json(record, {"spec": spec, "examples": int(examples), "bytes": f.tell()})
        last[0] = time.monotonic()

    try:
        with f:
            fill(f, checkpoint)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(partial, 0o644)  # data to share
        os.replace(partial, final)
        files.sync_folder(os.path.dirname(final))
    except KeyboardInterrupt:  # kept: the next build continues from the last record
        raise
    except BaseException:
        for leftover in (partial, record):
            with contextlib.suppress(OSError):
                os.remove(leftover)
        raise
    with contextlib.suppress(OSError):
        os.remove(record)
