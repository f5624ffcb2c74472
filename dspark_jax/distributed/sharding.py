"""The one table from logical axis names to mesh axes, and helpers that apply it.

Model code names the axes of its arrays logically ("batch", "heads", "mlp", ...); this module alone
decides which mesh axis each maps to. A dimension that the mapped mesh axis does not divide is
replicated instead (e.g. SmolLM2's 3 KV heads on a 4-way tensor axis).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_TO_MESH: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),  # activations, caches and data batches
    "vocab": "tensor",
    "embed": "fsdp",  # the model dimension of weights: sharded only when training with FSDP
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "seq": None,
    "head_dim": None,
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over the first data*fsdp*tensor devices; -1 for one axis means
    "all remaining devices" (the usual choice: the same config then fits any slice size)."""
    from dspark_jax.core.errors import UserError

    devices = list(devices if devices is not None else jax.devices())
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise UserError("at most one mesh axis may be -1")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        sizes[sizes.index(-1)] = max(1, len(devices) // known)
    n = int(np.prod(sizes))
    if n > len(devices) or min(sizes) < 1:
        raise UserError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]).reshape(sizes), MESH_AXES)


def logical_spec(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
    spec = []
    used: set[str] = set()
    for name, size in zip(axes, shape):
        target = LOGICAL_TO_MESH.get(name) if name else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1 and a not in used)
        total = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or size % total:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def tree_shardings(mesh: Mesh, logical_axes, shapes):
    """NamedShardings for a pytree, given matching trees of logical axes and of shapes."""
    return jax.tree.map(lambda axes, shape: NamedSharding(mesh, logical_spec(mesh, axes, shape)),
                        logical_axes, shapes, is_leaf=is_spec)


def is_spec(x) -> bool:
    """A leaf of a shape or logical-axes tree: a tuple of sizes or names (per-layer params hold
    a tuple of layer dicts, which is a node)."""
    return isinstance(x, tuple) and not any(isinstance(e, dict) for e in x)


def param_shardings(mesh: Mesh, cfg, layout: str = "stacked") -> dict:
    """Shardings of a target's params in `layout` (see `decoder.with_layout`)."""
    from dspark_jax.models.decoder import param_logical_axes, param_shapes

    return tree_shardings(mesh, param_logical_axes(cfg, layout), param_shapes(cfg, layout))


def cache_shardings(mesh: Mesh, cache):
    from dspark_jax.models.decoder import KVCache, keys_transposed

    v_axes = ("batch", "kv_heads", "seq", "head_dim")
    k_axes = ("batch", "kv_heads", "head_dim", "seq") if keys_transposed() else v_axes
    if not isinstance(cache.k, tuple):
        k_axes, v_axes = ("layers",) + k_axes, ("layers",) + v_axes

    def spec(axes):
        return lambda a: NamedSharding(mesh, logical_spec(mesh, axes, a.shape))

    return KVCache(jax.tree.map(spec(k_axes), cache.k), jax.tree.map(spec(v_axes), cache.v),
                   NamedSharding(mesh, logical_spec(mesh, ("batch",), cache.lengths.shape)))
