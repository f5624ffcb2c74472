"""Training data pipeline: datagen shards -> shuffled examples -> anchors -> packed fixed-shape batches.

Built from grain's own pieces, so the iterator state can be checkpointed and restored exactly:

    ShardSource (grain RandomAccessDataSource over the datagen folders, all shards in memory)
      -> grain.MapDataset.source(...)
      -> [per-process slice: grain.sharding.ShardOptions + even_split; none for the global stream]
      -> .shuffle(seed).repeat(num_epochs)      (grain reshuffles every epoch: seed folded with epoch)
      -> .map_with_index(sample anchors)        (rng = (seed, epoch, example index): new every epoch;
                                                 each token keeps its index in ShardSource.tokens)
      -> .to_iter_dataset()
      -> FirstFitPackIterDataset(num_packing_bins=B)   (grain's first-fit packer: B rows of S tokens,
                                                        at most NB blocks per row)
      -> .batch(B) -> .map(finish_batch)         (block_start in row slots, padding to B rows)

`it = iter(make_dataset(...))`; `it.get_state()` is a small JSON-able dict and `it.set_state(state)`
on a fresh iterator of the same dataset continues with exactly the same batches (grain's packer
stores the parent state at the start of the packing group and replays it).

Anchors (one per gamma-token block). For an example of n tokens whose first P are the prompt, an
anchor a satisfies P <= a <= n - 2 (the anchor is a response token and its block predicts at least
one response token, a + 1), and a <= S - gamma - 1 so that the whole block and its labels fit in a
row (sequences longer than S are truncated: anchors are drawn only from the part that fits).
`anchors_per_seq` distinct anchors are drawn per example per epoch (all valid positions if fewer).
Examples with no valid anchor (response shorter than 2 tokens, or a prompt that fills S) are
dropped when the source is built.

Anchor-bounded packing. A block query only sees context before its anchor plus its own gamma
slots, so an example is packed only up to min(max anchor + gamma + 1, n) tokens: the last block's
labels are in, everything after is cut. Cost scales with the anchors, not with the full length.

Batch format (numpy; B = batch_size rows, S = seq_len slots, NB = max_blocks):
    tokens       int32 [B, S]   0 = padding
    positions    int32 [B, S]   position of the token within its own sequence (0 for padding)
    segment_ids  int32 [B, S]   1, 2, ... per packed sequence in the row; 0 = padding
    loss_mask    bool  [B, S]   True on response tokens
    block_start  int32 [B, NB]  slot of each block's anchor token in the row (0 where invalid)
    block_valid  bool  [B, NB]
    token_index  int64 [B, S]   index of the token in ShardSource.tokens (0 for padding): where its
                                cached target features live (`dspark_jax.data.feature_cache`); host
                                only (int64: no limit on the data size), the trainer drops it before
                                the batch goes to the device
Block j of row b: slot k (0 <= k < gamma) of the block sits at position positions[b, s] + k with
s = block_start[b, j], and its label is tokens[b, s + k + 1]. That label is valid iff
s + k + 1 < S and segment_ids[b, s + k + 1] == segment_ids[b, s] (see `block_labels`); invalid
labels are the ones past the end of the sequence. Its context is the slots of the same segment
before s.

Multi-process. Two ways to feed several JAX processes:
  * the global stream (what the trainer does): every process builds the same stream of global
    batches (`shard_options=grain.sharding.NoSharding()`, batch_size = the global rows) and keeps
    the rows its devices hold (`process_rows`), which it hands to
    `jax.make_array_from_process_local_data`. Global batch g is then a function of the data, the
    seed and g alone, not of the process count, so a run continues identically on another
    topology, and the iterator state is the same on every process (one copy to checkpoint). The
    price: every process reads, shuffles and packs the whole global batch (host work, not device
    work; gathering cached target features happens on the kept rows only).
  * grain's per-process slice (the default, `grain.sharding.ShardByJaxProcess(drop_remainder=True)`):
    each process reads a disjoint contiguous slice of the examples, shuffles and packs it
    independently and yields its own [B, S] batch; the global batch is process_count * B rows.
    Host work divides over the processes, but the global batches depend on the process count (a
    checkpoint's data position only means something on the same topology: grain stores one iterator
    state per process), and because packing density differs between processes, finite epochs can
    give different numbers of batches per process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.data.shards import read_manifest, read_shard
from dspark_jax.core.errors import UserError


# ---------------------------------------------------------------------------- source


class ShardSource:
    """grain RandomAccessDataSource over one or more datagen output folders.

    Element i: {"tokens": int32 [n] (prompt + response ids), "prompt_len": int, "index": i,
    "offset": where the example starts in `tokens`, the concatenation of all examples}.
    Only the shards listed in each manifest are read (an unfinished datagen run is usable);
    `shard_entries` keeps, per folder, the manifest entries of the shards that were read, and
    `folder_examples` the [first, end) example range of each folder.
    All folders must come from the same target. Everything is held in memory (int32 tokens).
    """

    def __init__(self, folders: str | Sequence[str]):
        folders = [folders] if isinstance(folders, (str, os.PathLike)) else list(folders)
        if not folders:
            raise UserError("no data folders given")
        tokens, offsets, prompt_lens, ids = [], [np.zeros(1, np.int64)], [], []
        target = None
        total = 0
        self.shard_entries, self.folder_examples = [], []
        for folder in folders:
            first = len(ids)
            manifest = read_manifest(folder)
            self.shard_entries.append(list(manifest["shards"]))
            key = (manifest["target"], tuple(sorted(manifest["target_shape"].items())))
            if target is not None and key != target:
                raise UserError(f"{folder} was generated by target {manifest['target']!r}, the other folders "
                                f"by {target[0]!r}: do not mix targets")
            target = key
            for entry in manifest["shards"]:
                data = read_shard(os.path.join(folder, entry["file"]), entry.get("sha256"))
                tokens.append(data["tokens"].astype(np.int32))
                offsets.append(data["offsets"][1:].astype(np.int64) + total)
                prompt_lens.append(data["prompt_lens"].astype(np.int32))
                ids.extend(str(i) for i in data["example_ids"])
                total += len(data["tokens"])
            self.folder_examples.append((first, len(ids)))
        self.target_name = target[0]
        self.tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        self.offsets = np.concatenate(offsets)
        self.prompt_lens = np.concatenate(prompt_lens) if prompt_lens else np.zeros(0, np.int32)
        self.example_ids = ids
        if not len(self.prompt_lens):
            raise UserError(f"no finished data shards in {', '.join(map(str, folders))}")

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        return {"tokens": self.tokens[self.offsets[index]: self.offsets[index + 1]],
                "prompt_len": int(self.prompt_lens[index]), "index": index, "offset": int(self.offsets[index])}

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __repr__(self) -> str:
        return f"ShardSource({len(self)} examples, {len(self.tokens)} tokens, target={self.target_name!r})"

    def response_token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id occurs in the responses (prompts excluded): [vocab_size] int64."""
        starts = self.offsets[:-1] + self.prompt_lens
        in_response = np.zeros(len(self.tokens) + 1, np.int64)
        np.add.at(in_response, starts, 1)
        np.add.at(in_response, self.offsets[1:], -1)
        mask = np.cumsum(in_response[:-1]) > 0
        return np.bincount(self.tokens[mask], minlength=vocab_size)[:vocab_size]


def draft_vocabulary(source: ShardSource, size: int, vocab_size: int) -> tuple[tuple[int, ...], float]:
    """The `size` most frequent response tokens of the data (ties: the lower id), sorted, and the
    share of response tokens they cover: a drafter's draft vocabulary."""
    counts = source.response_token_counts(vocab_size)
    ids = tuple(int(i) for i in np.sort(np.lexsort((np.arange(vocab_size), -counts))[:size]))
    return ids, _share(counts, ids)


def vocabulary_coverage(source: ShardSource, ids, vocab_size: int) -> float:
    """The share of `source`'s response tokens that are among `ids` (a draft vocabulary: a token
    outside it can never be drafted)."""
    return _share(source.response_token_counts(vocab_size), ids)


def _share(counts: np.ndarray, ids) -> float:
    return float(counts[list(ids)].sum() / max(counts.sum(), 1))


class _Subset:
    """The examples of `source` at `indices` (keeps grain's source protocol; elements keep their
    original "index")."""

    def __init__(self, source, indices: np.ndarray):
        self.source, self.indices = source, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        return self.source[int(self.indices[int(i)])]


# ---------------------------------------------------------------------------- anchors


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    batch_size: int  # B rows per batch (per process with grain's per-process slice, else global)
    seq_len: int  # S slots per row
    max_blocks: int  # NB blocks per row
    block_size: int  # gamma
    anchors_per_seq: int  # anchors (= blocks) drawn per example per epoch
    seed: int = 0
    num_epochs: int | None = None  # None = endless

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "max_blocks", "block_size", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1")
        if self.anchors_per_seq > self.max_blocks:
            raise UserError(f"anchors_per_seq={self.anchors_per_seq} exceeds max_blocks={self.max_blocks}: "
                            "one sequence's blocks must fit in a row")
        if self.seq_len < self.block_size + 3:
            raise UserError(f"seq_len={self.seq_len} is too short for block_size={self.block_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise UserError("num_epochs must be at least 1 (or None for endless)")
        if not 0 <= self.seed < 2**32:
            raise UserError("seed must be in [0, 2**32)")


def anchor_range(prompt_len: int, length: int, cfg: PackingConfig) -> tuple[int, int]:
    """[lo, hi] (inclusive) of valid anchor slots; empty when hi < lo."""
    return prompt_len, min(length - 2, cfg.seq_len - cfg.block_size - 1)


def sample_anchors(rng: np.random.Generator, prompt_len: int, length: int, cfg: PackingConfig) -> np.ndarray:
    """Sorted distinct anchors (int32) for one example; all valid positions if there are few."""
    lo, hi = anchor_range(prompt_len, length, cfg)
    count = hi - lo + 1
    if count <= 0:
        return np.zeros(0, np.int32)
    if count <= cfg.anchors_per_seq:
        return np.arange(lo, hi + 1, dtype=np.int32)
    return (lo + np.sort(rng.choice(count, cfg.anchors_per_seq, replace=False))).astype(np.int32)


def make_unit(example: dict, anchors: np.ndarray, cfg: PackingConfig) -> dict:
    """The packed unit of one example: its tokens up to the last block's last label, and their
    indices in ShardSource.tokens."""
    tokens, prompt_len = example["tokens"], example["prompt_len"]
    end = min(int(anchors.max()) + cfg.block_size + 1, len(tokens))
    return {"tokens": np.asarray(tokens[:end], np.int32),
            "loss_mask": np.arange(end) >= prompt_len,
            "anchors": anchors.astype(np.int32),
            "token_index": example["offset"] + np.arange(end, dtype=np.int64)}


class _SampleAnchors(grain.experimental.MapWithIndexTransform):
    """index (position in the repeated, shuffled stream) -> epoch; anchors from (seed, epoch, example)."""

    def __init__(self, cfg: PackingConfig, epoch_len: int):
        self.cfg, self.epoch_len = cfg, epoch_len

    def map_with_index(self, index: int, example: dict) -> dict:
        epoch = index // self.epoch_len
        rng = np.random.default_rng([self.cfg.seed, epoch, example["index"]])
        anchors = sample_anchors(rng, example["prompt_len"], len(example["tokens"]), self.cfg)
        return make_unit(example, anchors, self.cfg)


def finish_batch(rows: dict, cfg: PackingConfig) -> dict:
    """grain's packed rows -> the batch format of the module docstring (padded to B rows)."""
    tokens = rows["tokens"].astype(np.int32)
    seg = rows["tokens_segment_ids"].astype(np.int32)
    pos = rows["tokens_positions"].astype(np.int32)
    anchors = rows["anchors"].astype(np.int32)
    block_seg = rows["anchors_segment_ids"].astype(np.int32)
    block_valid = block_seg > 0
    # The slot where each block's sequence starts: same segment, position 0.
    starts = ((seg[:, None, :] == block_seg[:, :, None]) & (pos[:, None, :] == 0)).argmax(-1)
    block_start = np.where(block_valid, starts + anchors, 0).astype(np.int32)
    tokens_present = seg > 0
    out = dict(tokens=np.where(tokens_present, tokens, 0).astype(np.int32),
               positions=np.where(tokens_present, pos, 0).astype(np.int32),
               segment_ids=seg.astype(np.int32),
               loss_mask=rows["loss_mask"].astype(bool) & tokens_present,
               block_start=block_start, block_valid=block_valid,
               token_index=np.where(tokens_present, rows["token_index"], 0).astype(np.int64))
    missing = cfg.batch_size - out["tokens"].shape[0]
    if missing > 0:  # the last batch of a finite run: pad with empty rows (fixed shapes)
        out = {k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)]) for k, v in out.items()}
    return out


# ---------------------------------------------------------------------------- dataset


def usable_indices(source: ShardSource, cfg: PackingConfig) -> np.ndarray:
    """Examples with at least one valid anchor."""
    lengths = source.lengths()
    hi = np.minimum(lengths - 2, cfg.seq_len - cfg.block_size - 1)
    return np.nonzero(hi >= source.prompt_lens)[0]


def process_shard(num_examples: int, shard_options=None) -> tuple[int, int]:
    """[start, end) of this process's examples (grain ShardByJaxProcess: jax.process_index/count)."""
    from grain._src.core.sharding import even_split

    if shard_options is None:
        shard_options = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    return even_split(num_examples, shard_options)


def process_rows(sharding: jax.sharding.Sharding, rows: int) -> np.ndarray:
    """The rows (ascending) of a global [rows, ...] batch that this process's devices hold under
    `sharding` (its first dimension): the process-local data `jax.make_array_from_process_local_data`
    expects, in its order. All rows where the sharding replicates the batch."""
    held: set[int] = set()
    for index in sharding.addressable_devices_indices_map((rows,)).values():
        held.update(range(*index[0].indices(rows)))
    return np.asarray(sorted(held), np.int64)


def make_dataset(data: str | Sequence[str] | ShardSource, cfg: PackingConfig, *, shard_options=None,
                 read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
    """The batch stream (an IterDataset: `iter(...)` gives a checkpointable iterator).

    `data`: datagen folder(s) or a ShardSource. `shard_options`: a `grain.sharding.ShardOptions`
    (default: ShardByJaxProcess(drop_remainder=True), i.e. this JAX process's slice;
    `grain.sharding.NoSharding()` for the global stream, see "Multi-process" above).
    """
    source = data if isinstance(data, ShardSource) else ShardSource(data)
    indices = usable_indices(source, cfg)
    start, end = process_shard(len(indices), shard_options)
    indices = indices[start:end]
    if not len(indices):
        raise UserError(f"no usable examples for this process ({len(source)} examples in the data; an example "
                        f"needs a response of 2+ tokens and a prompt shorter than seq_len - block_size - 1)")
    ds = grain.MapDataset.source(_Subset(source, indices))
    ds = ds.shuffle(seed=cfg.seed).repeat(cfg.num_epochs)
    ds = ds.map_with_index(_SampleAnchors(cfg, epoch_len=len(indices)))
    read_options = read_options or grain.ReadOptions(num_threads=1, prefetch_buffer_size=256)
    it_ds = ds.to_iter_dataset(read_options)
    packed = grain.experimental.FirstFitPackIterDataset(
        it_ds, length_struct={"tokens": cfg.seq_len, "loss_mask": cfg.seq_len, "anchors": cfg.max_blocks,
                              "token_index": cfg.seq_len},
        num_packing_bins=cfg.batch_size, shuffle_bins=False)
    return packed.batch(cfg.batch_size, drop_remainder=False).map(functools.partial(finish_batch, cfg=cfg))


def block_labels(batch: dict, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(label slot index [B, NB, gamma] (clipped into the row), label valid [B, NB, gamma]).

    Slot k of block j predicts tokens[b, block_start + k + 1]; valid iff the block is valid and that
    slot is in the row, in the block's own segment (works on numpy or jax arrays)."""
    xp = jnp if isinstance(batch["tokens"], jax.Array) else np
    S = batch["tokens"].shape[1]
    idx = batch["block_start"][:, :, None] + xp.arange(1, block_size + 1)[None, None, :]
    clipped = xp.minimum(idx, S - 1)
    seg = batch["segment_ids"]
    label_seg = xp.take_along_axis(seg, clipped.reshape(seg.shape[0], -1), axis=1).reshape(clipped.shape)
    anchor_seg = xp.take_along_axis(seg, batch["block_start"], axis=1)
    valid = batch["block_valid"][:, :, None] & (idx < S) & (label_seg == anchor_seg[:, :, None])
    return clipped, valid


def packing_stats(batch: dict) -> dict:
    """Fill ratios of one batch (tokens used / slots, blocks used / block slots)."""
    return dict(token_fill=float((batch["segment_ids"] > 0).mean()), block_fill=float(batch["block_valid"].mean()),
                sequences=int(sum(len(np.unique(r[r > 0])) for r in batch["segment_ids"])))


# ---------------------------------------------------------------------------- target features


@functools.partial(jax.jit, static_argnames=("target_cfg", "tap_layers"))
def _target_features(target_params, target_cfg, tokens, positions, segment_ids, tap_layers):
    from dspark_jax.models import decoder

    hidden, taps = decoder.forward_packed(target_params, target_cfg, tokens, positions, segment_ids,
                                          tap_layers=tap_layers)
    ctx = jnp.concatenate(list(taps), axis=-1)  # [B, S, m*d]: [H(l_1); ...; H(l_m)]
    return jax.lax.stop_gradient(ctx), jax.lax.stop_gradient(hidden)


def target_features(target_params, target_cfg, batch: dict, tap_layers: Sequence[int]):
    """The online target path: run the frozen target over a packed batch.

    Returns (ctx_features [B, S, m*d]: the residual streams after the tap layers (decoder tap
    convention: `tap_layers` as in DrafterConfig.tap_layers), concatenated on the feature axis in
    the order given; target_last_hidden [B, S, d]: the final-normed hidden state, the LM head's
    input). Sequences packed in one row never attend to each other (segment ids).
    """
    tap_layers = tuple(int(t) for t in tap_layers)
    if not tap_layers:
        raise UserError("target_features needs at least one tap layer")
    return _target_features(target_params, target_cfg, jnp.asarray(batch["tokens"]),
                            jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]), tap_layers)
