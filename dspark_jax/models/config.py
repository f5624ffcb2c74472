"""Decoder configuration: one frozen dataclass covers Llama (incl. SmolLM2, Llama 3), Qwen2, Qwen3."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from dspark_jax.core.errors import UserError

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")


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
    # Gemma 3 (all off for the other families). RMSNorm weights are stored as the scale itself:
    # the loaders fold Gemma's (1 + w) into w, so one rms_norm serves every family.
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs too: four norms per layer
    hidden_act: str = "silu"  # gated MLP activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    query_pre_attn_scalar: float = 0.0  # attention scores scale by this ** -0.5; 0 = head_dim
    sliding_window: int = 0  # local layers see keys in (t - window, t]; 0 = no local layers
    layer_types: tuple[str, ...] = ()  # "full" | "sliding" per layer; () = all full
    rope_local_theta: float = 10000.0  # RoPE base of the sliding-window layers
    rope_linear_factor: float = 1.0  # linear position interpolation on the full layers (Gemma 3 4B+)
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
        if self.hidden_act not in HIDDEN_ACTS:
            raise UserError(f"unsupported activation {self.hidden_act!r} (supported: {', '.join(HIDDEN_ACTS)})")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise UserError(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}")
        if "sliding" in self.layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise UserError(f"sliding-window layers need a positive sliding_window, got {self.sliding_window!r}")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend within the sliding window only?"""
        return tuple(t == "sliding" for t in self.layer_types) or (False,) * self.num_layers

    @property
    def local_rope(self) -> bool:
        """Do the sliding-window layers rotate with their own RoPE table?"""
        return any(self.sliding_layers) and (self.rope_local_theta != self.rope_theta or self.rope_linear_factor != 1
                                             or self.rope_scaling is not None)

    def rope_inv_freq(self, local: bool = False) -> np.ndarray:
        """Inverse RoPE frequencies [head_dim // 2] (float64 math, like the reference); `local`:
        those of the sliding-window layers (their own base, no scaling)."""
        d = self.head_dim
        exponents = np.arange(0, d, 2, dtype=np.float64) / d
        if local:
            return (1.0 / self.rope_local_theta ** exponents).astype(np.float32)
        inv = 1.0 / (self.rope_theta ** exponents) / self.rope_linear_factor
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
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3"}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama",
                "gemma3_text": "gemma3", "gemma3": "gemma3"}
# Activation names of the gated MLP, as configs spell them.
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
        family = _MODEL_TYPES.get(model_type)
    if family is None:
        raise UserError(f"unsupported architecture {archs or model_type!r} "
                        f"(supported: {', '.join(sorted(_ARCHITECTURES))})")
    if family == "gemma3" and isinstance(hf.get("text_config"), dict):  # multimodal: its language model
        return config_from_hf({"model_type": "gemma3_text", **hf["text_config"]}, dtype, f"{source} text_config")
    if family == "gemma3":  # released multimodal configs leave out what equals transformers' defaults
        hf = {**_GEMMA3_TEXT_DEFAULTS, **hf}
    act_key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    act = _ACTIVATIONS.get(hf.get(act_key, "gelu_pytorch_tanh" if family == "gemma3" else "silu"))
    if act is None or (act == "gelu_tanh") != (family == "gemma3"):
        raise UserError(f"unsupported activation {_shown(hf[act_key])} for {family}")

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
    gemma = {}
    if family == "gemma3":
        gemma = _gemma3_fields(hf, rope, legacy, size, number, source)
        rope, legacy = gemma.pop("rope_full"), {}
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
        **gemma,
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
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
        qk_norm=family in ("qwen3", "gemma3"),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
        dtype=dtype,
    )


# transformers' Gemma3TextConfig defaults (the Gemma 3 4B shape), which released checkpoints rely on.
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    tie_word_embeddings=True)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's default interleaving: every `pattern`-th layer global, the others local."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


def _gemma3_fields(hf: dict, rope: dict, legacy: dict, size, number, source: str) -> dict:
    """The Gemma 3 settings of a config.json (transformers 4.x or 5.x spelling). Returns the
    ModelConfig fields and, under "rope_full", the full layers' RoPE parameters (a dict in the
    shape the generic parser reads)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UserError(f"{source}: {key} is not supported (Gemma 3 has none)")
    if hf.get("use_bidirectional_attention"):
        raise UserError(f"{source}: bidirectional attention is not supported")
    layers = size("num_hidden_layers")
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if hf.get("layer_types") is not None:
        types = hf["layer_types"]
        if not isinstance(types, list) or len(types) != layers or any(t not in names for t in types):
            raise UserError(f"{source}: layer_types must list {layers} of sliding_attention / full_attention")
        layer_types = tuple(names[t] for t in types)
    else:
        layer_types = gemma3_layer_types(layers, size("sliding_window_pattern", 6))
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: per layer type
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    else:  # 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq for the local
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **legacy}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise UserError(f"{source}: rope parameters must be JSON objects")
    factor = 1.0
    if (full.get("rope_type") or full.get("type")) == "linear":
        factor = number(full, "factor")
        full = {k: v for k, v in full.items() if k not in ("rope_type", "type", "factor")}
    if (local.get("rope_type") or "default") != "default":
        raise UserError(f"{source}: RoPE scaling on the sliding-window layers is not supported")
    hidden = size("hidden_size")
    return dict(post_norms=True, hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden),
                query_pre_attn_scalar=number(hf, "query_pre_attn_scalar", 256),
                sliding_window=size("sliding_window"), layer_types=layer_types,
                rope_local_theta=number(local, "rope_theta", 10_000.0), rope_linear_factor=factor,
                rope_full=full)
