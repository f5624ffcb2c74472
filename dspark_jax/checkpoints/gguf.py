"""GGUF files (llama.cpp): metadata -> ModelConfig, dequantised tensors -> params, + the tokenizer.

Three things differ from a Hugging Face checkpoint:

* GGUF lists dimensions fastest-first; `read_gguf` reverses them, so a linear weight
  comes out [out, in] like in PyTorch and is transposed to our [in, out] layout.
* llama.cpp's converter permutes the rows of attn_q / attn_k for the "llama" architecture so
  that its interleaved-pair RoPE gives the same result as Hugging Face's half-split one. We undo
  it (`unpermute_rope_rows`); qwen2/qwen3 files are written with half-split ("NEOX") RoPE and are
  not permuted.
* Llama-3 RoPE scaling is not in the metadata: the converter bakes it into a `rope_freqs.weight`
  tensor of per-frequency divisors. We recover the `RopeScaling` that produces them, and check it.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quant_shape_to_byte_shape

from dspark_jax.checkpoints.assemble import NameTable, StoredTensor, assemble_params, check_stored, decoder_claims
from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig, RopeScaling, finite_float, gemma3_layer_types, positive_int
from dspark_jax.models.decoder import param_shapes
from dspark_jax.checkpoints.tokenizer import Tokenizer

# Storage types we dequantise (the common llama.cpp quantisations; all numpy-backed in gguf.quants).
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})

# general.architecture -> our model family; only "llama" files have permuted q/k rows.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

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
# Gemma 3: ffn_norm is the MLP's pre-norm, as above; the two post-norms have their own names.
# llama.cpp's converter already stores Gemma's norm weights as 1 + w, our scale.
GEMMA3_GGUF_NAMES: NameTable = GGUF_NAMES + [
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers/attn_post_norm", False),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "layers/mlp_post_norm", False),
]

_ROPE_FREQS = "rope_freqs.weight"


# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_TYPE_SIZES = {int(k): v for k, v in GGML_QUANT_SIZES.items()}  # tensor type -> (block, bytes per block)
# Metadata arrays become Python lists: cap their elements far above any real model (vocabulary,
# merges and scores together are ~1M entries even for a 256k vocabulary).
_MAX_ARRAY_ELEMENTS = 1 << 22
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Tensor types stored as plain values (the others are quantised blocks, viewed as bytes).
_PLAIN_TYPES = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
                Q.I32: np.int32, Q.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Q
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions fastest-first): [out, in] for a linear weight
    data: np.ndarray  # a view of the file: the values, or for quantised types [..., bytes per row] of blocks


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]  # key -> plain Python value (str, int, float, bool, or a list of them)
    tensors: list[GGUFTensor]


def read_gguf(path: str) -> GGUFFile:
    """Parse a GGUF file's header (metadata and tensor infos) with every count and length checked
    against the file's size before it is used, so a lying length allocates nothing and a truncated
    tensor is refused here, not when read. Tensor data stay in the file (memory-mapped views).

    Our own reader, not gguf-py's `GGUFReader`: that one makes a numpy view per metadata array
    element, 25 s for Gemma 3's 262k-token vocabulary (its tokens, scores and types) where this
    takes well under a second."""
    size = os.path.getsize(path)

    def corrupt(why: str) -> UserError:
        return UserError(f"corrupt GGUF file {path}: {why}")

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 4
        order = "<"

        def take(fmt: str, what: str):
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise corrupt(f"the file ends at byte {size} inside {what} (truncated file?)")
            (value,) = struct.unpack_from(order + fmt, buf, pos)
            pos += n
            return value

        def skip(n: int, what: str) -> int:
            nonlocal pos
            if n > size - pos:
                raise corrupt(f"{what} claims {n} bytes but only {size - pos} remain (truncated file?)")
            pos += n
            return pos - n

        def string(what: str) -> str:
            n = take("Q", what)
            start = skip(n, what)
            try:
                return buf[start:pos].decode("utf-8")
            except UnicodeDecodeError:
                raise corrupt(f"{what} is not UTF-8 text") from None

        elements = 0

        def value(vtype: int, what: str, depth: int = 0):
            nonlocal elements
            if vtype in _SCALARS:
                return take(_SCALARS[vtype], what)
            if vtype == _STRING:
                return string(what)
            if vtype == _ARRAY and depth < 2:
                itype, count = take("I", what), take("Q", what)
                elements += count
                if elements > _MAX_ARRAY_ELEMENTS:
                    raise corrupt(f"{what} claims {count} array elements (more than any model has)")
                if itype in _SCALARS:  # numbers: one read of the whole array
                    dtype = np.dtype(order + _SCALARS[itype])
                    start = skip(count * dtype.itemsize, what)
                    return np.frombuffer(buf, dtype, count, start).tolist()
                return [value(itype, what, depth + 1) for _ in range(count)]
            raise corrupt(f"{what} has unknown value type {vtype}")

        version = struct.unpack_from("<I", buf, 4)[0] if size >= 8 else 0
        if size >= 8 and version & 0xFFFF == 0:  # a big-endian file
            order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        take("I", "the version")
        if version not in (2, 3):
            raise corrupt(f"unsupported GGUF version {version} (supported: 2, 3)")
        tensor_count, kv_count = take("Q", "the tensor count"), take("Q", "the metadata count")
        if kv_count > (size - pos) // 13 or tensor_count > (size - pos) // 28:  # their smallest entries
            raise corrupt(f"it claims {kv_count} metadata entries and {tensor_count} tensors, "
                          f"more than its {size} bytes can hold")
        metadata: dict[str, Any] = {}
        alignment = 32
        for i in range(kv_count):
            key = string(f"metadata entry {i}")
            what = f"metadata {key or i}"
            vtype = take("I", what)
            if key in metadata:
                raise corrupt(f"{what} appears twice")
            metadata[key] = value(vtype, what)
            if key == "general.alignment":
                alignment = metadata[key]
                if vtype != _UINT32 or alignment == 0 or alignment & (alignment - 1):
                    raise corrupt(f"general.alignment {alignment} is not a power of two (as a uint32)")
        infos = []
        for i in range(tensor_count):
            name = string(f"tensor info {i}") or str(i)
            n_dims = take("I", f"tensor {name}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise corrupt(f"tensor {name} claims {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
            dims = [take("Q", f"tensor {name}") for _ in range(n_dims)]
            ttype, offset = take("I", f"tensor {name}"), take("Q", f"tensor {name}")
            if ttype not in _TYPE_SIZES:
                raise corrupt(f"tensor {name} has unknown type {ttype}")
            infos.append((name, dims, ttype, offset))
        data_start = pos + (-pos) % alignment

    data = np.memmap(path, mode="r")
    tensors, names = [], set()
    for name, dims, ttype, offset in infos:
        block, block_bytes = _TYPE_SIZES[ttype]
        if dims[0] % block:
            raise corrupt(f"tensor {name}: {dims[0]} values per row do not fill {Q(ttype).name} blocks of {block}")
        start = data_start + offset
        end = start + math.prod(dims) // block * block_bytes
        shape = tuple(reversed(dims))
        if end > size:
            raise corrupt(f"tensor {name} of shape {list(shape)} ({Q(ttype).name}) ends at byte {end} but the "
                          f"file has {size} (truncated file?)")
        if name in names:
            raise corrupt(f"tensor {name} appears twice")
        names.add(name)
        qtype = Q(ttype)
        if qtype in _PLAIN_TYPES:
            view = data[start:end].view(np.dtype(_PLAIN_TYPES[qtype]).newbyteorder(order)).reshape(shape)
        else:
            view = data[start:end].reshape(quant_shape_to_byte_shape(shape, qtype))
        tensors.append(GGUFTensor(name, qtype, shape, view))
    return GGUFFile(path, metadata, tensors)


def open_gguf(path) -> GGUFFile:
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
    return read_gguf(path)


def gguf_metadata(gguf: GGUFFile) -> dict[str, Any]:
    """All key/value metadata as plain Python values (strings, numbers, lists)."""
    return gguf.metadata


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k row permutation: within each head it stores row pairs (i, i + d/2)
    interleaved as (2i, 2i + 1); put them back in half-split order. w: [n_heads * d, ...]."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer(file_or_path) -> Tokenizer:
    """The tokenizer described by a GGUF file's `tokenizer.*` metadata (a path or an open GGUFFile)."""
    gguf = open_gguf(file_or_path) if isinstance(file_or_path, (str, os.PathLike)) else file_or_path
    return Tokenizer.from_gguf_metadata(gguf_metadata(gguf), source=gguf.path)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], dtype: str = "float32",
                     source: str = "GGUF") -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; `tensors` maps name -> loader (for presence checks
    and rope_freqs)."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise UserError(f"{source}: unsupported GGUF architecture {str(arch)[:40]!r} "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise UserError(f"{source}: GGUF metadata lacks {arch}.{name}")
        return value

    def size(name: str, default=None) -> int:  # every claimed size: a positive integer
        return positive_int(key(name, default), f"{arch}.{name}", source)

    def number(name: str, default: float, positive: bool) -> float:
        return finite_float(key(name, default), f"{arch}.{name}", source, positive=positive)

    if key("expert_count", 0):
        raise UserError(f"{source}: mixture-of-experts GGUF models are not supported")
    hidden, heads = size("embedding_length"), size("attention.head_count")
    if meta.get(f"{arch}.attention.key_length") is None and hidden % heads:
        raise UserError(f"{source}: {arch}.embedding_length {hidden} is not a multiple of "
                        f"{arch}.attention.head_count {heads}")
    head_dim = size("attention.key_length", hidden // heads)
    if size("attention.value_length", head_dim) != head_dim:
        raise UserError(f"{source}: attention.value_length differs from key_length (not supported)")
    if size("rope.dimension_count", head_dim) != head_dim:
        raise UserError(f"{source}: partial rotary embeddings (rope.dimension_count="
                        f"{key('rope.dimension_count')}, head_dim={head_dim}) are not supported")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # some converters write one count per layer
        if len(set(map(repr, kv_heads))) != 1:
            raise UserError(f"{source}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    kv_heads = positive_int(kv_heads, f"{arch}.attention.head_count_kv", source)
    if heads % kv_heads:
        raise UserError(f"{source}: {arch}.attention.head_count {heads} is not a multiple of "
                        f"{arch}.attention.head_count_kv {kv_heads}")
    family = ARCHITECTURES[arch]
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type != "none" and not (family == "gemma3" and scaling_type == "linear"):
        raise UserError(f"{source}: unsupported RoPE scaling type {str(scaling_type)[:40]!r}")
    theta = number("rope.freq_base", 10000.0, positive=True)
    gemma = {}
    if family == "gemma3":
        layers = size("block_count")
        gemma = dict(
            post_norms=True, hidden_act="gelu_tanh", embed_scale=math.sqrt(hidden),
            sliding_window=size("attention.sliding_window"), layer_types=gemma3_layer_types(layers),
            rope_local_theta=10_000.0,  # llama.cpp's fixed base of the local layers
            rope_linear_factor=number("rope.scaling.factor", 1.0, positive=True) if scaling_type == "linear" else 1.0,
            # As llama.cpp: the 27B model (62 layers) scales queries by hidden / heads, the others by head_dim.
            query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim))
    scaling = None
    if _ROPE_FREQS in tensors:
        scaling = llama3_scaling_from_factors(
            np.asarray(tensors[_ROPE_FREQS](), np.float64).reshape(-1), theta, head_dim, source)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if isinstance(tokens, list) else 0)
    if not vocab:
        raise UserError(f"{source}: cannot tell the vocabulary size ({arch}.vocab_size and tokens missing)")
    return ModelConfig(
        **gemma,
        family=family,
        vocab_size=positive_int(vocab, f"{arch}.vocab_size", source),
        hidden_size=hidden,
        num_layers=size("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=size("feed_forward_length"),
        max_position_embeddings=size("context_length", 4096),
        rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6, positive=False),
        rope_theta=theta,
        rope_scaling=scaling,
        # llama.cpp writes output.weight only when the head is not the embedding matrix.
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=family in ("qwen3", "gemma3"),
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
    if factors.shape != ((head_dim + 1) // 2,):  # before sizing anything by the claimed head_dim
        raise UserError(f"{source}: {_ROPE_FREQS} has {factors.size} entries, expected {(head_dim + 1) // 2}")
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
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


def _tensor_loaders(gguf: GGUFFile, source: str) -> dict[str, Any]:
    """name -> function returning the dequantised float32 array in numpy ([out, in]) order."""
    return {t.name: (lambda t=t: _dequantize(t, source)) for t in gguf.tensors}


def _check_tensor_types(gguf: GGUFFile, source: str) -> None:
    for t in gguf.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UserError(f"{source}: tensor {t.name!r} uses unsupported GGUF type {t.tensor_type.name} "
                            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})")


def _dequantize(t, source: str) -> np.ndarray:
    try:
        w = dequantize(t.data, t.tensor_type)
    except (ValueError, NotImplementedError) as e:
        raise UserError(f"{source}: cannot decode tensor {t.name!r} ({t.tensor_type.name}): {e}") from None
    return np.asarray(w, np.float32).reshape(t.shape)


def _claims(cfg: ModelConfig, meta: dict[str, Any]) -> Any:
    arch = meta.get("general.architecture")
    keys = {"vocab": f"{arch}.vocab_size" if meta.get(f"{arch}.vocab_size") else "tokenizer.ggml.tokens count",
            "hidden": f"{arch}.embedding_length", "layers": f"{arch}.block_count",
            "heads": f"{arch}.attention.head_count", "kv_heads": f"{arch}.attention.head_count_kv",
            "ffn": f"{arch}.feed_forward_length",
            "head_dim": f"{arch}.attention.key_length" if meta.get(f"{arch}.attention.key_length")
            else "head_dim"}
    return decoder_claims(cfg, "its metadata", keys)


def load_gguf_model(path, dtype: str = "float32") -> tuple[ModelConfig, dict, Tokenizer]:
    """Config, float32 parameter pytree and tokenizer of a GGUF file (any supported quantisation
    is dequantised on load)."""
    source = os.fspath(path)
    gguf = open_gguf(path)
    meta = gguf_metadata(gguf)
    loaders = _tensor_loaders(gguf, source)
    cfg = config_from_gguf(meta, loaders, dtype=dtype, source=source)  # architecture first
    _check_tensor_types(gguf, source)  # fail before minutes of dequantising, not midway
    names = GEMMA3_GGUF_NAMES if cfg.family == "gemma3" else GGUF_NAMES
    # The metadata's claimed shapes against the tensor infos, before any allocation.
    check_stored(param_shapes(cfg), [StoredTensor(t.name, t.shape, source) for t in gguf.tensors],
                 names, source, ignore=lambda n: n == _ROPE_FREQS, claims=_claims(cfg, meta))
    tokenizer = Tokenizer.from_gguf_metadata(meta, source=source)
    if cfg.family == "llama":  # undo the converter's q/k row permutation (weights and biases)
        heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        for name, load in list(loaders.items()):
            kind = name.split(".")[2] if name.startswith("blk.") else None
            if kind in heads:
                loaders[name] = lambda load=load, n=heads[kind]: unpermute_rope_rows(load(), n)
    params = assemble_params(
        param_shapes(cfg), loaders.items(), names, dtype=np.float32, source=source,
        ignore=lambda n: n == _ROPE_FREQS)  # already folded into cfg.rope_scaling
    return cfg, params, tokenizer
