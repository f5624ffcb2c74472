"""Turn named checkpoint tensors into our parameter pytree, checking every slot is set exactly once.

Each checkpoint format (Hugging Face safetensors, GGUF, DeepSpec drafters) is a name-mapping table
from its tensor names to (our parameter path, layer index or None, transpose?). This module owns
the checks so that every loader reports the same clear errors.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import numpy as np

from dspark_jax.errors import UserError

# (regex over the checkpoint's name) -> (our path "a/b", whether the tensor is [out, in] and must be
# transposed to our [in, out] layout). A path containing "layers/" takes the layer index from the
# regex's first group.
NameTable = list[tuple[str, str, bool]]


def _paths(shapes: dict, prefix: str = "") -> Iterator[tuple[str, tuple]]:
    for k, v in shapes.items():
        if isinstance(v, dict):
            yield from _paths(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def assemble_params(
    shapes: dict,
    tensors: Iterable[tuple[str, Callable[[], np.ndarray]]],
    table: NameTable,
    dtype,
    source: str,
    ignore: Callable[[str], bool] = lambda name: False,
) -> dict:
    """Build the params pytree of `shapes` from (name, load-function) pairs.

    Stacked layer parameters (shape (L, ...)) are filled one layer at a time. Errors name the
    checkpoint (`source`) and the tensor: unknown names, wrong shapes, duplicates, missing ones.
    """
    compiled = [(re.compile(pattern + r"$"), path, transpose) for pattern, path, transpose in table]
    flat = dict(_paths(shapes))
    out = {p: np.zeros(s, dtype=dtype) for p, s in flat.items()}
    seen: dict[str, set] = {p: set() for p in flat}
    for name, load in tensors:
        for regex, path, transpose in compiled:
            m = regex.match(name)
            if m:
                break
        else:
            if ignore(name):
                continue
            raise UserError(f"{source}: unexpected tensor {name!r} (not part of this architecture)")
        if path not in flat:
            if ignore(name):
                continue
            raise UserError(f"{source}: tensor {name!r} does not belong to this model's configuration")
        array = np.asarray(load())
        if transpose:
            array = array.T
        layer = int(m.group(1)) if path.startswith("layers/") else None
        want = flat[path][1:] if layer is not None else flat[path]
        if layer is not None and not 0 <= layer < flat[path][0]:
            raise UserError(f"{source}: tensor {name!r} names layer {layer}, model has {flat[path][0]}")
        if tuple(array.shape) != tuple(want):
            raise UserError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, expected {tuple(want)}")
        key = layer if layer is not None else 0
        if key in seen[path]:
            raise UserError(f"{source}: tensor {name!r} sets {path} twice")
        seen[path].add(key)
        if layer is None:
            out[path] = array.astype(dtype)
        else:
            out[path][layer] = array
    for path, shape in flat.items():
        expected = shape[0] if path.startswith("layers/") else 1
        if len(seen[path]) != expected:
            missing = sorted(set(range(expected)) - seen[path]) if path.startswith("layers/") else []
            where = f" (layers {missing[:5]}{'...' if len(missing) > 5 else ''})" if missing else ""
            raise UserError(f"{source}: checkpoint does not set parameter {path}{where}")
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
