"""A target's shapes without its weights: what the plan and the compile checks need of it.

`target_model_config(spec)` reads a Hugging Face folder's config.json, a GGUF file's (or a known
name's) metadata, or, for a folder that is not there yet (configs/*_qwen3-8b.yaml point at
checkpoints/Qwen3-8B), the public config.json shapes in `serving.hardware.TARGETS` or
`PUBLIC_CONFIGS`, by folder name.
"""

from __future__ import annotations

import os

from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig

# Public config.json shapes of targets a shipped config names that `serving.hardware.TARGETS` (Qwen3
# and Llama shapes) cannot express, by folder name: Gemma 3 12B's language model
# (huggingface.co/google/gemma-3-12b-it config.json, text_config; the rest are transformers' defaults).
PUBLIC_CONFIGS = {
    "gemma-3-12b-it": {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": {
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}},
}


def target_model_config(spec: str) -> tuple[str, ModelConfig, str]:
    """(name, ModelConfig, where the shapes came from) of a --target spec, reading no weights."""
    from dspark_jax.checkpoints import registry

    config_json = os.path.join(spec, "config.json")
    if os.path.isdir(spec) and os.path.exists(config_json):
        from dspark_jax.checkpoints.hf import read_json
        from dspark_jax.models.config import config_from_hf

        return os.path.basename(os.path.normpath(spec)), config_from_hf(read_json(config_json), source=config_json), config_json
    if spec in registry.KNOWN_TARGETS or (os.path.isfile(spec) and spec.endswith(".gguf")):
        from dspark_jax.checkpoints import gguf

        name, path = registry.resolve_target_path(spec)
        reader = gguf.open_gguf(path)
        loaders = gguf._tensor_loaders(reader, path)  # lazy: only rope_freqs (Llama 3) is ever read
        return name, gguf.config_from_gguf(gguf.gguf_metadata(reader), loaders, source=path), f"{path} (GGUF metadata)"
    from dspark_jax.serving.hardware import TARGETS

    key = os.path.basename(os.path.normpath(spec)).lower()
    if key in TARGETS:
        t = TARGETS[key]
        family = "qwen3" if key.startswith("qwen3") else "llama"
        cfg = ModelConfig(family=family, vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=t.num_layers,
                          num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim,
                          intermediate_size=t.intermediate_size, max_position_embeddings=40960 if family == "qwen3" else 8192,
                          rms_norm_eps=1e-6 if family == "qwen3" else 1e-5,
                          rope_theta=1_000_000.0 if family == "qwen3" else 100000.0,
                          tie_word_embeddings=t.tie_word_embeddings, qk_norm=family == "qwen3")
        return os.path.basename(os.path.normpath(spec)), cfg, f"the {t.name} shapes of {t.source} (serving.hardware.TARGETS)"
    if key in PUBLIC_CONFIGS:
        from dspark_jax.models.config import config_from_hf

        source = f"the public config.json shapes of {key} (serving.target_shapes.PUBLIC_CONFIGS)"
        return os.path.basename(os.path.normpath(spec)), config_from_hf(PUBLIC_CONFIGS[key], source=source), source
    raise UserError(f"cannot read the shapes of target {spec!r}: no config.json there and no known shapes for "
                    f"{key!r}; give a Hugging Face config.json (only that file is needed)")
