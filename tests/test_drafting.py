"""The engine's drafter bookkeeping: a context built round by round from verify passes equals one
built from the whole committed prefix at once (for DSpark and Eagle3), so drafts are never stale
or misaligned (which losslessness tests alone could not reveal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.drafters.dspark import init_drafter_params
from dspark_jax.drafters.eagle3 import init_eagle3_params
from dspark_jax.engine import drafting
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig

TCFG = ModelConfig(family="qwen3", vocab_size=48, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=48, max_position_embeddings=128, qk_norm=True)
TARGET = decoder.init_params(TCFG, jax.random.key(0), scale=0.3)
COMMON = dict(num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
              vocab_size=48, target_layer_ids=(0, 1), target_vocab_size=48, target_hidden_size=32, target_num_layers=3)
DRAFTERS = {
    "dspark": lambda: (lambda c: (c, init_drafter_params(c, jax.random.key(1), scale=0.3)))(
        DrafterConfig(kind="dspark", block_size=4, head="markov", markov_rank=8, mask_token_id=47, **COMMON)),
    "eagle3": lambda: (lambda c: (c, init_eagle3_params(c, jax.random.key(1), scale=0.3)))(
        DrafterConfig(kind="eagle3", head="none", confidence=False, **COMMON)),
}
MAX_LEN, G = 64, 4


def prefill(tokens, lengths):
    cache = decoder.init_cache(TCFG, tokens.shape[0], MAX_LEN)
    _, cache, taps = decoder.forward(TARGET, TCFG, tokens, cache, lengths, (1, 2))
    return cache, jnp.concatenate(list(taps), -1)


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_round_by_round_context_equals_prefix_context(kind):
    dcfg, dparams = DRAFTERS[kind]()
    rng = np.random.default_rng(0)
    seqs = rng.integers(1, 48, size=(2, 30)).astype(np.int32)
    prompt_lens = np.array([6, 9], np.int32)
    tokens = np.where(np.arange(30) < prompt_lens[:, None], seqs, 0)
    cache, taps = prefill(jnp.asarray(tokens[:, :16]), jnp.asarray(prompt_lens))
    state = drafting.start(dparams, dcfg, TARGET, jnp.asarray(tokens[:, :16]), jnp.asarray(prompt_lens), taps,
                           MAX_LEN, jnp.float32)
    pos = prompt_lens.copy()  # the anchor's position = committed tokens fed to the target
    for committed in ([3, 1], [1, 5], [5, 2]):  # tokens kept per row this round (accepted + 1)
        committed = np.asarray(committed, np.int32)
        verify = np.stack([seqs[b, pos[b]: pos[b] + G + 1] for b in range(2)])  # [x_0, x_1..x_g]
        _, cache, vtaps = decoder.forward(TARGET, TCFG, jnp.asarray(verify), cache, jnp.asarray(committed), (1, 2))
        state = drafting.commit(dparams, dcfg, TARGET, state, jnp.asarray(verify), jnp.concatenate(list(vtaps), -1),
                                jnp.asarray(committed), jnp.array([True, True]))
        pos += committed
    anchor = jnp.asarray(seqs[np.arange(2), pos])

    _, full_taps = prefill(jnp.asarray(np.where(np.arange(30) < pos[:, None], seqs, 0)), jnp.asarray(pos))
    fresh = drafting.start(dparams, dcfg, TARGET, jnp.asarray(np.where(np.arange(30) < pos[:, None], seqs, 0)),
                           jnp.asarray(pos), full_taps, MAX_LEN, jnp.float32)
    a = drafting.propose(dparams, dcfg, TARGET, TCFG, state, anchor, jax.random.key(3), SamplingConfig(), G)
    b = drafting.propose(dparams, dcfg, TARGET, TCFG, fresh, anchor, jax.random.key(3), SamplingConfig(), G)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_allclose(np.asarray(a.log_probs), np.asarray(b.log_probs), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), np.asarray(fresh.cache.lengths))


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_engine_prefill_gives_the_drafter_the_prompt_context(kind):
    """The engine's prefill (the target over the flattened prompts, or over every padded slot)
    leaves the drafter where drafting.start gets from the padded forward pass: the same next draft
    (a wrong context would only lower tau, which losslessness tests cannot see)."""
    from dspark_jax.engine.generate import flatten_prompts
    from dspark_jax.engine.speculative import SpecConfig, spec_prefill

    dcfg, dparams = DRAFTERS[kind]()
    rng = np.random.default_rng(5)
    lengths = np.array([6, 13, 1], np.int32)
    prompts = [rng.integers(1, 48, size=n).tolist() for n in lengths]
    tokens = np.zeros((len(prompts), 16), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    _, taps = prefill(jnp.asarray(tokens), jnp.asarray(lengths))
    want = drafting.start(dparams, dcfg, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), taps, MAX_LEN,
                          jnp.float32)
    key = jax.random.key(3)
    for flat in (flatten_prompts(prompts), None):
        state = spec_prefill(TARGET, dparams, jnp.asarray(tokens), jnp.asarray(lengths),
                             jnp.full((len(prompts),), 8, jnp.int32), jax.random.key(0), flat, tcfg=TCFG, dcfg=dcfg,
                             cfg=SpecConfig(gamma=G), max_len=MAX_LEN)
        got = drafting.propose(dparams, dcfg, TARGET, TCFG, state.draft, state.anchor, key, SamplingConfig(), G)
        ref = drafting.propose(dparams, dcfg, TARGET, TCFG, want, state.anchor, key, SamplingConfig(), G)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
        np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(ref.log_probs), atol=1e-4)


@pytest.mark.parametrize("head", ["markov", "rnn", "none"])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)])
def test_the_decoding_layout_drafts_what_the_trained_params_draft(head, sampling):
    """`dspark.decoding_layout` (per-layer layers, fc_t, Markov w2_t: what decoding reads on a CPU)
    is the same function: the same context, drafts and distributions as the params as trained, and
    in bf16 the same as the bf16-rounded params in fp32 (the kernel widens them exactly)."""
    from dspark_jax.drafters import dspark

    dcfg = DrafterConfig(kind="dspark", block_size=4, head=head, markov_rank=8, mask_token_id=47,
                         confidence=head != "none", **{**COMMON, "num_layers": 2})
    trained = init_drafter_params(dcfg, jax.random.key(1), scale=0.3)
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 48, size=(2, 12)), jnp.int32)
    lengths = jnp.array([12, 7], jnp.int32)
    _, taps = prefill(tokens, lengths)
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), trained)
    for reference, dtype in ((trained, jnp.float32), (rounded, jnp.bfloat16)):
        decoding = dspark.decoding_layout(reference, dcfg, dtype)
        if jax.default_backend() == "cpu":
            assert decoder.layout_of(decoding) == "per_layer" and "fc_t" in decoding
        assert all(a.dtype == dtype for a in jax.tree.leaves(decoding))
        drafts = []
        for params in (reference, decoding):
            state = drafting.start(params, dcfg, TARGET, tokens, lengths, taps, MAX_LEN, jnp.float32)
            drafts.append((state, drafting.propose(params, dcfg, TARGET, TCFG, state, tokens[:, 0], jax.random.key(3),
                                                   sampling, G)))
        (s_ref, d_ref), (s_dec, d_dec) = drafts
        np.testing.assert_allclose(np.asarray(s_dec.cache.k), np.asarray(s_ref.cache.k), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(s_dec.cache.v), np.asarray(s_ref.cache.v), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(d_dec.tokens), np.asarray(d_ref.tokens))
        np.testing.assert_allclose(np.asarray(d_dec.log_probs), np.asarray(d_ref.log_probs), atol=1e-4)
        if dcfg.confidence:
            np.testing.assert_allclose(np.asarray(d_dec.confidence_logits), np.asarray(d_ref.confidence_logits),
                                       atol=1e-4)


def test_a_bf16_drafter_beside_an_fp32_target_reads_a_bf16_copy_of_the_head():
    """The full-vocabulary LM head in the drafter's dtype when that is narrower than the target's
    (half the bytes per pass), scored as the bf16-rounded head; none when it is not narrower."""
    from dspark_jax.drafters import dspark

    dcfg, trained = DRAFTERS["dspark"]()
    assert "draft_head" not in dspark.with_draft_head(trained, dcfg, TARGET, TCFG)
    bf16 = dspark.with_draft_head(dspark.decoding_layout(trained, dcfg, jnp.bfloat16), dcfg, TARGET, TCFG)
    head = bf16["draft_head"]
    full = TARGET["embed"] if TCFG.tie_word_embeddings else TARGET["lm_head"].T
    assert head.dtype == jnp.bfloat16 and head.shape == full.shape
    hidden = jnp.asarray(np.random.default_rng(4).standard_normal((3, TCFG.hidden_size)), jnp.float32)
    want = np.asarray(hidden, np.float64) @ np.asarray(full.astype(jnp.bfloat16).astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(dspark.base_logits(bf16, dcfg, TARGET, TCFG, hidden)), want, atol=1e-4)
