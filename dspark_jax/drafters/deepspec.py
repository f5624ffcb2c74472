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
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Callable

import numpy as np

from dspark_jax.checkpoints.assemble import NameTable, assemble_params, decoder_claims
from dspark_jax.checkpoints.hf import (HF_KEYS, HF_NAMES, iter_safetensors, read_json, safetensors_files,
                                       stored_tensors)
from dspark_jax.drafters import dspark
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.errors import UserError
from dspark_jax.models.config import ModelConfig, config_from_hf

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
    """How one DeepSpec drafter family is read."""

    config_from_json: Callable[[dict, str], DrafterConfig]  # (config.json dict, source) -> config
    param_shapes: Callable[[DrafterConfig], dict]
    names: NameTable
    # Fix a tensor's layout before the shape check, e.g. drop a unit axis: (name, array) -> array.
    prepare: Callable[[str, np.ndarray], np.ndarray] = lambda name, array: array


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


def _squeeze_confidence(name: str, array: np.ndarray) -> np.ndarray:
    # nn.Linear(input, 1): weight [1, input], bias [1] -> our vector w and scalar b.
    if name.startswith("confidence_head.proj.") and array.ndim >= 1 and array.shape[0] == 1:
        return array[0]
    return array


register_format("dspark", DeepSpecFormat(dspark_config_from_json, dspark.drafter_param_shapes,
                                         DSPARK_NAMES, _squeeze_confidence))


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


def _check_target_copy(name: str, array: np.ndarray, target_params: dict, target_cfg: ModelConfig, source: str):
    """The drafter's copy of the embedding / LM head must be the target's (DeepSpec layout [V, d])."""
    theirs = TARGET_COPIES[name]
    if theirs == "lm_head" and target_cfg.tie_word_embeddings:
        theirs = "embed"
    ours = np.asarray(target_params[theirs], np.float32)
    if theirs == "lm_head":
        ours = ours.T
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
    return dcfg, params
