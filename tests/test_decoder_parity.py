"""Our decoder against transformers on tiny random Llama / Llama 3 / Qwen2 / Qwen3 checkpoints."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax.checkpoints.hf import load_hf_model
from dspark_jax.models import decoder


def full_forward_logits(params, cfg, tokens):
    cache = decoder.init_cache(cfg, tokens.shape[0], tokens.shape[1])
    num_new = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    hidden, _, _ = decoder.forward(params, cfg, jnp.asarray(tokens), cache, num_new)
    return np.asarray(decoder.logits(params, cfg, hidden))


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_logits_match_transformers(tiny_hf_model, family):
    folder, model = tiny_hf_model(family)
    cfg, params = load_hf_model(folder)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 100), dtype=np.int32)
    ours = full_forward_logits(params, cfg, tokens)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hidden_state_taps_match_transformers(tiny_hf_model, family):
    folder, model = tiny_hf_model(family)
    cfg, params = load_hf_model(folder)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 20), dtype=np.int32)
    cache = decoder.init_cache(cfg, 2, 20)
    taps_at = (0, 1, 2)
    _, _, taps = decoder.forward(params, cfg, jnp.asarray(tokens), cache, jnp.array([20, 20]), taps_at)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
    for i, layer in enumerate(taps_at):
        np.testing.assert_allclose(np.asarray(taps[i]), ref[layer].numpy(), atol=1e-4, rtol=0)
