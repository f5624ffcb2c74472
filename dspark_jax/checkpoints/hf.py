"""Hugging Face checkpoint folders: config.json + *.safetensors (single or sharded) + tokenizer."""

from __future__ import annotations

import json
import math
import os

import numpy as np

from dspark_jax.checkpoints.assemble import NameTable, StoredTensor, assemble_params, decoder_claims
from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig, config_from_hf
from dspark_jax.models.decoder import param_shapes

HF_NAMES: NameTable = [
    (r"model\.embed_tokens\.weight", "embed", False),
    (r"model\.norm\.weight", "final_norm", False),
    (r"lm_head\.weight", "lm_head", True),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers/attn_norm", False),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers/mlp_norm", False),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers/wq", True),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers/wk", True),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers/wv", True),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers/wo", True),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", "layers/bq", False),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", "layers/bk", False),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", "layers/bv", False),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers/q_norm", False),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers/k_norm", False),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers/w_gate", True),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers/w_up", True),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers/w_down", True),
]

# Gemma 3 has four norms a layer: its post_attention_layernorm normalises the attention output (our
# attn_post_norm), and the MLP has a pre (our mlp_norm) and a post norm. Multimodal checkpoints keep
# the language model under model.language_model. (transformers 5) or language_model.model. (4.x).
_GEMMA3_NORMS = {"post_attention_layernorm": "layers/attn_post_norm", "pre_feedforward_layernorm": "layers/mlp_norm",
                 "post_feedforward_layernorm": "layers/mlp_post_norm"}
GEMMA3_HF_NAMES: NameTable = [
    (pattern.replace(r"model\.", r"(?:model\.language_model\.|language_model\.model\.|model\.)", 1)
     .replace(r"lm_head", r"(?:language_model\.)?lm_head"), path, transpose)
    for pattern, path, transpose in HF_NAMES if path != "layers/mlp_norm"
] + [(rf"(?:model\.language_model\.|language_model\.model\.|model\.)layers\.(\d+)\.{name}\.weight", path, False)
     for name, path in _GEMMA3_NORMS.items()]
_MULTIMODAL_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def fold_norm_offsets(params: dict) -> dict:
    """Gemma's RMSNorm scales by (1 + w): store 1 + w, the scale itself, so one rms_norm serves
    every family (numpy, in place of each norm weight)."""
    return {k: fold_norm_offsets(v) if isinstance(v, dict) else (v + 1 if "norm" in k else v) for k, v in params.items()}


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"missing file {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt JSON in {path}: {e}") from None


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserError(f"{index}: expected a weight_map of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        if not shards:
            raise UserError(f"{index} lists no weight files")
        files = [os.path.join(folder, s) for s in shards]
    else:
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in {folder}")
    for f in files:
        if not os.path.exists(f):
            raise UserError(f"missing weight file {f}")
    return files


# Bytes per element of every safetensors dtype we can size; the weights we load must be a float one.
SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                        "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header


def safetensors_header(path: str, what: str = "safetensors file") -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a .safetensors file's header alone (8-byte length + JSON), with
    every tensor's byte range checked against its shape and the file's size; one-line UserErrors
    ("corrupt <what> <path>: ...")."""
    def corrupt(why: str) -> UserError:
        return UserError(f"corrupt {what} {path}: {why}")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise corrupt(f"{size} bytes, too short for a header")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise corrupt(f"the header claims {n} bytes but the file has {size - 8} after the length "
                              "(truncated file?)")
            if n > _MAX_HEADER:
                raise corrupt(f"a {n}-byte header is beyond the format's limit")
            raw = f.read(n)
    except FileNotFoundError:
        raise UserError(f"missing file {path}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise corrupt(f"the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise corrupt(f"tensor {name!r} has no dtype/shape/data_offsets entry")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
            raise corrupt(f"tensor {name!r} has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise corrupt(f"tensor {name!r} has an invalid shape {str(shape)[:40]}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise corrupt(f"tensor {name!r} has invalid data_offsets {str(offsets)[:40]}")
        nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]
        if offsets[1] - offsets[0] != nbytes:
            raise corrupt(f"tensor {name!r} of shape {shape} ({dtype}) needs {nbytes} bytes, "
                          f"its data_offsets span {offsets[1] - offsets[0]}")
        if offsets[1] > data_size:
            raise corrupt(f"tensor {name!r} ends at byte {offsets[1]} of the data but the file holds "
                          f"{data_size} (truncated file?)")
        out[name] = (dtype, tuple(shape))
    return out


def stored_tensors(files: list[str], ignore=lambda name: False) -> list[StoredTensor]:
    """The header shapes of every tensor in `files` (nothing loaded); the tensors we would load
    (all but `ignore`d ones) must be floating point."""
    out = []
    for path in files:
        for name, (dtype, shape) in safetensors_header(path).items():
            if dtype not in FLOAT_DTYPES and not ignore(name):
                raise UserError(f"{path}: tensor {name!r} has dtype {dtype}, expected a float type "
                                f"({', '.join(sorted(FLOAT_DTYPES))})")
            out.append(StoredTensor(name, shape, path))
    return out


def iter_safetensors(files: list[str]):
    """Yield (name, loader) for every tensor; loaders read lazily so memory stays one tensor."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        try:
            handle = safe_open(path, framework="numpy")
            names = list(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"corrupt safetensors file {path}: {e}") from None
        for name in names:
            yield name, (lambda h=handle, n=name: _get_tensor(h, n, path))


def _get_tensor(handle, name: str, path: str) -> np.ndarray:
    try:
        return handle.get_tensor(name).astype(np.float32)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a corrupt file to the user
        raise UserError(f"corrupt tensor {name!r} in {path}: {e}") from None


# The config.json keys behind each axis, for error messages (`assemble.decoder_claims`).
HF_KEYS = {"vocab": "vocab_size", "hidden": "hidden_size", "layers": "num_hidden_layers",
           "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "ffn": "intermediate_size"}


def load_hf_model(folder: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    if not os.path.isdir(folder):
        raise UserError(f"no such checkpoint folder: {folder}")
    cfg = config_from_hf(read_json(os.path.join(folder, "config.json")), dtype=dtype)
    tied = cfg.tie_word_embeddings

    gemma = cfg.family == "gemma3"

    def ignore(n: str) -> bool:  # tied checkpoints may still carry a copy of the head; rotary caches are not weights
        return ((tied and n.endswith("lm_head.weight")) or n.endswith("rotary_emb.inv_freq")
                or (gemma and n.startswith(_MULTIMODAL_PARTS)))

    files = safetensors_files(folder)
    # Headers first: every claimed shape is checked against the file before anything is allocated.
    params = assemble_params(
        param_shapes(cfg), iter_safetensors(files), GEMMA3_HF_NAMES if gemma else HF_NAMES, dtype=np.float32,
        source=folder, ignore=ignore, stored=stored_tensors(files, ignore), claims=decoder_claims(cfg, "config.json", HF_KEYS))
    return cfg, fold_norm_offsets(params) if gemma else params
