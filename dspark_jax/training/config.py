"""Training run configuration: small YAML files under configs/ plus `key=value` overrides.

A config has five sections (see configs/dspark_smollm2-135m.yaml):
  target:   name or path of the frozen target
  drafter:  DrafterConfig fields that are not derived from the target (kind, num_layers, block_size,
            head, markov_rank, confidence, target_layer_ids, mask_token_id, ...)
  loss:     LossWeights (ce, tv, conf, decay)
  data:     where the regenerated responses live, how batches are packed, the optional feature cache
  optim:    optax settings;  run: output folder, logging, checkpointing, mesh, dtype
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.errors import UserError
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.losses import LossWeights


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train_dir: str = "data/smollm2-train"
    eval_dir: str = ""
    rows: int = 4  # B: packed rows per micro-batch
    seq_len: int = 1024  # S: tokens per packed row
    blocks_per_row: int = 32  # NB
    anchors_per_seq: int = 16
    seed: int = 0
    # A folder for the target's features of train_dir (dspark_jax/data/feature_cache.py): built on
    # the first run, then training reads them instead of running the target. None = online (as are
    # null, false, no, off and none, e.g. data.feature_cache=false on the command line).
    feature_cache: str | None = None


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    grad_accum: int = 1
    steps: int = 1000


@dataclasses.dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs/dspark"
    log_every: int = 10
    save_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 8
    compute_dtype: str = "bfloat16"  # master weights stay float32
    mesh: tuple[int, int, int] = (-1, 1, 1)  # (data, fsdp, tensor); -1 = all remaining devices


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    target: str
    drafter: dict  # DrafterConfig fields; completed from the target by `drafter_config`
    loss: LossWeights = LossWeights()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    run: RunConfig = RunConfig()

    def drafter_config(self, target: ModelConfig, target_name: str) -> DrafterConfig:
        """The drafter's layers are shaped like the target's; taps default to 5 evenly spaced layers."""
        d = dict(self.drafter)
        defaults = dict(
            hidden_size=target.hidden_size, num_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim, intermediate_size=target.intermediate_size, vocab_size=target.vocab_size,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_layer_ids=default_tap_layers(target.num_layers, 5),
            target_name=target_name, target_vocab_size=target.vocab_size,
            target_hidden_size=target.hidden_size, target_num_layers=target.num_layers)
        for k, v in defaults.items():
            d.setdefault(k, v)
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        try:
            return DrafterConfig(**d)
        except TypeError as e:
            raise UserError(f"bad drafter section: {e}") from None


def default_tap_layers(num_layers: int, m: int = 5) -> tuple[int, ...]:
    """m layer ids spread evenly from 1 to L-3 (DESIGN.md 2.1), DeepSpec's 0-based convention."""
    if num_layers < 4:
        return tuple(range(min(m, num_layers)))
    last = num_layers - 3
    return tuple(sorted({round(1 + i * (last - 1) / (m - 1)) for i in range(m)}))


_SECTIONS = {"loss": LossWeights, "data": DataConfig, "optim": OptimConfig, "run": RunConfig}


def _coerce(section: str, cls, values: dict) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise UserError(f"unknown {section} setting(s): {', '.join(unknown)} (known: {', '.join(fields)})")
    out = {}
    for k, v in values.items():
        default = getattr(cls(), k)
        if fields[k].type == "str | None" and (v is False or (isinstance(v, str) and v.lower() == "none")):
            v = None  # an optional setting switched off: data.feature_cache=false (YAML also: no, off)
        if fields[k].type in ("str", "str | None") and v is not None:
            if isinstance(v, bool):  # YAML reads true/false/yes/no/on/off as booleans
                raise UserError(f"{section}.{k} must be a string, got {str(v).lower()}"
                                + (" (false, null or none switch it off)" if fields[k].type == "str | None" else ""))
            if isinstance(v, (dict, list)):
                raise UserError(f"{section}.{k} must be a string, got {v!r}")
            v = str(v)  # a path like 2024 parses as a number
        elif isinstance(default, tuple):
            v = tuple(v)
        elif isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(v, str):
            try:  # YAML 1.1 reads "1e-3" as a string
                v = type(default)(float(v)) if isinstance(default, float) else int(v)
            except ValueError:
                raise UserError(f"{section}.{k} must be a number, got {v!r}") from None
        out[k] = v
    return cls(**out)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise UserError(f"override {text!r} is not key=value (e.g. optim.lr=3e-4)")
    key, value = text.split("=", 1)
    parsed = yaml.safe_load(value)
    if isinstance(parsed, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return key.strip().split("."), parsed


def load_config(path: str, overrides: list[str] = ()) -> TrainConfig:
    if not os.path.exists(path):
        raise UserError(f"no such config file: {path}")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping of sections")
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise UserError(f"override {text!r}: {k} is not a section")
        node[keys[-1]] = value
    unknown = sorted(set(raw) - {"target", "drafter", *_SECTIONS})
    if unknown:
        raise UserError(f"{path}: unknown section(s) {', '.join(unknown)}")
    if "target" not in raw or "drafter" not in raw:
        raise UserError(f"{path} needs a 'target' and a 'drafter' section")
    sections = {name: _coerce(name, cls, raw.get(name) or {}) for name, cls in _SECTIONS.items()}
    return TrainConfig(target=str(raw["target"]), drafter=dict(raw["drafter"]), **sections)


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
