"""`processed_log_probs` and `sample` against the processed distribution computed from its definition
in numpy (tests/stats_helpers.reference_probs): the log-probabilities exactly, and the frequencies of
2e5 draws per setting (one jitted call each) by a chi-square test. Speculative and plain decoding share
this sampler, so a bias here would cancel out of every spec-vs-plain comparison; it is checked here."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats_helpers import assert_drawn_from, reference_probs

from dspark_jax.models.sampling import SamplingConfig, processed_log_probs, sample

V = 8
RANDOM = np.random.default_rng(0).normal(scale=1.5, size=(V,)).astype(np.float32)
# ties: the 2nd..4th largest logits are equal (a top-k cutoff inside them keeps all three), and with
# top_p = 0.5 the top-p cutoff falls inside them as well
TIES = np.array([2.0, 1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 0.5], np.float32)
TOP_TIE = np.array([1.0, 3.0, 3.0, 0.0, -1.0, 2.0, -3.0, 0.0], np.float32)  # two tokens share the maximum

SETTINGS = [
    (RANDOM, SamplingConfig(1.0)),
    (RANDOM, SamplingConfig(0.5)),
    (RANDOM, SamplingConfig(2.0)),
    (RANDOM, SamplingConfig(1.0, top_k=3)),
    (RANDOM, SamplingConfig(0.7, top_k=1)),
    (RANDOM, SamplingConfig(1.0, top_k=V - 1)),
    (RANDOM, SamplingConfig(1.0, top_k=V)),  # k = V: off
    (RANDOM, SamplingConfig(1.0, top_p=0.9)),
    (RANDOM, SamplingConfig(1.3, top_p=0.6)),
    (RANDOM, SamplingConfig(1.0, top_p=1e-6)),  # one token
    (RANDOM, SamplingConfig(0.8, top_k=5, top_p=0.8)),
    (RANDOM, SamplingConfig(1.0, top_k=2, top_p=0.95)),
    (TIES, SamplingConfig(1.0, top_k=2)),
    (TIES, SamplingConfig(1.0, top_k=4)),
    (TIES, SamplingConfig(1.0, top_p=0.5)),
    (TIES, SamplingConfig(1.0, top_k=2, top_p=0.5)),
    (TIES, SamplingConfig(1.0, top_k=3, top_p=0.7)),
    (TOP_TIE, SamplingConfig(1.0, top_k=1)),
    (TOP_TIE, SamplingConfig(1.0, top_p=1e-6)),
    (TOP_TIE, SamplingConfig(0.5, top_k=1, top_p=0.3)),
]
IDS = [f"{name}-T{c.temperature}-k{c.top_k}-p{c.top_p}" for name, c in
       zip(["random" if x is RANDOM else "ties" if x is TIES else "top_tie" for x, _ in SETTINGS], (c for _, c in SETTINGS))]


def test_reference_on_hand_computed_cases():
    """The numpy reference itself, on cases small enough to work out by hand."""
    np.testing.assert_allclose(reference_probs([0.0, np.log(3.0)], 1.0), [0.25, 0.75])
    np.testing.assert_allclose(reference_probs([0.0, np.log(3.0)], 0.5), [0.1, 0.9])  # 1 : 9
    np.testing.assert_allclose(reference_probs(np.log([1.0, 2.0, 3.0, 4.0]), 1.0, top_k=2), [0, 0, 3 / 7, 4 / 7])
    # ties at the k-th value are kept: 2 tokens asked for, 3 tied for second place
    np.testing.assert_allclose(reference_probs(np.log([4.0, 1.0, 1.0, 1.0]), 1.0, top_k=2), [4 / 7, 1 / 7, 1 / 7, 1 / 7])
    # masses .4 .3 .2 .1: top_p = .65 needs the first two (.4 < .65, .7 >= .65), top_p = .75 three
    np.testing.assert_allclose(reference_probs(np.log([0.1, 0.4, 0.2, 0.3]), 1.0, top_p=0.65), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(reference_probs(np.log([0.1, 0.4, 0.2, 0.3]), 1.0, top_p=0.75),
                               [0, 4 / 9, 2 / 9, 3 / 9])
    # top-p over the top-k distribution (.4 .3 .2 -> 4/9 3/9 2/9): top_p = .5 keeps 2
    np.testing.assert_allclose(reference_probs(np.log([0.1, 0.4, 0.2, 0.3]), 1.0, top_k=3, top_p=0.5),
                               [0, 4 / 7, 0, 3 / 7])


@pytest.mark.parametrize("logits,cfg", SETTINGS, ids=IDS)
def test_processed_log_probs_are_exact(logits, cfg):
    want = reference_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    got = np.asarray(processed_log_probs(jnp.asarray(logits), cfg), np.float64)
    np.testing.assert_array_equal(np.isneginf(got), want == 0)  # the same tokens are masked
    np.testing.assert_allclose(got[want > 0], np.log(want[want > 0]), atol=2e-6, rtol=0)
    # batched leading axes give the same rows
    batched = np.asarray(processed_log_probs(jnp.asarray(np.stack([logits, logits[::-1]])[None]), cfg))
    np.testing.assert_array_equal(batched[0, 0], got.astype(np.float32))
    np.testing.assert_allclose(np.exp(batched[0, 1]), reference_probs(logits[::-1], cfg.temperature, cfg.top_k,
                                                                      cfg.top_p), atol=2e-6)


@functools.partial(jax.jit, static_argnames=("cfg", "n"))
def draws(key, logits, *, cfg, n):
    """n draws of `sample` in one call: a batch of n identical rows under one key (how the engine calls it)."""
    return sample(key, jnp.broadcast_to(logits, (n, logits.shape[-1])), cfg)


@pytest.mark.parametrize("logits,cfg", SETTINGS, ids=IDS)
def test_sample_frequencies_match_the_processed_distribution(logits, cfg):
    want = reference_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    tokens = np.asarray(draws(jax.random.key(3), jnp.asarray(logits), cfg=cfg, n=200_000))
    assert_drawn_from(np.bincount(tokens, minlength=V), want, str(cfg))


def test_greedy_is_argmax_and_untempered():
    cfg = SamplingConfig(0.0, top_k=1)
    logits = jnp.asarray(np.stack([RANDOM, TIES, TOP_TIE]))
    np.testing.assert_array_equal(np.asarray(sample(jax.random.key(0), logits, cfg)), [int(np.argmax(RANDOM)), 0, 1])
    np.testing.assert_allclose(np.exp(np.asarray(processed_log_probs(logits, cfg))),
                               reference_probs(np.asarray(logits), 1.0), atol=2e-6)


def test_top_k_sampling_sorts_no_vocabulary():
    # XLA:CPU folds a slice of top_k's output into it and sorts the whole vocabulary instead (135 ms
    # a step at batch 16 over 49,152 tokens, 1 ms as the TopK call); processed_log_probs keeps it a TopK.
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.8)
    hlo = jax.jit(lambda k, logits: sample(k, logits, cfg)).lower(jax.random.key(0), jnp.zeros((4, 4096))).compile().as_text()
    assert "sort(" not in hlo and "TopK" in hlo
