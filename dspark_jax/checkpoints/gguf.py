"""GGUF files (llama.cpp): metadata -> ModelConfig, dequantised tensors -> params, + the tokenizer.

Three things differ from a Hugging Face checkpoint:

* GGUF lists dimensions fastest-first; `GGUFReader` already reverses them, so a linear weight
  comes out [out, in] like in PyTorch and is transposed to our [in, out] layout.
* llama.cpp's converter permutes the rows of attn_q / attn_k for the "llama" architecture so
  that its interleaved-pair RoPE gives the same result as Hugging Face's half-split one. We undo
  it (`unpermute_rope_rows`); qwen2/qwen3 files are written with half-split ("NEOX") RoPE and are
  not permuted.
* Llama-3 RoPE scaling is not in the metadata: the converter bakes it into a `rope_freqs.weight`
  tensor of per-frequency divisors. We recover the `RopeScaling` that produces them, and check it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from dspark_jax.checkpoints.assemble import NameTable, assemble_params
from dspark_jax.errors import UserError
from dspark_jax.models.config import ModelConfig, RopeScaling
from dspark_jax.models.decoder import param_shapes
from dspark_jax.tokenizer import Tokenizer

# Storage types we dequantise (the common llama.cpp quantisations; all numpy-backed in gguf.quants).
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})

# general.architecture -> our model family; only "llama" files have permuted q/k rows.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

GGUF_NAMES: NameTable = [
    (r"token_embd\.weight", "embed", False),
    (r"output_norm\.weight", "final_norm", False),
    (r"output\.weight", "lm_head", True),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers/attn_norm", False),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers/mlp_norm", False),
    (r"blk\.(\d+)\.attn_q\.weight", "layers/wq", True),
    (r"blk\.(\d+)\.attn_k\.weight", "layers/wk", True),
    (r"blk\.(\d+)\.attn_v\.weight", "layers/wv", True),
    (r"blk\.(\d+)\.attn_output\.weight", "layers/wo", True),
    (r"blk\.(\d+)\.attn_q\.bias", "layers/bq", False),
    (r"blk\.(\d+)\.attn_k\.bias", "layers/bk", False),
    (r"blk\.(\d+)\.attn_v\.bias", "layers/bv", False),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "layers/q_norm", False),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "layers/k_norm", False),
    (r"blk\.(\d+)\.ffn_gate\.weight", "layers/w_gate", True),
    (r"blk\.(\d+)\.ffn_up\.weight", "layers/w_up", True),
    (r"blk\.(\d+)\.ffn_down\.weight", "layers/w_down", True),
]

_ROPE_FREQS = "rope_freqs.weight"


def open_gguf(path) -> GGUFReader:
    """Open a GGUF file, turning every way it can fail into a one-line UserError."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError(f"no such GGUF file: {path}")
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserError(f"{path} is not a GGUF file (bad magic bytes {magic!r})")
    try:
        return GGUFReader(path)
    # GGUFReader reports truncation and bad fields as whatever numpy raises on the way.
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, OSError) as e:
        raise UserError(f"corrupt GGUF file {path}: {type(e).__name__}: {e}") from None


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values (strings, numbers, lists)."""
    try:
        return {key: field.contents() for key, field in reader.fields.items()}
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise UserError(f"corrupt GGUF metadata in {reader.data.filename}: {e}") from None


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation: within each head it stores row pairs (i, i + d/2)
    interleaved as (2i, 2i + 1); put them back in half-split order. w: [n_heads * d, ...]."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], dtype: str = "float32",
                     source: str = "GGUF") -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; `tensors` maps name -> loader (for presence checks
    and rope_freqs)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UserError(f"{source}: unsupported GGUF architecture {arch!r} "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UserError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    if key("expert_count", 0):
        raise UserError(f"{source}: mixture-of-experts GGUF models are not supported")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise UserError(f"{source}: attention.value_length differs from key_length (not supported)")
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise UserError(f"{source}: partial rotary embeddings (rope.dimension_count="
                        f"{key('rope.dimension_count')}, head_dim={head_dim}) are not supported")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some converters write one count per layer
        if len(set(kv_heads)) != 1:
            raise UserError(f"{source}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none":
        raise UserError(f"{source}: unsupported RoPE scaling type {scaling_type!r}")
    theta = float(key("rope.freq_base", 10000.0))
    scaling = None
    if _ROPE_FREQS in tensors:
        scaling = llama3_scaling_from_factors(
            np.asarray(tensors[_ROPE_FREQS](), np.float64).reshape(-1), theta, head_dim, source)
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    if not vocab:
        raise UserError(f"{source}: cannot tell the vocabulary size ({arch}.vocab_size and tokens missing)")
    family = ARCHITECTURES[arch]
    return ModelConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        max_position_embeddings=int(key("context_length", 4096)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=family == "qwen3",
        qkv_bias=family == "qwen2" or "blk.0.attn_q.bias" in tensors,
        dtype=dtype,
    )


def llama3_scaling_from_factors(factors: np.ndarray, theta: float, head_dim: int,
                                source: str = "GGUF") -> RopeScaling | None:
    """The Llama-3 RopeScaling whose per-frequency divisors are `factors` (rope_freqs.weight).

    High frequencies keep divisor 1, low ones get `factor`, and in between the divisor is
    1 / ((1 - s) / factor + s) with the smoothing weight s = a / wavelength - b. Only the band
    edges (wavelengths orig / low and orig / high) are identifiable, so we report them with
    low_freq_factor = 1. The fit needs >= 2 in-between frequencies (true of every released
    Llama 3.x); the result is checked against the file.
    """
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv.shape:
        raise UserError(f"{source}: {_ROPE_FREQS} has {factors.size} entries, expected {inv.size}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    wavelen = 2 * np.pi / inv
    mid = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if mid.sum() < 2:
        raise UserError(f"{source}: cannot recover Llama-3 RoPE scaling from {_ROPE_FREQS}")
    # 1/f = (1 - s)/factor + s  =>  s = (1/f - 1/factor) / (1 - 1/factor)
    s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[mid], s, 1)
    # With low = 1: s = (orig / wavelen - 1) / (high - 1), so slope = orig / (high - 1) and
    # intercept = -1 / (high - 1).
    high = 1 - 1 / intercept
    orig = int(round(slope * (high - 1)))  # a context length; float32 factors blur the fit a little
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=float(high),
                          original_max_position_embeddings=orig)
    probe = ModelConfig(family="llama", vocab_size=1, hidden_size=head_dim, num_layers=1, num_heads=1,
                        num_kv_heads=1, head_dim=head_dim, intermediate_size=1, max_position_embeddings=1,
                        rope_theta=theta, rope_scaling=scaling)
    if not np.allclose(probe.rope_inv_freq(), inv / factors, rtol=1e-4, atol=0):
        raise UserError(f"{source}: {_ROPE_FREQS} does not follow Llama-3 RoPE scaling")
    return scaling


def _tensor_loaders(reader: GGUFReader, source: str) -> dict[str, Any]:
    """name -> function returning the dequantised float32 array in numpy ([out, in]) order."""
    return {t.name: (lambda t=t: _dequantize(t, source)) for t in reader.tensors}


def _check_tensor_types(reader: GGUFReader, source: str) -> None:
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UserError(f"{source}: tensor {t.name!r} uses unsupported GGUF type {t.tensor_type.name} "
                            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")


def _dequantize(t, source: str) -> np.ndarray:
    try:
        w = dequantize(t.data, t.tensor_type)
    except (ValueError, NotImplementedError) as e:
        raise UserError(f"{source}: cannot decode tensor {t.name!r} ({t.tensor_type.name}): {e}") from None
    return np.asarray(w, np.float32).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))


def load_gguf_model(path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer]:
    """Config, float32 parameter pytree and tokenizer of a GGUF file (any supported quantisation
    is dequantised on load)."""
    source = os.fspath(path)
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    loaders = _tensor_loaders(reader, source)
    cfg = config_from_gguf(meta, loaders, dtype=dtype, source=source)  # architecture first
    _check_tensor_types(reader, source)  # fail before minutes of dequantising, not midway
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=source)
    if cfg.family == "llama":  # undo the converter's q/k row permutation (weights and biases)
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        for name, load in list(loaders.items()):
            kind = name.split(".")[2] if name.startswith("blk.") else None
            if kind in heads:
                loaders[name] = lambda load=load, n=heads[kind]: unpermute_rope_rows(load(), n)
    params = assemble_params(
        param_shapes(cfg), loaders.items(), GGUF_NAMES, dtype=np.float32, source=source,
        ignore=lambda n: n == _ROPE_FREQS)  # already folded into cfg.rope_scaling
    return cfg, params, tokenizer
