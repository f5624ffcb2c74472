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
import datetime
import re
from typing import Any

import yaml

from dspark_jax.core import config_checks
from dspark_jax.core.config_checks import ConfigError, relation, setting, validate
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core.errors import UserError
from dspark_jax.core.files import read_bytes, url_problem
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.losses import LossWeights


def _named(key: str) -> config_checks.Relation:
    return relation(key, lambda **v: bool(v[key].strip()), f"{key} must not be empty")


def _storage(key: str) -> config_checks.Relation:
    """A local path or a URL we can use (core.files), checked when the config loads."""
    return relation(key, lambda **v: not v[key] or url_problem(v[key]) is None,
                    f"{key} {{{key}}}: use a local path or a gs://, s3://, az:// or hf:// URL (gs:// needs gcsfs: "
                    "pip install 'dspark_jax[gcs]')")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train_dir: str = "data/smollm2-train"  # a datagen folder, or a folder of them (all are used)
    eval_dir: str = ""
    rows: int = setting(4, ge=1)  # B: packed rows per micro-batch
    seq_len: int = setting(1024, ge=4)  # S: tokens per packed row
    blocks_per_row: int = setting(32, ge=1)  # NB
    anchors_per_seq: int = setting(16, ge=1)
    seed: int = setting(0, ge=0, lt=2**32)
    # A folder for the target's features of train_dir (dspark_jax/data/feature_cache.py): built on
    # the first run, then training reads them instead of running the target. None = online (as are
    # null, false, no, off and none, e.g. data.feature_cache=false on the command line).
    feature_cache: str | None = None
    # The dtype the target's weights take to build the feature cache; None = the run's compute dtype,
    # so cached features are the online path's (up to their bfloat16 storage). bfloat16 on an fp32 run
    # builds ~1.76x faster on CPUs with a bf16 matrix unit (AMX) for features that differ from the
    # fp32 ones by about their storage rounding (docs/training.md).
    feature_cache_dtype: str | None = setting(None, choices=(None, "float32", "bfloat16", "float16"))

    __relations__ = (
        _named("train_dir"), _storage("train_dir"), _storage("eval_dir"), _storage("feature_cache"),
        relation("anchors_per_seq blocks_per_row", lambda anchors_per_seq, blocks_per_row:
                 anchors_per_seq <= blocks_per_row,
                 "anchors_per_seq={anchors_per_seq} exceeds blocks_per_row={blocks_per_row}: "
                 "one sequence's blocks must fit in a row"),
    )

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(6e-4, gt=0)
    warmup_frac: float = setting(0.04, ge=0, le=1)
    # Warmup steps, instead of warmup_frac x steps (a run whose length a time budget decides).
    warmup_steps: int | None = setting(None, ge=1)
    # cosine: decay to 0 at optim.steps. constant: hold lr after the warmup (a run that a
    # run.time_budget_s ends, continued from a drafter in the next sitting: docs/training.md).
    schedule: str = setting("cosine", choices=("cosine", "constant"))
    weight_decay: float = setting(0.0, ge=0)
    clip_norm: float = setting(1.0, gt=0)
    b1: float = setting(0.9, ge=0, lt=1)
    b2: float = setting(0.95, ge=0, lt=1)
    grad_accum: int = setting(1, ge=1)
    steps: int = setting(1000, ge=1)
    # Start the draft layers from the target's last layers (every weight of the same shape; the
    # draft layers' q/k norms, which a Llama target has not, stay at one) instead of at random.
    init_from_target: bool = False
    # Start every drafter parameter from a trained drafter folder (drafter.json + safetensors, e.g.
    # the shipped one) of the very same config: a run continues training a drafter on new data
    # without its checkpoints (they stay on the machine that wrote them; a drafter folder travels).
    init_from_drafter: str | None = None

    __relations__ = (
        relation("init_from_target init_from_drafter", lambda init_from_target, init_from_drafter:
                 not (init_from_target and init_from_drafter),
                 "optim.init_from_target and optim.init_from_drafter both choose the starting weights: set one"),
    )

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs/dspark"
    log_every: int = setting(10, ge=1)
    save_every: int = setting(200, ge=1)
    keep_checkpoints: int = setting(2, ge=1)
    eval_every: int = setting(0, ge=0)  # 0 = only at the end
    eval_batches: int = setting(8, ge=1)
    # Wall-clock seconds this process may train (0: no limit): the run stops, saves and exports
    # after the step that leaves less than one more step's time; --resume continues it.
    time_budget_s: float = setting(0.0, ge=0)
    compute_dtype: str = setting("bfloat16", choices=("float32", "bfloat16", "float16"))  # master weights: float32
    # Rematerialisation of the draft layers in the backward pass (jax.checkpoint): "none" keeps every
    # activation, "dots" keeps the layers' weight products and recomputes attention and the
    # elementwise rest, "full" keeps only each layer's input. Memory against recomputed flops:
    # docs/training.md has both, per policy, for a TPU config.
    remat: str = setting("none", choices=("none", "dots", "full"))
    # The loss's vocabulary-wide part ([blocks, gamma, V] logits of drafter and target) is computed
    # at most this many blocks of a row at a time, recomputed in the backward pass; 0 = all blocks
    # at once. DSpark and DFlash (Eagle3's loss is per pass). It costs a second LM-head forward per
    # slot for little memory on a Qwen3-8B step (docs/training.md): the last resort, not the first.
    logit_chunk: int = setting(0, ge=0)
    mesh: tuple[int, int, int] = setting((-1, 1, 1), ge=-1)  # (data, fsdp, tensor); -1 = all remaining devices

    __relations__ = (
        _named("out_dir"), _storage("out_dir"),
        relation("mesh", lambda mesh: 0 not in mesh and mesh.count(-1) <= 1,
                 "mesh {mesh} must hold axis sizes >= 1, and -1 (all remaining devices) at most once"),
    )

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    target: str
    drafter: dict  # DrafterConfig fields; completed from the target by `drafter_config`
    loss: LossWeights = LossWeights()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    run: RunConfig = RunConfig()

    __relations__ = (_named("target"),)

    def __post_init__(self):
        validate(self)
        try:  # every drafter setting given, before the target supplies the rest
            drafter = config_checks.check(DrafterConfig, self.drafter, partial=True, section="drafter")
        except ConfigError as e:
            raise e.within("drafter.") from None
        object.__setattr__(self, "drafter", drafter)

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
            target_hidden_size=target.hidden_size, target_num_layers=target.num_layers,
            target_embed_scale=target.embed_scale)
        for k, v in defaults.items():
            d.setdefault(k, v)
        try:
            return DrafterConfig(**d)
        except ConfigError as e:
            raise e.within("drafter.", f"drafter for target {target_name}") from None


def default_tap_layers(num_layers: int, m: int = 5) -> tuple[int, ...]:
    """m layer ids spread evenly from 1 to L-3 (DESIGN.md 2.1), DeepSpec's 0-based convention."""
    if num_layers < 4:
        return tuple(range(min(m, num_layers)))
    last = num_layers - 3
    return tuple(sorted({round(1 + i * (last - 1) / (m - 1)) for i in range(m)}))


_SECTIONS = {"loss": LossWeights, "data": DataConfig, "optim": OptimConfig, "run": RunConfig}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _yaml(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except Exception as e:  # YAML's scanner, parser and constructors (a date like 2024-13-01: ValueError)
        raise UserError(f"{what} is not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 3e-4): a dotted key, `=`, a YAML value."""
    key, sep, value = text.partition("=")
    if not sep or not _KEY.fullmatch(key.strip()):
        raise UserError(f"override {text!r} is not key=value with a dotted key (e.g. optim.lr=3e-4)")
    return key.strip().split("."), _yaml(value, f"override {text!r}")


def _from_yaml(cls, values: dict, texts: dict[str, str], prefix: str) -> dict:
    """YAML's readings fitted to the fields' types: a number or a date is text for a string field
    (an override's own text: out_dir=1.50 stays "1.50"), and YAML 1.1 reads "1e-3" as a string."""
    types_ = config_checks.hints(cls)
    out = {}
    for k, v in values.items():
        hint = types_.get(k)
        base = config_checks.unwrap_optional(hint) or hint
        if base is str and isinstance(v, (int, float, datetime.date)) and not isinstance(v, bool):
            v = texts.get(prefix + str(k), str(v)).strip()
        elif base is float and isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass  # left for the type check to name
        out[k] = v
    return out


def _section(name: str, raw: dict) -> dict:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(name, f"section {name} must be a mapping of settings, got {config_checks.show(value)}")
    return value


def _build(raw: dict, texts: dict[str, str]) -> TrainConfig:
    unknown = sorted(map(str, set(raw) - {"target", "drafter", *_SECTIONS}))
    if unknown:
        raise ConfigError(unknown[0], f"unknown section(s) {', '.join(unknown)} "
                                      f"(known: target, drafter, {', '.join(_SECTIONS)})")
    for name in ("target", "drafter"):
        if name not in raw:
            raise ConfigError(name, "a config needs a 'target' and a 'drafter' section")
    sections = {}
    for name, cls in _SECTIONS.items():
        values = _from_yaml(cls, _section(name, raw), texts, name + ".")
        try:
            sections[name] = cls(**config_checks.check(cls, values, section=name))
        except ConfigError as e:
            raise e.within(name + ".") from None
    top = _from_yaml(TrainConfig, {"target": raw["target"]}, texts, "")
    drafter = _from_yaml(DrafterConfig, _section("drafter", raw), texts, "drafter.")
    return TrainConfig(target=top["target"], drafter=drafter, **sections)


def load_config(path: str, overrides: list[str] = ()) -> TrainConfig:
    """The config in YAML file `path` with `key=value` overrides applied, every setting checked.

    A bad setting is a UserError naming the key and where it came from: the file or the override."""
    try:
        text = read_bytes(path).decode("utf-8")
    except FileNotFoundError:
        raise UserError(f"no such config file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read config file {path}: {e}") from None
    raw = _yaml(text, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path} must be a mapping of sections")
    texts: dict[str, str] = {}  # dotted key -> the override text that set it (its value's own text)
    sources: dict[str, str] = {}
    for override in overrides:
        keys, value = parse_override(override)
        node = raw
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise UserError(f"override {override!r}: {'.'.join(keys[:i + 1])} is not a section")
        node[keys[-1]] = value
        dotted = ".".join(keys)
        texts = {k: t for k, t in texts.items() if not (k + ".").startswith(dotted + ".")}  # replaced
        sources = {k: t for k, t in sources.items() if not (k + ".").startswith(dotted + ".")}
        texts[dotted], sources[dotted] = override.partition("=")[2], f"override {override!r}"
    try:
        return _build(raw, texts)
    except ConfigError as e:
        keys = (e.key, *e.related)
        source = path
        for dotted, where in sources.items():  # the last override that set (a part of) a named key
            if any(k == dotted or k.startswith(dotted + ".") or dotted.startswith(k + ".") for k in keys):
                source = where
        raise e.within(source=source) from None


def config_to_dict(cfg: TrainConfig) -> dict:
    return dataclasses.asdict(cfg)
