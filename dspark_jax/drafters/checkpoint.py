"""Our drafter checkpoint format: a folder with `drafter.safetensors` + `drafter.json`.

The JSON records everything needed to use the drafter: its DrafterConfig (including the target it
belongs to: name, vocab size, hidden size, layer count), the STS temperatures once calibrated, and
free-form metadata (training recipe, metrics). A drafter may be calibrated at several decoding
temperatures (greedy rounds and T = 1 rounds accept differently): `sts_by_temperature` maps each
decoding temperature it was calibrated at to its STS temperatures, `sts_temperatures` holds the
latest fit (what a reader that knows only one list uses), and `LoadedDrafter.sts_for(T)` picks the
calibration nearest to the temperature a request decodes at. Each file is written atomically (`core.files`: a
temporary name renamed into place, or one upload on an object store), so a crash never leaves a
half-written file; other files in the folder (e.g. the calibration report) are kept. A drafter is
written to gs:// (a training run folder there) but loaded from a local folder only (its weights are
read from disk): copy it down first.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from dspark_jax.checkpoints.assemble import flatten, nest
from dspark_jax.checkpoints.hf import FLOAT_DTYPES, safetensors_header
from dspark_jax.core.config_checks import ConfigError
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig

WEIGHTS = "drafter.safetensors"
META = "drafter.json"
FORMAT_VERSION = 1


def save_drafter(path: str, cfg: DrafterConfig, params: dict, *, sts_temperatures=None, sts_by_temperature=None,
                 metadata=None, dtype: str = "float32") -> None:
    """Write the drafter atomically (bf16 storage halves the size: `dtype="bfloat16"`).
    `sts_by_temperature`: {decoding temperature: STS temperatures} of every calibration kept."""
    from safetensors.numpy import save
    import ml_dtypes

    store = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    # C order: safetensors writes an array's memory as is, so a transposed (Fortran-order) one, e.g.
    # a weight loaded from DeepSpec's [out, in], would come back scrambled.
    flat = {k: np.asarray(np.asarray(v, dtype=np.float32).astype(store), order="C") for k, v in flatten(params, ".").items()}
    meta = {"format_version": FORMAT_VERSION, "config": dataclasses.asdict(cfg),
            "sts_temperatures": None if sts_temperatures is None else [float(t) for t in sts_temperatures],
            "sts_by_temperature": {f"{float(k):g}": [float(t) for t in v]
                                   for k, v in sorted((sts_by_temperature or {}).items())},
            "storage_dtype": dtype, "metadata": metadata or {}}
    files.makedirs(path)
    # Weights first: a crash in between leaves new weights with the old JSON, which the shape
    # check on load reports (or, for a calibration update, identical weights).
    files.atomic_write_bytes(os.path.join(path, WEIGHTS), save(flat))
    files.atomic_write_text(os.path.join(path, META), json.dumps(meta, indent=1))


def param_shapes(cfg: DrafterConfig) -> dict:
    if cfg.kind == "eagle3":
        from dspark_jax.drafters.eagle3 import eagle3_param_shapes

        return eagle3_param_shapes(cfg)
    from dspark_jax.drafters.dspark import drafter_param_shapes

    return drafter_param_shapes(cfg)


def drafter_logical_axes(params: dict) -> dict:
    """Logical axes of a drafter's params by name (see distributed.sharding.LOGICAL_TO_MESH), as
    trained and as decoded (a draft vocabulary's head and Markov rows split over the vocabulary like
    the target's head); a name not listed stays whole."""
    import jax

    layer_axes = {"wq": ("layers", "embed", "heads"), "wk": ("layers", "embed", "kv_heads"),
                  "wv": ("layers", "embed", "kv_heads"), "wo": ("layers", "heads", "embed"),
                  "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
                  "w_down": ("layers", "mlp", "embed")}
    top = {"fc": (None, "embed"), "w1": ("vocab", None), "w2": (None, "vocab"), "draft_head": ("vocab", None),
           "draft_markov": ("vocab", None)}

    def axes(path, leaf):
        name = path[-1].key
        if path[0].key == "layers" and not isinstance(path[1], jax.tree_util.SequenceKey):
            return layer_axes.get(name, ("layers",) + (None,) * (leaf.ndim - 1))
        found = top.get(name)
        return found if found is not None and len(found) == leaf.ndim else (None,) * leaf.ndim

    return jax.tree_util.tree_map_with_path(axes, params)


@dataclasses.dataclass
class LoadedDrafter:
    config: DrafterConfig
    params: dict
    sts_temperatures: tuple[float, ...] | None
    metadata: dict
    storage_dtype: str = "float32"
    sts_by_temperature: dict = dataclasses.field(default_factory=dict)  # {decoding temperature: STS temperatures}

    def calibrated_at(self, temperature: float) -> float | None:
        """The decoding temperature of the calibration a request at `temperature` uses: the nearest
        one calibrated (greedy for greedy requests when both exist); None without per-temperature
        calibrations."""
        if not self.sts_by_temperature:
            return None
        return min(self.sts_by_temperature, key=lambda t: (abs(t - float(temperature)), t))

    def sts_for(self, temperature: float) -> tuple[float, ...] | None:
        """The STS temperatures to decode at `temperature` with (`calibrated_at`), else the one list."""
        at = self.calibrated_at(temperature)
        return self.sts_temperatures if at is None else self.sts_by_temperature[at]

    def decoding_dtype(self, target) -> str:
        """The dtype a DSpark drafter decodes in: bfloat16 when its weights are stored so (their exact
        values at half the bytes a pass streams) or the target's are, else float32. Eagle3: the
        target's weight dtype."""
        if self.config.kind != "dspark":
            return target.weight_dtype
        return "bfloat16" if "bfloat16" in (self.storage_dtype, target.weight_dtype) else target.weight_dtype

    def decoding_params(self, target) -> dict:
        """The params to decode with beside `target` (a registry Target): in `decoding_dtype`, a DSpark
        drafter's in its decoding layout (`dspark.decoding_layout`), plus the frozen LM-head rows of a
        draft vocabulary (`dspark.with_draft_head`)."""
        import jax
        import jax.numpy as jnp

        dtype = self.decoding_dtype(target)
        if self.config.kind != "dspark":
            return jax.tree.map(lambda a: jnp.asarray(a, dtype), self.params)
        from dspark_jax.drafters.dspark import decoding_layout, with_draft_head

        params = decoding_layout(self.params, self.config, dtype)
        return with_draft_head(params, self.config, target.params, target.config)


def _read_meta(path: str) -> tuple[dict, DrafterConfig]:
    files.local_only(path, "drafter")
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path) or not os.path.exists(meta_path):
        raise UserError(f"no drafter checkpoint at {path} (expected {META} and {WEIGHTS})")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        raw = dict(meta["config"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"corrupt drafter metadata {meta_path}: {e}") from None
    try:
        return meta, DrafterConfig(**raw)  # every field checked (type and range): a bad file is a UserError
    except ConfigError as e:
        raise e.within(source=meta_path) from None
    except TypeError as e:
        raise UserError(f"drafter config in {meta_path} does not match this version: {e}") from None


def exported_step(path: str) -> int | None:
    """The training step a complete drafter folder was exported at (its metadata's `steps`); None
    where the folder holds no complete drafter or no step. Any folder a run writes to (gs:// too)."""
    meta_path = os.path.join(path, META)
    if not (files.exists(meta_path) and files.exists(os.path.join(path, WEIGHTS))):
        return None
    try:
        steps = json.loads(files.read_text(meta_path))["metadata"]["steps"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) else None


def read_drafter_config(path: str) -> DrafterConfig:
    """Only the DrafterConfig of a drafter folder (its JSON, no weights): cheap, for checks before
    anything loads."""
    return _read_meta(path)[1]


def load_drafter(path: str, target: ModelConfig | None = None, target_name: str = "") -> LoadedDrafter:
    """Load a drafter folder; with `target`, check that the drafter belongs to it."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    weights_path = os.path.join(path, WEIGHTS)
    meta, cfg = _read_meta(path)
    # The JSON's claimed shapes against the weights file's header, before anything is allocated.
    header = safetensors_header(weights_path, what="drafter weights")
    if target is not None:
        cfg.check_target(target, target_name)
    want = {k: tuple(v) for k, v in flatten(param_shapes(cfg), ".").items()}
    have = {k: shape for k, (_, shape) in header.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:3]
        raise UserError(f"drafter weights in {weights_path} do not match its config (first differences: {diff})")
    odd = sorted(f"{k} ({dtype})" for k, (dtype, _) in header.items() if dtype not in FLOAT_DTYPES)
    if odd:
        raise UserError(f"drafter weights in {weights_path} are not floating point: {', '.join(odd[:3])}")
    try:
        flat = load_file(weights_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"corrupt drafter weights {weights_path}: {e}") from None
    params = nest({k: np.asarray(v, np.float32) for k, v in flat.items()}, ".")
    temps = meta.get("sts_temperatures")
    try:
        by_temperature = {float(k): tuple(float(t) for t in v) for k, v in (meta.get("sts_by_temperature") or {}).items()}
    except (AttributeError, TypeError, ValueError) as e:
        raise UserError(f"corrupt sts_by_temperature in {os.path.join(path, META)}: {e}") from None
    return LoadedDrafter(cfg, params, tuple(temps) if temps else None, meta.get("metadata", {}),
                         meta.get("storage_dtype", "float32"), by_temperature)
