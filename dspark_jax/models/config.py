"""Decoder configuration: one frozen dataclass covers Llama (incl. SmolLM2, Llama 3), Qwen2, Qwen3."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dspark_jax.errors import UserError

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3": decides only the flags below, never a code path
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qkv_bias: bool = False  # Qwen2: bias on the q/k/v projections
    dtype: str = "float32"  # compute and parameter dtype

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise UserError(f"unsupported model family {self.family!r} (supported: {', '.join(FAMILIES)})")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies [head_dim // 2] (float64 math, like the reference)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        s = self.rope_scaling
        if s is None:
            return inv.astype(np.float32)
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def config_from_hf(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Translate a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""
    archs = hf.get("architectures") or []
    family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if family is None:
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}.get(
            hf.get("model_type", ""))
    if family is None:
        raise UserError(f"unsupported architecture {archs or hf.get('model_type')!r} "
                        f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported activation {hf['hidden_act']!r} (only silu)")
    rope = dict(hf.get("rope_parameters") or {})  # transformers 5
    legacy = hf.get("rope_scaling") or {}  # transformers 4
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = None
    if rope_type == "llama3":
        src = rope if rope.get("rope_type") == "llama3" else legacy
        scaling = RopeScaling(float(src["factor"]), float(src["low_freq_factor"]),
                              float(src["high_freq_factor"]), int(src["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise UserError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
    if hf.get("use_sliding_window"):
        raise UserError("sliding-window attention is not supported")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        dtype=dtype,
    )
