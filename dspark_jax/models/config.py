"""Decoder configuration: one frozen dataclass covers Llama (incl. SmolLM2, Llama 3), Qwen2, Qwen3."""

from __future__ import annotations

import dataclasses
import math
import numbers
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
        # Sizes come from files we do not trust: each must be a positive integer before anything
        # divides by it or allocates with it (the loaders then check them against the tensors).
        for name in _SIZE_FIELDS:
            positive_int(getattr(self, name), name, "model config")
        for name in ("rms_norm_eps", "rope_theta"):
            finite_float(getattr(self, name), name, "model config", positive=name == "rope_theta")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise UserError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)")

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


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "max_position_embeddings")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def positive_int(value: Any, what: str, source: str) -> int:
    """`value` as an int, or a one-line UserError naming `what` (JSON floats and bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise UserError(f"{source}: {what} must be a positive integer, got {_shown(value)}")
    return int(value)


def finite_float(value: Any, what: str, source: str, positive: bool = False) -> float:
    """`value` as a finite float (>= 0; > 0 with `positive`), or a one-line UserError naming `what`."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise UserError(f"{source}: {what} must be {kind} finite number, got {_shown(value)}")
    return float(value)


_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def config_from_hf(hf: dict[str, Any], dtype: str = "float32", source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config.json dict (transformers 4.x or 5.x spelling). Every claimed
    size is checked to be a positive integer here; whether the weights agree is the loader's check."""
    if not isinstance(hf, dict):
        raise UserError(f"{source}: expected a JSON object, got {type(hf).__name__}")
    archs = hf.get("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    model_type = hf.get("model_type")
    model_type = model_type if isinstance(model_type, str) else ""
    family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), None)
    if family is None:
        family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}.get(model_type)
    if family is None:
        raise UserError(f"unsupported architecture {archs or model_type!r} "
                        f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"unsupported activation {_shown(hf['hidden_act'])} (only silu)")

    def size(key: str, default: Any = None) -> int:
        value = hf.get(key)
        if value is None:
            if default is None:
                raise UserError(f"{source}: lacks {key}")
            return default
        return positive_int(value, key, source)

    def number(src: dict, key: str, default: Any = None, positive: bool = True) -> float:
        value = src.get(key, default)
        if value is None:
            raise UserError(f"{source}: lacks {key}")
        return finite_float(value, key, source, positive=positive)

    rope, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}  # transformers 5, 4
    if not isinstance(rope, dict) or not isinstance(legacy, dict):
        raise UserError(f"{source}: rope_parameters / rope_scaling must be JSON objects")
    rope_theta = number(rope, "rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = None
    if rope_type == "llama3":
        src = rope if rope.get("rope_type") == "llama3" else legacy
        original = src.get("original_max_position_embeddings")
        if original is None:
            raise UserError(f"{source}: lacks original_max_position_embeddings")
        scaling = RopeScaling(number(src, "factor"), number(src, "low_freq_factor"),
                              number(src, "high_freq_factor"),
                              positive_int(original, "original_max_position_embeddings", source))
    elif rope_type != "default":
        raise UserError(f"unsupported rope_type {_shown(rope_type)} (supported: default, llama3)")
    if hf.get("use_sliding_window"):
        raise UserError("sliding-window attention is not supported")
    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = size("num_key_value_heads", heads)
    if heads % kv_heads:
        raise UserError(f"{source}: num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {kv_heads}")
    if hf.get("head_dim") is None and hidden % heads:
        raise UserError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} "
                        "(and there is no head_dim)")
    return ModelConfig(
        family=family,
        vocab_size=size("vocab_size"),
        hidden_size=hidden,
        num_layers=size("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=size("head_dim", hidden // heads),
        intermediate_size=size("intermediate_size"),
        max_position_embeddings=size("max_position_embeddings", 4096),
        rms_norm_eps=number(hf, "rms_norm_eps", 1e-6, positive=False),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        dtype=dtype,
    )
