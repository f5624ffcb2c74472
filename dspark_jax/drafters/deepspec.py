"""Load drafters trained by the reference implementation, deepseek-ai/DeepSpec (DSpark and DFlash).

Using a released checkpoint
---------------------------
DeepSpec publishes its drafters as Hugging Face folders, e.g. `deepseek-ai/dspark_qwen3_8b_block7`:
a `config.json` (the target's Qwen3 config with the drafter's fields added) and `*.safetensors`
under DeepSpec's own parameter names. Download the drafter folder and the matching target (here
`Qwen/Qwen3-8B`) with any Hugging Face client, then:

    from dspark_jax.checkpoints.hf import load_hf_model
    from dspark_jax.drafters.deepspec import load_deepspec_drafter

    target_cfg, target_params = load_hf_model("path/to/Qwen3-8B")
    dcfg, dparams = load_deepspec_drafter("path/to/dspark_qwen3_8b_block7", target_name="Qwen3-8B",
                                          target_cfg=target_cfg, target_params=target_params)

`weights_path` may be the folder (its config.json is used unless `config_path` is given) or a single
.safetensors file (then `config_path` is required). Passing the target checks that the drafter
belongs to it (vocabulary, hidden size, layer count, tapped layers) and, with `target_params`, that
the drafter's copies of the embedding and LM head equal the target's. Our drafter never uses those
copies: it always runs the target's own frozen embedding and LM head.

Config keys (DeepSpec -> DrafterConfig)
---------------------------------------
    num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads, head_dim,
    intermediate_size, vocab_size, rms_norm_eps, rope_parameters / rope_theta / rope_scaling,
    max_position_embeddings               -> the draft layers' shape (read like a Qwen3 config)
    block_size                            -> block_size (gamma; slot 0 holds the anchor)
    mask_token_id                         -> mask_token_id
    target_layer_ids                      -> target_layer_ids (0-based; -1 = the embeddings)
    markov_rank                           -> markov_rank (0 = no sequential head: DFlash)
    markov_head_type  vanilla | rnn       -> head  markov | rnn   ("none" when markov_rank == 0)
    enable_confidence_head                -> confidence
    confidence_head_with_markov           -> confidence_with_markov
    num_target_layers, vocab_size, hidden_size -> target_num_layers, target_vocab_size,
                                             target_hidden_size (checked against the target)

Tensor names (DeepSpec -> ours): fc -> fc (transposed), hidden_norm, norm -> final_norm,
layers.N.{self_attn,mlp,*_layernorm}.* -> layers/* (the Hugging Face layer table without the
"model." prefix), markov_head.markov_w1 -> markov/w1, markov_head.markov_w2 -> markov/w2
(transposed), markov_head.joint_proj -> rnn/w (transposed), rnn/b, confidence_head.proj ->
confidence/w, confidence/b (their leading unit axis dropped). embed_tokens and lm_head are skipped.

Other drafter families
----------------------
Each DeepSpec family is a `DeepSpecFormat` in `FORMATS`, chosen by the architecture name in
config.json (`ARCHITECTURE_KINDS`). The Eagle3 format lives in `dspark_jax/drafters/eagle3.py`,
which should call `register_format("eagle3", DeepSpecFormat(...))` at import; this module imports
it on first use. `drafter_config_fields` and `LAYER_NAMES` are meant to be shared with it.

Writing (`save_deepspec_drafter`; from a drafter folder: `drafters.export.export_drafter`, CLI:
`python -m dspark_jax.export`)
-----------------------------------------------------------------------------------------
The writer inverts the same tables: every `names` entry (regex -> our path, transpose) is turned
back into the tensor name (`tensor_name`) and transposed back; `DeepSpecFormat.unit_axis` is the
one list of tensors stored with a leading unit axis (dropped on read by `prepare`, added on write by
`restore`); `target_copy` gives the embedding / LM head copies both for writing and for the
reader's check. config.json is the reference's: its drafter config starts from the target's config
(its own config.json for a Hugging Face folder, else a Qwen3 config filled from our ModelConfig),
plus the fields transformers writes into every saved config, the draft layers' shape
(`shared_config_json`, the inverse of `drafter_config_fields`) and the family's fields
(`DeepSpecFormat.config_to_json`). Before anything is written the config is read back with the
family's reader: a drafter field that does not survive (q/k-norm off, a scaled target embedding, a
draft vocabulary, ...) is one clear UserError; fields that do not change what the drafter computes
(STS temperatures, training-only settings, the target's name where the family has no key for it)
go to the side file `dspark_sts.json`. The folder appears atomically and is read back and
compared, tensor for tensor, before it does.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import shutil
import tempfile
from typing import Callable

import numpy as np

from dspark_jax.checkpoints.assemble import NameTable, assemble_params, decoder_claims, flatten
from dspark_jax.checkpoints.hf import (HF_KEYS, HF_NAMES, iter_safetensors, read_json, safetensors_files,
                                       stored_tensors)
from dspark_jax.drafters import dspark
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core.errors import UserError
from dspark_jax.core.files import local_only
from dspark_jax.models.config import ModelConfig, RopeScaling, config_from_hf

# The decoder-layer names of a DeepSpec drafter are Hugging Face's without the "model." prefix.
LAYER_NAMES: NameTable = [(pattern.removeprefix(r"model\."), path, transpose)
                          for pattern, path, transpose in HF_NAMES if path.startswith("layers/")]

DSPARK_NAMES: NameTable = LAYER_NAMES + [
    (r"fc\.weight", "fc", True),
    (r"hidden_norm\.weight", "hidden_norm", False),
    (r"norm\.weight", "final_norm", False),
    (r"markov_head\.markov_w1\.weight", "markov/w1", False),
    (r"markov_head\.markov_w2\.weight", "markov/w2", True),
    (r"markov_head\.joint_proj\.weight", "rnn/w", True),
    (r"markov_head\.joint_proj\.bias", "rnn/b", False),
    (r"confidence_head\.proj\.weight", "confidence/w", False),
    (r"confidence_head\.proj\.bias", "confidence/b", False),
]

# The drafter's copies of the target's frozen tensors (not drafter parameters).
TARGET_COPIES = {"embed_tokens.weight": "embed", "lm_head.weight": "lm_head"}

MARKOV_HEAD_TYPES = {"vanilla": "markov", "rnn": "rnn"}


@dataclasses.dataclass(frozen=True)
class DeepSpecFormat:
    """How one DeepSpec drafter family is read and written."""

    config_from_json: Callable[[dict, str], DrafterConfig]  # (config.json dict, source) -> config
    param_shapes: Callable[[DrafterConfig], dict]
    names: NameTable  # read as is, written inverted (`tensor_name`)
    architecture: str = ""  # the config.json "architectures" entry the reference writes
    # The family's own config.json fields (the inverse of config_from_json beyond the shared ones):
    # (config, training-only values such as num_anchors) -> {key: value}.
    config_to_json: Callable[[DrafterConfig, dict], dict] | None = None
    # DeepSpec names (regexes) of tensors stored with a leading unit axis that our parameter lacks.
    unit_axis: tuple[str, ...] = ()

    def _unit(self, name: str) -> bool:
        return any(re.fullmatch(pattern, name) for pattern in self.unit_axis)

    def prepare(self, name: str, array: np.ndarray) -> np.ndarray:
        """Reading: drop the unit axis (a wrong shape is left for the shape check to report)."""
        return array[0] if self._unit(name) and array.ndim >= 1 and array.shape[0] == 1 else array

    def restore(self, name: str, array: np.ndarray) -> np.ndarray:
        """Writing: the inverse of `prepare`."""
        return array[None] if self._unit(name) else array


FORMATS: dict[str, DeepSpecFormat] = {}
# Substring of config.json's architecture name -> format kind; modules for kinds not yet registered.
ARCHITECTURE_KINDS = {"DSpark": "dspark", "Eagle3": "eagle3"}
FORMAT_MODULES = {"eagle3": "dspark_jax.drafters.eagle3"}


def register_format(kind: str, fmt: DeepSpecFormat) -> None:
    FORMATS[kind] = fmt


def _require(hf: dict, key: str, source: str):
    if key not in hf:
        raise UserError(f"{source}: drafter config has no {key!r}")
    return hf[key]


def _int(value, key: str, source: str, minimum: int) -> int:
    """A config integer >= minimum, or a one-line UserError (JSON floats, strings and bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{source}: {key} must be an integer >= {minimum}, got {str(value)[:40]!r}")
    return value


def drafter_config_fields(hf: dict, source: str) -> dict:
    """DrafterConfig fields every DeepSpec family shares: the draft layers' shape (the config is the
    target's Qwen3 config with num_hidden_layers = draft layers), the taps and the target identity."""
    layers: ModelConfig = config_from_hf(hf, source=source)
    if layers.qkv_bias:
        raise UserError(f"{source}: drafters with attention bias are not supported")
    ids = _require(hf, "target_layer_ids", source)
    if not isinstance(ids, list):
        raise UserError(f"{source}: target_layer_ids must be a list of layer ids, got {str(ids)[:40]!r}")
    ids = tuple(_int(i, "target_layer_ids", source, -1) for i in ids)
    if not ids or any(i < -1 for i in ids) or list(ids) != sorted(set(ids)):
        raise UserError(f"{source}: target_layer_ids {list(ids)} must be strictly increasing ids >= -1")
    return dict(
        num_layers=layers.num_layers, hidden_size=layers.hidden_size, num_heads=layers.num_heads,
        num_kv_heads=layers.num_kv_heads, head_dim=layers.head_dim,
        intermediate_size=layers.intermediate_size, vocab_size=layers.vocab_size,
        rms_norm_eps=layers.rms_norm_eps, rope_theta=layers.rope_theta, rope_scaling=layers.rope_scaling,
        max_position_embeddings=layers.max_position_embeddings, qk_norm=layers.qk_norm,
        target_layer_ids=ids, target_name=str(hf.get("target_model_name_or_path", "")),
        target_vocab_size=layers.vocab_size, target_hidden_size=layers.hidden_size,
        target_num_layers=_int(_require(hf, "num_target_layers", source), "num_target_layers", source, 1))


def dspark_config_from_json(hf: dict, source: str) -> DrafterConfig:
    rank = _int(_require(hf, "markov_rank", source), "markov_rank", source, 0)
    head = "none"
    if rank > 0:
        head_type = str(_require(hf, "markov_head_type", source)).lower()
        if head_type not in MARKOV_HEAD_TYPES:
            raise UserError(f"{source}: unsupported markov_head_type {head_type!r} "
                            f"(supported: {', '.join(MARKOV_HEAD_TYPES)})")
        head = MARKOV_HEAD_TYPES[head_type]
    confidence = bool(_require(hf, "enable_confidence_head", source))
    with_markov = bool(hf.get("confidence_head_with_markov", False)) and confidence
    if with_markov and rank == 0:
        raise UserError(f"{source}: confidence_head_with_markov needs markov_rank > 0")
    return DrafterConfig(
        kind="dspark", **drafter_config_fields(hf, source),
        block_size=_int(_require(hf, "block_size", source), "block_size", source, 1),
        mask_token_id=_int(_require(hf, "mask_token_id", source), "mask_token_id", source, 0),
        head=head, markov_rank=rank, confidence=confidence, confidence_with_markov=with_markov)


# Training-only config keys the reference requires but our DrafterConfig does not hold, with the
# value written when the drafter's own training metadata does not give one (DeepSpec's recipes).
DEFAULT_NUM_ANCHORS = 512


def dspark_config_to_json(dcfg: DrafterConfig, training: dict) -> dict:
    """The DSpark / DFlash fields of config.json, as DeepSpec's build_draft_config writes them
    (confidence_head_with_markov only with the confidence head, markov_head_type only with r > 0)."""
    out = {"block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
           "num_anchors": int(training.get("num_anchors") or DEFAULT_NUM_ANCHORS),
           "enable_confidence_head": bool(dcfg.confidence)}
    if dcfg.confidence:
        out["confidence_head_with_markov"] = bool(dcfg.confidence_with_markov and dcfg.uses_markov_table)
    out["markov_rank"] = dcfg.markov_rank if dcfg.uses_markov_table else 0
    if dcfg.uses_markov_table:
        out["markov_head_type"] = next(t for t, head in MARKOV_HEAD_TYPES.items() if head == dcfg.head)
    return out


register_format("dspark", DeepSpecFormat(
    dspark_config_from_json, dspark.drafter_param_shapes, DSPARK_NAMES, architecture="Qwen3DSparkModel",
    config_to_json=dspark_config_to_json,
    # nn.Linear(input, 1): weight [1, input], bias [1] -> our vector w and scalar b.
    unit_axis=(r"confidence_head\.proj\.weight", r"confidence_head\.proj\.bias")))


def _format_for(hf: dict, source: str) -> tuple[str, DeepSpecFormat]:
    if not isinstance(hf, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    kind = next((k for a in archs for sub, k in ARCHITECTURE_KINDS.items() if sub in a), None)
    if kind is None:
        raise UserError(f"{source}: not a DeepSpec drafter (architectures {archs}; "
                        f"known: {', '.join(ARCHITECTURE_KINDS)})")
    if kind not in FORMATS and kind in FORMAT_MODULES:
        try:
            importlib.import_module(FORMAT_MODULES[kind])
        except ModuleNotFoundError as e:
            if e.name != FORMAT_MODULES[kind]:  # a real import error inside the module
                raise
    if kind not in FORMATS:
        raise UserError(f"{source}: {kind} drafters cannot be loaded yet")
    return kind, FORMATS[kind]


def target_copy(name: str, target_params: dict, target_cfg: ModelConfig) -> np.ndarray:
    """The target tensor behind DeepSpec's copy `name`, in DeepSpec's layout [V, d] (a tied LM head
    is the embedding table). `embed` / `lm_head` are the same in both layer layouts."""
    theirs = TARGET_COPIES[name]
    if theirs == "lm_head" and target_cfg.tie_word_embeddings:
        theirs = "embed"
    ours = np.asarray(target_params[theirs], np.float32)
    return ours.T if theirs == "lm_head" else ours


def _check_target_copy(name: str, array: np.ndarray, target_params: dict, target_cfg: ModelConfig, source: str):
    """The drafter's copy of the embedding / LM head must be the target's (DeepSpec layout [V, d])."""
    ours = target_copy(name, target_params, target_cfg)
    if ours.shape != array.shape or not np.allclose(array, ours, rtol=1e-2, atol=1e-3):
        raise UserError(f"{source}: the drafter's {name} differs from the target's: "
                        "this drafter was trained for a different target")


def load_deepspec_drafter(weights_path: str, config_path: str | None = None, target_name: str = "",
                          target_cfg: ModelConfig | None = None, target_params: dict | None = None,
                          dtype=np.float32) -> tuple[DrafterConfig, dict]:
    """Read a DeepSpec drafter (folder or .safetensors file + config.json) -> (DrafterConfig, params)."""
    if config_path is None:
        if not os.path.isdir(weights_path):
            raise UserError(f"{weights_path}: give the drafter's config.json (config_path)")
        config_path = os.path.join(weights_path, "config.json")
    if os.path.isdir(weights_path):
        files = safetensors_files(weights_path)
    elif os.path.isfile(weights_path):
        files = [weights_path]
    else:
        raise UserError(f"no such drafter checkpoint: {weights_path}")
    hf = read_json(config_path)
    kind, fmt = _format_for(hf, config_path)
    dcfg = fmt.config_from_json(hf, config_path)
    if target_name:
        dcfg = dcfg.replace(target_name=target_name)
    if target_cfg is not None:
        dcfg.check_target(target_cfg, target_name)

    def ignore(n: str) -> bool:
        return n.endswith("rotary_emb.inv_freq")

    # Headers first: the config's claimed shapes are checked against the files before any allocation.
    stored = stored_tensors(files, ignore)  # (the target copies' sizes are bounded by the file too)

    def tensors():
        for name, load in iter_safetensors(files):
            if name in TARGET_COPIES:
                if target_params is not None and target_cfg is not None:
                    _check_target_copy(name, load(), target_params, target_cfg, weights_path)
                continue
            yield name, load

    params = assemble_params(fmt.param_shapes(dcfg), tensors(), fmt.names, dtype=dtype, source=weights_path,
                             ignore=ignore, prepare=fmt.prepare,
                             stored=[t for t in stored if t.name not in TARGET_COPIES],
                             claims=decoder_claims(dcfg.layer_config(), os.path.basename(config_path), HF_KEYS))
    # C order: a transposed tensor would otherwise be a Fortran-order view, which safetensors' numpy
    # save_file (0.8) writes in memory order under the C shape, i.e. scrambled (save_drafter uses it).
    return dcfg, _contiguous(params)


def _contiguous(tree: dict) -> dict:
    return {k: _contiguous(v) if isinstance(v, dict) else np.asarray(v, order="C") for k, v in tree.items()}


# --------------------------------------------------------------------------------------------------
# Writing: the same tables, inverted

SIDE_FILE = "dspark_sts.json"  # what the layout has no field for (DeepSpec has no STS temperatures)
WEIGHTS_FILE = "model.safetensors"
EXPORT_DTYPES = ("bfloat16", "float32")

# Attributes every config transformers saves carries (its PretrainedConfig defaults). The reference's
# drafter configs have them; a target's own config.json, saved with only its differences, may not.
TRANSFORMERS_CONFIG_DEFAULTS = {
    "output_hidden_states": False, "return_dict": True, "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False, "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "problem_type": None, "_name_or_path": "",
    "output_attentions": False, "_attn_implementation": None,
}
# Qwen3Config's remaining fields with their defaults: the base of the drafter config for a target
# that has no config.json of its own (a GGUF file). The draft layers' shape is written over them.
QWEN3_CONFIG_DEFAULTS = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None,
    "pad_token_id": None, "hidden_act": "silu", "initializer_range": 0.02, "max_window_layers": 28,
    "model_type": "qwen3", "sliding_window": None, "use_cache": True, "use_sliding_window": False,
}

# Keys of a target's config.json that describe how the TARGET's weights load and must not pass to
# the drafter's copy: its quantisation (the drafter's weights are plain floats) and its remote code.
TARGET_ONLY_KEYS = ("quantization_config", "auto_map")

# Why a drafter field that does not survive the round trip through the reader cannot be written.
_INEXPRESSIBLE = {
    "qk_norm": "DeepSpec's draft layers are Qwen3 layers, which always have q/k RMSNorm (this drafter has none)",
    "target_embed_scale": "DeepSpec's Qwen3 drafters embed tokens unscaled; the target scales its embeddings "
                          "(Gemma-style), which the layout has no field for",
    "target_hidden_size": "a DeepSpec drafter is exactly as wide as its target (one hidden_size for both)",
    **dict.fromkeys(("target_vocab_size", "vocab_size", "draft_vocab_size", "draft_vocab"),
                    "a draft vocabulary smaller than the target's needs a draft-to-target token map (d2t), "
                    "which this export does not write yet"),
}


def tensor_name(pattern: str, layer: int | None = None) -> str:
    """The tensor name a name-table regex matches, its layer group set to `layer`: the writing
    direction of the same table. Only escaped literals and one (\\d+) layer group can be inverted."""
    parts = pattern.split(r"(\d+)")
    if len(parts) > 2 or (len(parts) == 2) != (layer is not None) or any(
            re.search(r"(?<!\\)[()\[\]{}*+?|^$]", part) for part in parts):
        raise ValueError(f"name-table entry {pattern!r} cannot be inverted (layer {layer})")
    name = str(layer).join(re.sub(r"\\(.)", r"\1", part) for part in parts)
    if re.fullmatch(pattern, name) is None:
        raise ValueError(f"name-table entry {pattern!r} cannot be inverted")
    return name


def shared_config_json(dcfg: DrafterConfig) -> dict:
    """The config.json fields every DeepSpec family shares (the inverse of `drafter_config_fields`):
    the draft layers' shape in Qwen3Config's spelling, the taps and the target's depth."""
    rope = {"rope_theta": float(dcfg.rope_theta), "rope_type": "default"}
    if dcfg.rope_scaling is not None:
        rope.update(rope_type="llama3", **dataclasses.asdict(dcfg.rope_scaling))
    return {
        "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
        "vocab_size": dcfg.vocab_size, "hidden_size": dcfg.hidden_size,
        "intermediate_size": dcfg.intermediate_size, "num_hidden_layers": dcfg.num_layers,
        "num_attention_heads": dcfg.num_heads, "num_key_value_heads": dcfg.num_kv_heads,
        "head_dim": dcfg.head_dim, "max_position_embeddings": dcfg.max_position_embeddings,
        "rms_norm_eps": dcfg.rms_norm_eps, "rope_parameters": rope, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * dcfg.num_layers, "num_target_layers": dcfg.target_num_layers,
        "target_layer_ids": list(dcfg.target_layer_ids),
    }


def target_config_base(target_cfg: ModelConfig, target_json: dict | None = None, tokenizer=None) -> dict:
    """The config the reference's drafter config starts from (DeepSpec deep-copies the target's):
    the target's own config.json when it has one, else a Qwen3 config of our ModelConfig with the
    tokenizer's special ids. Either way the target-only fields are what survives the overrides."""
    if target_json is not None:
        return {k: v for k, v in target_json.items() if k not in TARGET_ONLY_KEYS}
    base = dict(QWEN3_CONFIG_DEFAULTS, vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size,
                num_hidden_layers=target_cfg.num_layers)
    if tokenizer is not None:
        eos = list(tokenizer.eos_token_ids)
        base.update(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
    return base


def format_of(dcfg: DrafterConfig) -> DeepSpecFormat:
    kind = dcfg.kind
    if kind not in FORMATS and kind in FORMAT_MODULES:
        importlib.import_module(FORMAT_MODULES[kind])
    fmt = FORMATS.get(kind)
    if fmt is None or fmt.config_to_json is None:
        raise UserError(f"{kind} drafters cannot be written in the DeepSpec layout")
    return fmt


def deepspec_config_json(dcfg: DrafterConfig, base: dict | None = None, dtype: str = "float32",
                         training: dict | None = None) -> dict:
    """The drafter's config.json: `base` (`target_config_base`) + transformers' saved attributes +
    the shared fields + the family's fields."""
    fmt = format_of(dcfg)
    out = dict(base or {})
    for key, value in TRANSFORMERS_CONFIG_DEFAULTS.items():
        out.setdefault(key, value)
    out.update(shared_config_json(dcfg), architectures=[fmt.architecture], dtype=dtype)
    if "torch_dtype" in out:  # transformers 4 spelling in the target's file: keep the two in step
        out["torch_dtype"] = dtype
    rope = out["rope_parameters"]
    if "rope_theta" in out:  # the same for a transformers-4 RoPE spelling
        out["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" in out:
        out["rope_scaling"] = dict(rope) if rope["rope_type"] != "default" else None
    out.update(fmt.config_to_json(dcfg, training or {}))
    out.update(draft_vocab_config(dcfg))
    return {"architectures": out.pop("architectures"), **out}


def draft_vocab_config(dcfg: DrafterConfig) -> dict:
    """config.json fields of a draft vocabulary: none today. A drafter with one would add
    `draft_vocab_size` here and its `d2t` tensor in `draft_vocab_tensors` (vLLM's DSpark and Eagle3
    loaders read d2t as draft id -> target id offsets); `check_exportable` refuses it until then."""
    return {}


def draft_vocab_tensors(dcfg: DrafterConfig) -> dict:
    return {}


def check_exportable(dcfg: DrafterConfig, training: dict | None = None) -> dict:
    """Raise a one-line UserError if the layout cannot express what this drafter computes; else
    return the fields it cannot hold that do not change its outputs ({field: value}, for the side
    file). Works by writing the config and reading it back with the family's own reader."""
    fmt = format_of(dcfg)
    hf = deepspec_config_json(dcfg, training=training)
    try:
        back = fmt.config_from_json(hf, "exported config.json")
    except UserError as e:
        raise UserError(f"cannot export to the DeepSpec layout: {e}") from None
    ours, theirs = _meaning(dcfg), _meaning(back)
    lost = [k for k in ours if ours[k] != theirs[k]]
    if lost:
        why = [_INEXPRESSIBLE.get(k, f"{k}={ours[k]!r} has no field in the DeepSpec layout "
                                     f"(it would read back as {theirs[k]!r})") for k in lost]
        raise UserError("cannot export to the DeepSpec layout: " + "; ".join(dict.fromkeys(why)))
    return {f.name: _jsonable(getattr(dcfg, f.name)) for f in dataclasses.fields(dcfg)
            if getattr(dcfg, f.name) != getattr(back, f.name)}


# Fields a family never reads (they do not change what it computes), and training-only ones.
_UNUSED = {"dspark": ("ttt_steps", "ttt_decay", "ttt_at_anchors"),
           "eagle3": ("block_size", "mask_token_id", "head", "markov_rank", "confidence",
                      "confidence_with_markov", "ttt_at_anchors")}


def _meaning(dcfg: DrafterConfig) -> dict:
    """The fields that decide what the drafter computes, canonicalised: equal dicts, same drafter."""
    d = {f.name: getattr(dcfg, f.name) for f in dataclasses.fields(dcfg)}
    if dcfg.kind == "dspark":
        d["markov_rank"] = dcfg.markov_rank if dcfg.uses_markov_table else 0
        d["confidence_with_markov"] = bool(dcfg.confidence and dcfg.confidence_with_markov and dcfg.uses_markov_table)
    for name in _UNUSED.get(dcfg.kind, ()) + ("target_name",):
        d.pop(name)
    return d


def _jsonable(value):
    if isinstance(value, RopeScaling):
        return dataclasses.asdict(value)
    return list(value) if isinstance(value, tuple) else value


def deepspec_tensors(dcfg: DrafterConfig, params: dict, target_params: dict, target_cfg: ModelConfig) -> dict:
    """Every tensor of the DeepSpec checkpoint (float32 numpy, DeepSpec names and layout): the
    drafter's parameters through the inverted name table, then the target copies."""
    fmt = format_of(dcfg)
    flat = {k: np.asarray(v, np.float32) for k, v in flatten(params, "/").items()}
    want = {k: tuple(v) for k, v in flatten(fmt.param_shapes(dcfg), "/").items()}
    have = {k: v.shape for k, v in flat.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))[:3]
        raise UserError(f"drafter parameters do not match its config (first differences: {diff})")
    out, written = {}, set()
    for pattern, path, transpose in fmt.names:
        if path not in flat:
            continue  # a part this configuration does not have (e.g. the Markov head of DFlash)
        if path in written:
            raise ValueError(f"name table sets {path} twice: it cannot be inverted")
        written.add(path)
        stacked = path.startswith("layers/")
        for layer, array in (enumerate(flat[path]) if stacked else [(None, flat[path])]):
            name = tensor_name(pattern, layer)
            out[name] = np.asarray(fmt.restore(name, array.T if transpose else array), order="C")
    unnamed = sorted(set(flat) - written)
    if unnamed:
        raise UserError(f"the DeepSpec layout has no tensor for parameter(s) {', '.join(unnamed)}")
    out.update(draft_vocab_tensors(dcfg))
    for name in TARGET_COPIES:
        out[name] = np.asarray(target_copy(name, target_params, target_cfg), order="C")
    return out


def _write_folder(out_dir: str, overwrite: bool, fill: Callable[[str], None]) -> None:
    """Create `out_dir` atomically: `fill(tmp)` writes into a temporary sibling folder that is
    renamed into place only when complete (an existing empty folder is replaced in one rename; with
    `overwrite` an existing one is moved aside first, put back if the rename fails, removed after)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    old = moved = None
    published = False
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; an export is data to share
        if os.path.isdir(out_dir) and os.listdir(out_dir):
            if not overwrite:  # checked before, but another process may have written meanwhile
                raise UserError(f"--out {out_dir} is not empty (pass --overwrite to replace it)")
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            moved = os.path.join(old, "previous")
            os.replace(out_dir, moved)
        os.replace(tmp, out_dir)
        published = True
    except OSError as e:
        raise UserError(f"cannot write {out_dir}: {e.strerror or e}") from None
    finally:
        if not published and moved is not None and os.path.exists(moved) and not os.path.exists(out_dir):
            os.replace(moved, out_dir)  # the previous export stays as it was
        for leftover in (tmp, old):
            if leftover is not None and os.path.exists(leftover):
                shutil.rmtree(leftover, ignore_errors=True)


def check_out_dir(out_dir: str, overwrite: bool = False, source: str | None = None) -> None:
    """--out must be a new or empty folder (or any folder with `overwrite`), and not the source. It
    is local: the export is published by renaming a whole folder, which an object store cannot do."""
    local_only(out_dir, "--out")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not a folder")
    if source is not None and os.path.realpath(out_dir) == os.path.realpath(source):
        raise UserError(f"--out {out_dir} is the drafter folder itself; choose another folder")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise UserError(f"--out {out_dir} is not empty (pass --overwrite to replace it)")


def save_deepspec_drafter(out_dir: str, dcfg: DrafterConfig, params: dict, target_cfg: ModelConfig,
                          target_params: dict, *, target_json: dict | None = None, tokenizer=None,
                          dtype: str = "bfloat16", sts_temperatures=None, training: dict | None = None,
                          overwrite: bool = False, side: dict | None = None) -> dict:
    """Write a drafter in DeepSpec's layout: config.json, model.safetensors (its tensors + the
    target's embedding / LM head copies, `dtype`) and the side file. The folder is read back with
    `load_deepspec_drafter` and compared with what was meant before it is renamed into place.

    target_json: the target's own config.json (a Hugging Face folder), else one is made from
    target_cfg (+ tokenizer's special ids); training: training-only values the reference requires
    ({"num_anchors": N}); side: extra entries for the side file. Returns a summary dict.
    """
    from safetensors.numpy import save_file
    import ml_dtypes

    if dtype not in EXPORT_DTYPES:
        raise UserError(f"unsupported export dtype {dtype!r} (one of {', '.join(EXPORT_DTYPES)})")
    check_out_dir(out_dir, overwrite)
    dcfg.check_target(target_cfg)
    outside = check_exportable(dcfg, training)
    hf = deepspec_config_json(dcfg, target_config_base(target_cfg, target_json, tokenizer), dtype, training)
    store = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    tensors = {k: v.astype(store) for k, v in deepspec_tensors(dcfg, params, target_params, target_cfg).items()}
    side_file = {"sts_temperatures": None if sts_temperatures is None else [float(t) for t in sts_temperatures],
                 "block_size": dcfg.block_size, "outside_layout": outside, **(side or {})}

    def fill(folder: str) -> None:
        weights = os.path.join(folder, WEIGHTS_FILE)
        save_file(tensors, weights, metadata={"format": "pt"})
        for name, content in (("config.json", hf), (SIDE_FILE, side_file)):
            with open(os.path.join(folder, name), "w") as f:
                json.dump(content, f, indent=2)
                f.write("\n")
        for name in os.listdir(folder):
            os.chmod(os.path.join(folder, name), 0o644)
        _verify(folder, dcfg, params, store, target_cfg, target_params)

    _write_folder(out_dir, overwrite, fill)
    return {"out": os.path.abspath(out_dir), "architecture": hf["architectures"][0], "dtype": dtype,
            "tensors": len(tensors), "bytes": int(sum(t.nbytes for t in tensors.values())),
            "files": ["config.json", WEIGHTS_FILE, SIDE_FILE], "outside_layout": outside}


def _verify(folder: str, dcfg: DrafterConfig, params: dict, store, target_cfg: ModelConfig, target_params: dict) -> None:
    """Read the written folder back with the reader: the same config meaning and every parameter
    equal to the drafter's own (rounded to the storage dtype), or the export is not published."""
    back_cfg, back = load_deepspec_drafter(folder, target_cfg=target_cfg, target_params=target_params)
    if _meaning(back_cfg) != _meaning(dcfg):
        raise RuntimeError("the exported config reads back differently (a writer bug)")
    back = flatten(back, "/")
    for path, value in flatten(params, "/").items():
        meant = np.asarray(value, np.float32).astype(store).astype(np.float32)
        if path not in back or not np.array_equal(back[path], meant):
            raise RuntimeError(f"exported parameter {path} reads back differently (a writer bug)")


def read_side_file(folder: str) -> dict | None:
    """The side file of an exported folder (STS temperatures, fields outside the layout), or None."""
    path = os.path.join(folder, SIDE_FILE)
    if not os.path.exists(path):
        return None
    side = read_json(path)
    if not isinstance(side, dict):
        raise UserError(f"{path}: expected a JSON object")
    return side
