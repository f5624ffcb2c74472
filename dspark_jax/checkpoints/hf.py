"""Hugging Face checkpoint folders: config.json + *.safetensors (single or sharded) + tokenizer."""

from __future__ import annotations

import json
import os

import numpy as np

from dspark_jax.checkpoints.assemble import NameTable, assemble_params
from dspark_jax.errors import UserError
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
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
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


def load_hf_model(folder: str, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    if not os.path.isdir(folder):
        raise UserError(f"no such checkpoint folder: {folder}")
    cfg = config_from_hf(read_json(os.path.join(folder, "config.json")), dtype=dtype)
    tied = cfg.tie_word_embeddings
    params = assemble_params(
        param_shapes(cfg), iter_safetensors(safetensors_files(folder)), HF_NAMES,
        dtype=np.float32, source=folder,
        # Tied checkpoints may still carry a copy of the head; rotary caches are not weights.
        ignore=lambda n: (tied and n == "lm_head.weight") or n.endswith("rotary_emb.inv_freq"))
    return cfg, params
