"""Speculative decoding is lossless: greedy output == plain greedy target output, token for token."""

import jax
import numpy as np
import pytest

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.drafters.dspark import init_drafter_params
from dspark_jax.engine.speculative import SpecConfig, speculative_generate
from dspark_jax.engine.sps import SPSTable
from dspark_jax.generate import generate
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.sampling import SamplingConfig

TCFG = ModelConfig(family="qwen3", vocab_size=32, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=48, max_position_embeddings=256, qk_norm=True)
PERM = np.random.default_rng(0).permutation(32)


def structured_target():
    """A target that mostly continues a fixed permutation chain (next = PERM[current]) with random
    layers perturbing it, so a drafter that knows the chain is accepted often but not always."""
    params = decoder.init_params(TCFG, jax.random.key(0), scale=0.15)
    params["embed"] = np.eye(32, dtype=np.float32) * 3.0
    params["lm_head"] = np.eye(32, dtype=np.float32)[:, np.argsort(PERM)] * 6.0
    return jax.tree.map(jax.numpy.asarray, params)


TARGET = structured_target()


def drafter(head="markov", confidence=True):
    """A random drafter whose Markov table knows the chain (so blocks are partly accepted)."""
    rank = 32 if head != "none" else 0
    dcfg = DrafterConfig(kind="dspark", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=32, block_size=5, head=head,
                         markov_rank=rank, confidence=confidence, mask_token_id=31,
                         target_layer_ids=(0, 2), target_vocab_size=32, target_hidden_size=32, target_num_layers=4)
    params = jax.device_get(init_drafter_params(dcfg, jax.random.key(1), scale=0.3))
    if head != "none":
        params["markov"]["w1"] = np.eye(32, dtype=np.float32) * 4.0
        params["markov"]["w2"] = np.eye(32, dtype=np.float32)[PERM] * 4.0  # bias peaks at PERM[prev]
    return dcfg, jax.tree.map(jax.numpy.asarray, params)


PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


SPS = SPSTable(buckets=(1, 2, 4, 8, 16), sps=(10.0, 9.5, 9.0, 7.0, 4.0), device="test", model="test")


@pytest.mark.parametrize("head,policy", [("markov", "fixed"), ("rnn", "threshold"), ("none", "fixed"),
                                         ("markov", "mtp1"), ("markov", "dspark"), ("markov", "dspark_async")])
def test_greedy_speculative_equals_greedy_target(head, policy):
    dcfg, dparams = drafter(head, confidence=head != "none")
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=30).token_ids
    cfg = SpecConfig(gamma=4, policy=policy, threshold=0.3, sps=SPS)
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=30, cfg=cfg)
    assert got.token_ids == want
    taus = got.acceptance_lengths()
    assert taus.min() >= 1 and taus.max() <= cfg.gamma + 1
    assert sum(len(t) for t in got.token_ids) == 90
    if head == "markov" and policy in ("fixed", "mtp1"):  # partly accepted: both branches are exercised
        assert (taus > 1).mean() > 0.2 and (taus < (cfg.gamma if policy != "mtp1" else 1) + 1).any()


def test_stop_tokens_mid_block_match_plain_decoding():
    dcfg, dparams = drafter()
    free = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20).token_ids
    stop = free[0][5]
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20, stop_ids=[stop]).token_ids
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20,
                               cfg=SpecConfig(gamma=5, stop_ids=(stop,))).token_ids
    assert got == want


def _empirical(token_ids, position, vocab=32):
    counts = np.bincount([t[position] for t in token_ids], minlength=vocab)
    return counts / counts.sum()


@pytest.mark.parametrize("sampling,policy", [(SamplingConfig(1.0), "fixed"), (SamplingConfig(0.8, 8, 0.9), "fixed"),
                                             (SamplingConfig(1.0), "threshold"), (SamplingConfig(1.0), "dspark")])
def test_sampling_is_lossless(sampling, policy):
    """The first 3 tokens under speculative sampling follow the target's own sampling distribution.

    6000 samples per side; the total-variation distance between two empirical distributions over
    ~10 likely tokens is ~0.02 by chance, while a biased verifier (e.g. no residual resampling)
    moves it by 0.1 or more on this drafter/target pair."""
    dcfg, dparams = drafter()
    prompts = [[3, 1, 4]] * 6000
    plain = generate(TARGET, TCFG, prompts, max_new_tokens=3, sampling=sampling, seed=1).token_ids
    spec = speculative_generate(TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=3, seed=2,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy=policy, threshold=0.3,
                                               sps=SPSTable(buckets=(9000, 30000), sps=(1.0, 0.5))))  # ~3000 admitted
    assert (spec.acceptance_lengths() > 1).mean() > 0.2  # drafts really are being accepted
    for position in range(3):
        tv = 0.5 * np.abs(_empirical(plain, position) - _empirical(spec.token_ids, position)).sum()
        assert tv < 0.045, (position, tv)
    pairs = lambda ids: np.bincount([t[1] * 32 + t[2] for t in ids], minlength=32 * 32) / len(ids)  # noqa: E731
    assert 0.5 * np.abs(pairs(plain) - pairs(spec.token_ids)).sum() < 0.08


def test_eagle3_greedy_speculative_equals_greedy_target():
    from dspark_jax.drafters.eagle3 import init_eagle3_params

    dcfg = DrafterConfig(kind="eagle3", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=32, head="none", confidence=False, target_layer_ids=(0, 2),
                         target_vocab_size=32, target_hidden_size=32, target_num_layers=4)
    dparams = init_eagle3_params(dcfg, jax.random.key(2), scale=0.3)
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20).token_ids
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20, cfg=SpecConfig(gamma=3))
    assert got.token_ids == want


@pytest.mark.parametrize("policy", ["fixed", "threshold", "dspark_async"])
def test_flattened_bucketed_verify_is_lossless_and_matches_padded(policy):
    """Verify over flattened tokens padded to a token bucket: same output as plain greedy decoding,
    and the same rounds (taus) as the padded layout."""
    dcfg, dparams = drafter()
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=24).token_ids
    common = dict(gamma=4, policy=policy, threshold=0.3, sps=SPS)
    padded = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=24, cfg=SpecConfig(**common))
    flat = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=24,
                                cfg=SpecConfig(**common, verify_buckets=(4, 8, 16)))
    assert flat.token_ids == padded.token_ids == want
    np.testing.assert_array_equal(flat.acceptance_lengths(), padded.acceptance_lengths())


def test_flattened_verify_sampling_is_lossless():
    dcfg, dparams = drafter()
    prompts = [[3, 1, 4]] * 3072
    sampling = SamplingConfig(1.0)
    plain = generate(TARGET, TCFG, prompts, max_new_tokens=2, sampling=sampling, seed=1).token_ids
    spec = speculative_generate(TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=2, seed=10,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy="threshold", threshold=0.3,
                                               verify_buckets=(3072, 6144, 12288, 15360))).token_ids
    for position in range(2):
        tv = 0.5 * np.abs(_empirical(plain, position) - _empirical(spec, position)).sum()
        assert tv < 0.06, (position, tv)


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_continuous_batching_refills_slots_and_stays_lossless(policy):
    """7 requests through 3 slots: each finished request's slot is refilled by the next prompt, and
    every request's output is exactly its plain greedy output (padded verify for "fixed", flattened
    verify in token buckets for "dspark")."""
    from dspark_jax.engine.speculative import speculative_serve
    from dspark_jax.engine.sps import token_buckets

    buckets = None if policy == "fixed" else token_buckets(3 * 5)
    spec = dict(policy=policy, sps=SPS if policy == "dspark" else None, verify_buckets=buckets)

    dcfg, dparams = drafter()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16], [17, 18, 19, 20]]
    budgets = {"max_new_tokens": 9}
    want = [generate(TARGET, TCFG, [p], **budgets).token_ids[0] for p in prompts]
    stop = want[0][4]
    want_stop = [generate(TARGET, TCFG, [p], stop_ids=[stop], **budgets).token_ids[0] for p in prompts]
    got = speculative_serve(TARGET, TCFG, dparams, dcfg, prompts, slots=3, cfg=SpecConfig(gamma=4, **spec), **budgets)
    assert got.token_ids == want
    served = {int(r) for rnd in got.rounds for r in rnd["request"] if r >= 0}
    assert served == set(range(7)) and max(len(rnd["request"]) for rnd in got.rounds) == 3
    got_stop = speculative_serve(TARGET, TCFG, dparams, dcfg, prompts, slots=3,
                                 cfg=SpecConfig(gamma=4, stop_ids=(stop,), **spec), **budgets)
    assert got_stop.token_ids == want_stop


def test_sps_profile_times_the_draft_with_the_verify(monkeypatch):
    """With the drafter's params, every timed call runs the drafter's pass and the verify pass of
    its bucket (SPS = 1 / round cost); without, the verify pass alone."""
    from dspark_jax.engine import sps as sps_module
    from dspark_jax.engine.speculative import Drafted, profile_verify

    seen = {}

    def fake_profile(step_fn, buckets, **kw):
        seen["buckets"], seen["outputs"] = buckets, [step_fn(b) for b in buckets]
        return SPSTable(tuple(buckets), tuple(1.0 for _ in buckets), model=kw["model"])

    monkeypatch.setattr(sps_module, "profile_sps", fake_profile)
    dcfg, dparams = drafter()
    table = profile_verify(TARGET, TCFG, dcfg, rows=2, gamma=4, max_len=32, model="m", dparams=dparams)
    assert table.buckets == (1, 2, 4, 8, 10) and seen["buckets"] == (1, 2, 4, 8, 10)
    for (drafted, (logits, _, _)), n in zip(seen["outputs"], seen["buckets"]):
        assert isinstance(drafted, Drafted) and drafted.tokens.shape == (2, 4) and logits.shape[:2] == (2, 5)
    profile_verify(TARGET, TCFG, dcfg, rows=2, gamma=4, max_len=32, model="m")
    assert all(out[0] is None for out in seen["outputs"])
