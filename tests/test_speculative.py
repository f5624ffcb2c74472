"""Speculative decoding is lossless: greedy output == plain greedy target output, token for token, and
sampled output follows the target's own conditional distributions (checked exactly, position by position)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats_helpers import P_MIN, chance_total_variation, reference_probs, stratified_chi_square_pvalue

from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.drafters.dspark import init_drafter_params
from dspark_jax.engine.speculative import SpecConfig, speculative_generate
from dspark_jax.engine.sps import SPSTable
from dspark_jax.engine.generate import generate
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig

TCFG = ModelConfig(family="qwen3", vocab_size=32, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=48, max_position_embeddings=256, qk_norm=True)
PERM = np.random.default_rng(0).permutation(32)


def structured_target(lm_scale=6.0):
    """A target that mostly continues a fixed permutation chain (next = PERM[current]) with random
    layers perturbing it, so a drafter that knows the chain is accepted often but not always."""
    params = decoder.init_params(TCFG, jax.random.key(0), scale=0.15)
    params["embed"] = np.eye(32, dtype=np.float32) * 3.0
    params["lm_head"] = np.eye(32, dtype=np.float32)[:, np.argsort(PERM)] * lm_scale
    return jax.tree.map(jax.numpy.asarray, params)


TARGET = structured_target()
# For the sampling tests: the same chain, less sure of itself. At T = 1, after SAMPLING_PROMPTS, its most
# likely next token has 37-58% of the mass on average at each of the first 6 generated positions
# (TARGET: 71-89%, and 97-99% at the first two after [3, 1, 4]), so both the accept and the residual
# branch of every verified position carry signal.
SOFT_TARGET = structured_target(lm_scale=2.0)


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
    if head == "rnn":  # output gate o = 2 W1[prev] (tanh ~ one-hot of prev), so B = W2[prev] peaks at PERM[prev]
        r = dcfg.markov_rank
        params["rnn"]["w"] = np.zeros_like(params["rnn"]["w"])
        params["rnn"]["w"][r:2 * r, 2 * r:] = np.eye(r, dtype=np.float32) * 2.0
        params["rnn"]["b"] = np.zeros_like(params["rnn"]["b"])
        params["markov"]["w2"] = np.eye(32, dtype=np.float32)[PERM] * 16.0
        params["confidence"]["b"] = np.float32(1.0)  # confident enough that the threshold policy verifies
    return dcfg, jax.tree.map(jax.numpy.asarray, params)


def round_counts(result) -> tuple[int, int]:
    """(rounds that accepted at least one draft token, rounds that rejected a verified draft token)."""
    rounds = [r for r in result.rounds if not r.get("plain", 0)]  # plain target steps are not rounds
    accepted = np.concatenate([r["accepted"][r["active"]] for r in rounds])
    num_draft = np.concatenate([r["num_draft"][r["active"]] for r in rounds])
    return int((accepted > 0).sum()), int((accepted < num_draft).sum())


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
    accepting, rejecting = round_counts(got)  # both branches of the verifier were exercised
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)
    if head == "markov" and policy in ("fixed", "mtp1"):  # partly accepted
        assert (taus > 1).mean() > 0.2 and (taus < (cfg.gamma if policy != "mtp1" else 1) + 1).any()


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_greedy_speculative_equals_greedy_target_with_bf16_weights(policy):
    """`--dtype bfloat16` on a CPU: target and drafter weights in bf16, activations in fp32. Verify
    passes run many-row bf16 products and plain decode steps one-row ones (as two rows); the tokens
    must still be the plain target's."""
    to_bf16 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), tree)  # noqa: E731
    target = to_bf16(TARGET)
    dcfg, dparams = drafter("markov")
    dparams = to_bf16(dparams)
    want = generate(target, TCFG, PROMPTS, max_new_tokens=30).token_ids
    got = speculative_generate(target, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=30,
                               cfg=SpecConfig(gamma=4, policy=policy, sps=SPS))
    assert got.token_ids == want
    accepting, rejecting = round_counts(got)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)
    single = speculative_generate(target, TCFG, dparams, dcfg, PROMPTS[:1], max_new_tokens=30,
                                  cfg=SpecConfig(gamma=4, policy=policy, sps=SPS))  # one-row products
    assert single.token_ids == want[:1]


def test_stop_tokens_mid_block_match_plain_decoding():
    dcfg, dparams = drafter()
    free = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20).token_ids
    stop = free[0][5]
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20, stop_ids=[stop]).token_ids
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20,
                               cfg=SpecConfig(gamma=5, stop_ids=(stop,)))
    assert got.token_ids == want
    accepting, rejecting = round_counts(got)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)


SAMPLING_PROMPTS = [[3, 1, 4], [9, 20, 7], [14, 2, 27]]


@jax.jit
def _teacher_forced_logits(params, tokens):
    """Target logits [N, S, V] at every position of full sequences, from an empty cache."""
    n, s = tokens.shape
    hidden, _, _ = decoder.forward(params, TCFG, tokens, decoder.init_cache(TCFG, n, s), jnp.full((n,), s, jnp.int32))
    return decoder.logits(params, TCFG, hidden)


def assert_follows_target(prompts, token_ids, sampling: SamplingConfig, params=SOFT_TARGET, positions=6):
    """Each generated token follows the target's processed distribution GIVEN the sequence before it.

    The reference is exact: the target's logits on each sample's own prefix (one teacher-forced
    pass), processed in numpy (stats_helpers.reference_probs, not the sampler under test). At each
    position j, the counts of (token j-1, token j) are compared with the sums of the per-sample
    probabilities by a chi-square test stratified by token j-1 (p-value > 1e-4), and the token
    frequencies at j must lie within twice the total variation chance gives of the expected ones."""
    prompt_len = len(prompts[0])
    seqs = np.array([list(p) + list(t[:positions]) for p, t in zip(prompts, token_ids)], np.int32)
    assert seqs.shape == (len(prompts), prompt_len + positions)
    logits = np.asarray(_teacher_forced_logits(params, jnp.asarray(seqs)))[:, prompt_len - 1:-1]
    probs = reference_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # [N, positions, V]
    n, V = len(seqs), TCFG.vocab_size
    report = []
    for j in range(positions):
        prev, tok = seqs[:, prompt_len + j - 1], seqs[:, prompt_len + j]
        observed, expected = np.zeros((V, V)), np.zeros((V, V))
        np.add.at(observed, (prev, tok), 1)
        np.add.at(expected, prev, probs[:, j])
        pvalue = stratified_chi_square_pvalue(observed, expected)
        tv = 0.5 * np.abs(observed.sum(0) - expected.sum(0)).sum() / n
        report.append((j, pvalue, tv, 2 * chance_total_variation(expected.sum(0) / n, n)))
    bad = [r for r in report if not (r[1] > P_MIN and r[2] <= r[3])]
    assert not bad, "position, p-value, TV, TV bound: " + "; ".join(f"{j} {p:.3g} {t:.4f} {b:.4f}" for j, p, t, b in report)
    return report


def test_reference_check_passes_plain_sampling():
    """The check itself on plain (non-speculative) sampling, whose conditionals are the target's by
    construction, at T = 1 and with top-k/top-p."""
    prompts = SAMPLING_PROMPTS * 2000
    for sampling in (SamplingConfig(1.0), SamplingConfig(0.8, 8, 0.9)):
        plain = generate(SOFT_TARGET, TCFG, prompts, max_new_tokens=6, sampling=sampling, seed=1).token_ids
        assert_follows_target(prompts, plain, sampling)


@pytest.mark.parametrize("sampling,policy", [(SamplingConfig(1.0), "fixed"), (SamplingConfig(0.8, 8, 0.9), "fixed"),
                                             (SamplingConfig(1.0), "threshold"), (SamplingConfig(1.0), "dspark")])
def test_sampling_is_lossless(sampling, policy):
    """The first 6 tokens under speculative sampling (6000 samples over 3 prompts) follow the target's
    own conditional distributions exactly (see assert_follows_target). Position 0 is the prefill's
    sample; positions 1-5 come out of verification rounds. Power, measured on these seeds: with the
    residual replaced by p, every parametrisation fails the chi-square at each of positions 1-5
    (p-values 1e-140 .. 7e-7); with p and q swapped in the acceptance ratio, the rejection count
    fails, and without it the distribution check fails at positions 1-4 (p-values < 1e-260)."""
    dcfg, dparams = drafter()
    prompts = SAMPLING_PROMPTS * 2000
    spec = speculative_generate(SOFT_TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=6, seed=2,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy=policy, threshold=0.3,
                                               sps=SPSTable(buckets=(9000, 30000), sps=(1.0, 0.5))))  # ~3000 admitted
    assert (spec.acceptance_lengths() > 1).mean() > 0.2  # drafts really are being accepted
    accepting, rejecting = round_counts(spec)
    assert rejecting > 0.2 * len(spec.acceptance_lengths()), (accepting, rejecting)  # and rejected
    assert_follows_target(prompts, spec.token_ids, sampling)


def test_eagle3_greedy_speculative_equals_greedy_target():
    from dspark_jax.drafters.eagle3 import init_eagle3_params

    dcfg = DrafterConfig(kind="eagle3", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                         intermediate_size=48, vocab_size=32, head="none", confidence=False, target_layer_ids=(0, 2),
                         target_vocab_size=32, target_hidden_size=32, target_num_layers=4)
    dparams = jax.device_get(init_eagle3_params(dcfg, jax.random.key(2), scale=0.3))
    # Make the first draft step follow the chain: fc maps the first tap of x_{n-1} (~ its embedding)
    # to the direction whose LM-head row predicts PERM[PERM[x_{n-1}]], and the layer adds nothing.
    dparams["fc"] = np.zeros_like(dparams["fc"])
    dparams["fc"][np.arange(32), PERM] = 2.0
    dparams["layers"]["wo"] = np.zeros_like(dparams["layers"]["wo"])
    dparams["layers"]["w_down"] = np.zeros_like(dparams["layers"]["w_down"])
    dparams = jax.tree.map(jax.numpy.asarray, dparams)
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=20).token_ids
    got = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=20, cfg=SpecConfig(gamma=3))
    assert got.token_ids == want
    accepting, rejecting = round_counts(got)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)


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
    accepting, rejecting = round_counts(flat)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)


def test_schedulers_share_the_verify_programs_and_a_run_compiles_the_buckets_it_uses(monkeypatch):
    """Only the draft program depends on the scheduler: a second scheduler over the same shapes
    compiles a draft program and nothing else. A verify bucket is compiled when a round first
    needs it, off `running_clock` (its time counts in compile_s, not in the run's timings)."""
    from dspark_jax.engine import generate as G
    from dspark_jax.engine.sps import pad_to_bucket

    def programs(name):
        return sum(key[0] == name for key in G._COMPILED)

    monkeypatch.setattr(G, "_COMPILED", {})  # none compiled by the tests before this one
    dcfg, dparams = drafter()
    buckets = (1, 2, 4, 8, 16)
    runs, seen = {}, set()
    for policy in ("threshold", "dspark", "mtp1"):
        before = {name: programs(name) for name in ("draft_and_schedule", "verify_and_commit", "spec_prefill")}
        compiling = G.compiling_seconds()
        runs[policy] = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=17, seed=5,
                                            cfg=SpecConfig(gamma=4, policy=policy, threshold=0.3, sps=SPS,
                                                           verify_buckets=buckets))
        assert runs[policy].compile_s >= G.compiling_seconds() - compiling  # what this run compiled
        new = {name: programs(name) - n for name, n in before.items()}
        used = {int(pad_to_bucket(buckets, int(np.sum(np.where(r["active"], r["num_draft"] + 1, 0)))))
                for r in runs[policy].rounds}
        assert new["draft_and_schedule"] == 1 and new["spec_prefill"] == (policy == "threshold")
        assert new["verify_and_commit"] == len(used - seen) and len(used) < len(buckets), (policy, new, used, seen)
        seen |= used
    assert runs["threshold"].token_ids == runs["dspark"].token_ids == runs["mtp1"].token_ids


def test_the_running_clock_stops_while_a_program_compiles():
    import time

    from dspark_jax.engine.generate import compiled, running_clock

    def slow_to_trace(x):
        time.sleep(0.3)  # at trace time, inside `compiled`
        return x * 3

    wall, clock = time.perf_counter(), running_clock()
    compiled(jax.jit(slow_to_trace), (jax.ShapeDtypeStruct((7,), jnp.float32),), {})
    assert (time.perf_counter() - wall) - (running_clock() - clock) >= 0.3


def test_flattened_verify_sampling_is_lossless():
    """Sampling through the flattened, token-bucketed verify: 3072 samples, 6 positions, the exact
    check of test_sampling_is_lossless (which fails on the same mutations with this many samples)."""
    dcfg, dparams = drafter()
    prompts = SAMPLING_PROMPTS * 1024
    sampling = SamplingConfig(1.0)
    spec = speculative_generate(SOFT_TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=6, seed=10,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy="threshold", threshold=0.3,
                                               verify_buckets=(3072, 6144, 12288, 15360)))
    accepting, rejecting = round_counts(spec)
    assert accepting > 1000 and rejecting > 1000, (accepting, rejecting)
    assert_follows_target(prompts, spec.token_ids, sampling)


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
    accepting, rejecting = round_counts(got)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)
    served = {int(r) for rnd in got.rounds for r in rnd["request"] if r >= 0}
    assert served == set(range(7)) and max(len(rnd["request"]) for rnd in got.rounds) == 3
    got_stop = speculative_serve(TARGET, TCFG, dparams, dcfg, prompts, slots=3,
                                 cfg=SpecConfig(gamma=4, stop_ids=(stop,), **spec), **budgets)
    assert got_stop.token_ids == want_stop


def test_sps_profile_times_the_draft_with_the_verify(monkeypatch):
    """With the drafter's params, every timed call runs the drafter's pass and the verify pass of
    its bucket (SPS = 1 / round cost); without, the verify pass alone. Then the plain step (the
    target's pass over one token per row, no draft) is timed on its own and kept as plain_sps."""
    from dspark_jax.engine import sps as sps_module
    from dspark_jax.engine.speculative import Drafted, profile_verify

    calls = []

    def fake_profile(step_fn, buckets, **kw):
        calls.append((buckets, [step_fn(b) for b in buckets]))
        return SPSTable(tuple(buckets), tuple(float(len(calls)) for _ in buckets), model=kw.get("model", ""))

    monkeypatch.setattr(sps_module, "profile_sps", fake_profile)
    dcfg, dparams = drafter()
    table = profile_verify(TARGET, TCFG, dcfg, rows=2, gamma=4, max_len=32, model="m", dparams=dparams)
    (buckets, outputs), (plain_buckets, plain_outputs) = calls
    assert table.buckets == (1, 2, 4, 8, 10) and buckets == (1, 2, 4, 8, 10)
    for (drafted, (logits, _, _)), n in zip(outputs, buckets):
        assert isinstance(drafted, Drafted) and drafted.tokens.shape == (2, 4) and logits.shape[:2] == (2, 5)
    assert table.plain_sps == 2.0  # the second call's value
    assert all(len(out) == 3 and out[0].shape[:2] == (2, 1) for out in plain_outputs)  # one token per row, no draft
    calls.clear()
    profile_verify(TARGET, TCFG, dcfg, rows=2, gamma=4, max_len=32, model="m")
    assert all(out[0] is None for out in calls[0][1])


def test_the_flat_prefill_gives_the_drafter_the_padded_prefill_s_context():
    """The engine's prefill projects the drafter's context from the flattened prompt tokens only:
    the same cache, at every prompt position, as projecting the right-padded rows."""
    from dspark_jax.drafters.dspark import init_drafter_params
    from dspark_jax.engine import drafting
    from dspark_jax.engine.generate import flatten_prompts, pad_prompts, unflatten

    dcfg, _ = drafter()
    dparams = init_drafter_params(dcfg, jax.random.key(5), scale=0.5)
    tokens, lengths, max_len = pad_prompts(TCFG, PROMPTS, 8)
    flat = flatten_prompts(PROMPTS)
    taps = jax.random.normal(jax.random.key(6), (flat.tokens.shape[0], len(dcfg.tap_layers) * TCFG.hidden_size))
    args = (dparams, dcfg, TARGET, jax.numpy.asarray(tokens), jax.numpy.asarray(lengths, jax.numpy.int32))
    padded = drafting.start(*args, unflatten(taps, flat, *tokens.shape), max_len, jax.numpy.float32).cache
    flat_cache = drafting.start_flat(*args, flat, taps, max_len, jax.numpy.float32).cache
    np.testing.assert_array_equal(flat_cache.lengths, lengths)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(flat_cache.k[:, row, :n], padded.k[:, row, :n], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(flat_cache.v[:, row, :n], padded.v[:, row, :n], rtol=1e-6, atol=1e-6)
        assert np.abs(np.asarray(flat_cache.k[:, row, :n])).max() > 0


@pytest.mark.parametrize("policy", ["fixed", "dspark", "eagle3"])
def test_programs_traced_for_a_tpu_decode_the_same_tokens(policy):
    """The TPU's trace-time choices (stacked layers, keys laid out like values, the drafter's context
    heads-major, no CPU kernels), run here on the CPU, decode the tokens the CPU's programs decode:
    the layouts a TPU compile check sees are the same computation, not a second one that may drift."""
    from dspark_jax.core.platform import tracing_for
    from dspark_jax.drafters.dspark import context_heads_major

    dcfg, dparams = drafter("markov")
    if policy == "eagle3":  # a random one: its attention over its own cache counts in every draft
        from dspark_jax.drafters.eagle3 import init_eagle3_params

        dcfg = DrafterConfig(kind="eagle3", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=48, vocab_size=32, head="none", confidence=False,
                             target_layer_ids=(0, 2), target_vocab_size=32, target_hidden_size=32, target_num_layers=4)
        dparams = init_eagle3_params(dcfg, jax.random.key(2), scale=0.3)
        policy = "fixed"
    cfg = SpecConfig(gamma=4, policy=policy, sps=SPS)
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=30).token_ids
    cpu = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=30, cfg=cfg)
    jax.clear_caches()  # jit's trace cache is keyed on shardings, which are the CPU's either way
    try:
        with tracing_for("tpu"):
            assert not decoder.keys_transposed() and context_heads_major()
            assert generate(TARGET, TCFG, PROMPTS, max_new_tokens=30).token_ids == want
            tpu = speculative_generate(TARGET, TCFG, dparams, dcfg, PROMPTS, max_new_tokens=30, cfg=cfg)
    finally:
        jax.clear_caches()
    assert tpu.token_ids == want == cpu.token_ids
    np.testing.assert_array_equal(tpu.acceptance_lengths(), cpu.acceptance_lengths())
