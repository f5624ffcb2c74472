"""Turn named checkpoint tensors into our parameter pytree, checking every slot is set exactly once.

Each checkpoint format (Hugging Face safetensors, GGUF, DeepSpec drafters) is a name-mapping table
from its tensor names to (our parameter path, layer index or None, transpose?). This module owns
the checks so that every loader reports the same clear errors.

Files are never trusted for sizes: a loader first passes the tensors' shapes as the file's header
states them (`StoredTensor`, no data read), and every claimed shape is checked against them before
anything is allocated, so a config that claims a huge model costs nothing and memory stays at the
size of the real weights. `Claims` words a mismatch in the config file's own terms.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from dspark_jax.core.errors import UserError

# (regex over the checkpoint's name) -> (our path "a/b", whether the tensor is [out, in] and must be
# transposed to our [in, out] layout). A path containing "layers/" takes the layer index from the
# regex's first group.
NameTable = list[tuple[str, str, bool]]

# The config quantity behind each axis of the decoder's parameters (our [in, out] order, stacked
# layout without the layer axis): see `models.decoder.param_shapes`.
DECODER_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "hidden"), "final_norm": ("hidden",), "lm_head": ("hidden", "vocab"),
    "layers/attn_norm": ("hidden",), "layers/mlp_norm": ("hidden",),
    "layers/attn_post_norm": ("hidden",), "layers/mlp_post_norm": ("hidden",),
    "layers/wq": ("hidden", "q"), "layers/wk": ("hidden", "kv"), "layers/wv": ("hidden", "kv"),
    "layers/wo": ("q", "hidden"), "layers/bq": ("q",), "layers/bk": ("kv",), "layers/bv": ("kv",),
    "layers/q_norm": ("head_dim",), "layers/k_norm": ("head_dim",),
    "layers/w_gate": ("hidden", "ffn"), "layers/w_up": ("hidden", "ffn"), "layers/w_down": ("ffn", "hidden"),
}


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor as its file's header describes it; nothing of its data has been read."""

    name: str
    shape: tuple[int, ...]  # in the file's order (a linear weight is [out, in])
    file: str  # where it is, for messages


@dataclasses.dataclass(frozen=True)
class Claims:
    """What a config file claims, to word shape mismatches in its own terms."""

    source: str  # the file making the claims, e.g. "config.json"
    axes: dict[str, tuple[str, int]]  # axis symbol of DECODER_AXES -> ("vocab_size 4000000", 4000000)
    layers: str  # e.g. "num_hidden_layers 3"
    param_axes: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(DECODER_AXES))


def decoder_claims(cfg, source: str, keys: dict[str, str]) -> Claims:
    """Claims of a decoder ModelConfig; `keys` names the config keys behind vocab, hidden, layers,
    heads, kv_heads, head_dim and ffn in the source file's spelling."""
    def one(axis: str, value: int) -> str:
        return f"{keys[axis]} {value}"

    def heads(axis: str, n: int) -> tuple[str, int]:
        return f"({one(axis, n)} * {one('head_dim', cfg.head_dim)})", n * cfg.head_dim

    return Claims(source, {
        "vocab": (one("vocab", cfg.vocab_size), cfg.vocab_size),
        "hidden": (one("hidden", cfg.hidden_size), cfg.hidden_size),
        "ffn": (one("ffn", cfg.intermediate_size), cfg.intermediate_size),
        "head_dim": (one("head_dim", cfg.head_dim), cfg.head_dim),
        "q": heads("heads", cfg.num_heads), "kv": heads("kv_heads", cfg.num_kv_heads),
    }, one("layers", cfg.num_layers))


def _paths(shapes: dict, prefix: str = "") -> Iterator[tuple[str, tuple]]:
    for k, v in shapes.items():
        if isinstance(v, dict):
            yield from _paths(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _match(compiled, name: str):
    for regex, path, transpose in compiled:
        m = regex.match(name)
        if m:
            return m, path, transpose
    return None, None, False


def _missing(seen: set, count: int) -> list[tuple[int, int]]:
    """The runs (first, last) of 0..count-1 not in `seen`, found from `seen` alone: `count` is a
    claim and may be huge."""
    runs, start = [], 0
    for i in sorted(seen) + [count]:
        if i > start:
            runs.append((start, i - 1))
        start = i + 1
    return runs


def _ranges(runs: Sequence[tuple[int, int]], limit: int = 4) -> str:
    """[(0, 2), (5, 5)] -> "0-2, 5"."""
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    return ", ".join(text) + (", ..." if len(runs) > limit else "")


class _Slots:
    """The matching and bookkeeping shared by the header check and the load."""

    def __init__(self, shapes: dict, table: NameTable, source: str, ignore: Callable[[str], bool],
                 claims: Claims | None):
        self.compiled = [(re.compile(pattern + r"$"), path, transpose) for pattern, path, transpose in table]
        self.flat = dict(_paths(shapes))
        self.seen: dict[str, set] = {p: set() for p in self.flat}
        self.source, self.ignore, self.claims = source, ignore, claims

    def place(self, name: str, file_shape: tuple, shape, where: str):
        """(path, layer) for tensor `name` whose shape is `shape` in our orientation (file_shape as
        stored), or None to skip it; raises for anything that does not fit the configuration."""
        m, path, transpose = _match(self.compiled, name)
        if m is None:
            if self.ignore(name):
                return None
            raise UserError(f"{where}: unexpected tensor {name!r} (not part of this architecture)")
        if path not in self.flat:
            if self.ignore(name):
                return None
            raise UserError(f"{where}: tensor {name!r} does not belong to this model's configuration")
        if transpose:
            shape = tuple(shape)[::-1]
        digits = m.group(1) if path.startswith("layers/") else None
        layer = None if digits is None else int(digits) if len(digits) < 19 else 1 << 63
        want = self.flat[path][1:] if layer is not None else self.flat[path]
        claims = self.claims
        if layer is not None and not 0 <= layer < self.flat[path][0]:
            if claims is not None:
                raise UserError(f"{where}: {name} is for layer {layer} but {claims.source} claims {claims.layers}")
            raise UserError(f"{where}: tensor {name!r} names layer {layer}, model has {self.flat[path][0]}")
        if tuple(shape) != tuple(want):
            axes = claims.param_axes.get(path) if claims is not None else None
            # Word it in the config's terms when those are what `shapes` was built from.
            if (axes is not None and len(file_shape) == len(shape)
                    and tuple(claims.axes[a][1] for a in axes) == tuple(want)):
                in_file = axes[::-1] if transpose else axes
                raise UserError(f"{where}: {name} is {list(file_shape)} but {claims.source} claims "
                                + " x ".join(claims.axes[a][0] for a in in_file))
            whence = f" by {claims.source}" if claims is not None else ""
            raise UserError(f"{where}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(want)}{whence}")
        key = layer if layer is not None else 0
        if key in self.seen[path]:
            raise UserError(f"{where}: tensor {name!r} sets {path} twice")
        self.seen[path].add(key)
        return path, layer

    def check_complete(self) -> None:
        for path, shape in self.flat.items():
            expected = shape[0] if path.startswith("layers/") else 1
            if len(self.seen[path]) != expected:
                if not path.startswith("layers/"):
                    raise UserError(f"{self.source}: checkpoint does not set parameter {path}")
                missing = _missing(self.seen[path], expected)
                if self.claims is not None:
                    raise UserError(f"{self.source}: {self.claims.source} claims {self.claims.layers} but "
                                    f"the weights have no {path} for layers {_ranges(missing)}")
                raise UserError(f"{self.source}: checkpoint does not set parameter {path} "
                                f"(layers {_ranges(missing)})")


def _prepared_shape(prepare, name: str, shape: tuple) -> tuple:
    """The shape `prepare` turns a stored tensor into, without its data: a zero-stride view of one
    float stands in for it (the header has already bounded the shape by the file's size)."""
    if prepare is None:
        return tuple(shape)
    return tuple(np.shape(prepare(name, np.broadcast_to(np.float32(0), tuple(shape)))))


def check_stored(shapes: dict, stored: Iterable[StoredTensor], table: NameTable, source: str,
                 ignore: Callable[[str], bool] = lambda name: False,
                 prepare: Callable[[str, np.ndarray], np.ndarray] | None = None,
                 claims: Claims | None = None) -> None:
    """Check the header shapes `stored` against `shapes` (what the config claims): every tensor
    known, of the claimed shape, set once, nothing missing. Reads and allocates nothing."""
    slots = _Slots(shapes, table, source, ignore, claims)
    for t in stored:
        slots.place(t.name, tuple(t.shape), _prepared_shape(prepare, t.name, t.shape), t.file)
    slots.check_complete()


def assemble_params(
    shapes: dict,
    tensors: Iterable[tuple[str, Callable[[], np.ndarray]]],
    table: NameTable,
    dtype,
    source: str,
    ignore: Callable[[str], bool] = lambda name: False,
    stored: Iterable[StoredTensor] | None = None,
    prepare: Callable[[str, np.ndarray], np.ndarray] | None = None,
    claims: Claims | None = None,
) -> dict:
    """Build the params pytree of `shapes` from (name, load-function) pairs.

    With `stored` (the file headers' shapes) everything is checked first (`check_stored`) and the
    parameters are allocated only after. `prepare(name, array)` fixes a tensor's layout before the
    shape check (e.g. drops a unit axis). Stacked layer parameters (shape (L, ...)) are filled one
    layer at a time. Errors name the checkpoint (`source`) and the tensor: unknown names, wrong
    shapes, duplicates, missing ones.
    """
    if stored is not None:
        check_stored(shapes, stored, table, source, ignore, prepare, claims)
    slots = _Slots(shapes, table, source, ignore, claims)
    out = {p: np.zeros(s, dtype=dtype) for p, s in slots.flat.items()}
    for name, load in tensors:
        m, path, transpose = _match(slots.compiled, name)
        if m is None or path not in slots.flat:
            slots.place(name, (), (), source)  # skips an ignored tensor, raises for any other
            continue
        array = np.asarray(load())
        if prepare is not None:
            array = np.asarray(prepare(name, array))
        path, layer = slots.place(name, array.shape, array.shape, source)
        if transpose:
            array = array.T
        if layer is None:
            out[path] = array.astype(dtype)
        else:
            out[path][layer] = array
    slots.check_complete()
    return nest(out, "/")


def flatten(tree: dict, sep: str, prefix: str = "") -> dict:
    """{"a": {"b": x}} -> {"a<sep>b": x}; only dicts are descended into."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, sep, f"{prefix}{k}{sep}"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def nest(flat: dict, sep: str) -> dict:
    """{"a/b": x} -> {"a": {"b": x}} (the inverse of flattening a params dict by path)."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(sep)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree
