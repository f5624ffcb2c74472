"""Batched generation: greedy equals a naive full-recompute loop, stop tokens, sampling settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.core.errors import UserError
from dspark_jax.engine.generate import generate
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig, processed_log_probs

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=96, tie_word_embeddings=True)
PARAMS = decoder.init_params(CFG, jax.random.key(0), scale=0.3)


@jax.jit
def _full_recompute_next(tokens, length):
    """argmax next token after tokens[:length], recomputing the whole prefix from an empty cache."""
    h, _, _ = decoder.forward(PARAMS, CFG, tokens[None], decoder.init_cache(CFG, 1, tokens.shape[0]), length[None])
    return jnp.argmax(decoder.logits(PARAMS, CFG, h[0, length - 1]))


def naive_greedy(prompt, n, width=32):
    seq = list(prompt)
    for _ in range(n):
        padded = jnp.asarray(seq + [0] * (width - len(seq)), jnp.int32)
        seq.append(int(_full_recompute_next(padded, jnp.int32(len(seq)))))
    return seq[len(prompt):]


def test_batched_greedy_matches_naive_loop():
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    out = generate(PARAMS, CFG, prompts, max_new_tokens=12, chunk=5)
    for p, ids in zip(prompts, out.token_ids):
        assert ids == naive_greedy(p, 12)


def test_stop_token_ends_only_its_row():
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    free = generate(PARAMS, CFG, prompts, max_new_tokens=10).token_ids
    stop = free[0][3]  # the 4th token of row 0 becomes a stop token
    out = generate(PARAMS, CFG, prompts, max_new_tokens=10, stop_ids=[stop]).token_ids
    first = free[0].index(stop)
    assert out[0] == free[0][: first + 1]
    cut = free[1].index(stop) + 1 if stop in free[1] else 10
    assert out[1] == free[1][:cut]


def test_sampling_is_seeded_and_respects_top_k():
    prompts = [[1, 2, 3]] * 4
    s = SamplingConfig(temperature=1.0, top_k=1)
    assert generate(PARAMS, CFG, prompts, max_new_tokens=6, sampling=s).token_ids == \
        generate(PARAMS, CFG, prompts, max_new_tokens=6).token_ids  # top-1 sampling is greedy
    hot = SamplingConfig(temperature=5.0)
    a = generate(PARAMS, CFG, prompts, max_new_tokens=8, sampling=hot, seed=1).token_ids
    b = generate(PARAMS, CFG, prompts, max_new_tokens=8, sampling=hot, seed=1).token_ids
    c = generate(PARAMS, CFG, prompts, max_new_tokens=8, sampling=hot, seed=2).token_ids
    assert a == b and a != c
    assert len({tuple(r) for r in a}) > 1  # rows draw independently


def test_processed_distribution_top_k_top_p():
    logits = jnp.log(jnp.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = np.exp(np.asarray(processed_log_probs(logits, SamplingConfig(1.0, top_k=2))))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0], atol=1e-6)
    p = np.exp(np.asarray(processed_log_probs(logits, SamplingConfig(1.0, top_p=0.8))))
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=1e-6)
    p = np.exp(np.asarray(processed_log_probs(logits, SamplingConfig(1.0, top_p=0.3))))
    np.testing.assert_allclose(p, [1, 0, 0, 0, 0], atol=1e-6)  # always keeps the top token
    p = np.exp(np.asarray(processed_log_probs(logits, SamplingConfig(0.5))))
    want = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(p, want / want.sum(), atol=1e-6)


def test_context_and_length_errors():
    with pytest.raises(UserError, match="exceeds the model's context of 96"):
        generate(PARAMS, CFG, [[1] * 90], max_new_tokens=10)
    with pytest.raises(UserError, match="empty prompt"):
        generate(PARAMS, CFG, [[1, 2], []], max_new_tokens=4)


def test_top_k_then_top_p_matches_a_full_sort_reference():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    for k, p in [(5, 0.7), (20, 0.9), (0, 0.6), (3, 1.0), (50, 0.5)]:
        got = np.exp(np.asarray(processed_log_probs(jnp.asarray(logits), SamplingConfig(0.8, top_k=k, top_p=p))))
        for row, probs in zip(logits / 0.8, got):
            order = np.argsort(-row)
            kept = order[: k or len(row)]
            soft = np.exp(row[kept] - row[kept].max())
            soft /= soft.sum()
            before = np.cumsum(soft) - soft
            kept = kept[before < p]
            want = np.zeros_like(row)
            want[kept] = np.exp(row[kept] - row[kept].max())
            np.testing.assert_allclose(probs, want / want.sum(), atol=1e-6)


# ------------------------------------------------------------------ per-row random keys


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.5), SamplingConfig(0.9, top_k=8, top_p=0.9)],
                         ids=["full", "top_k_top_p"])
def test_sampled_rows_depend_on_their_own_key_alone(sampling):
    """A row's sampled tokens are a function of its key (fold_in(seed key, row id)): the same
    whichever rows share its batch, whatever the slots and refill order of continuous batching,
    and whether the first requests are prefilled together or alone (what makes a resumed datagen
    run reproduce an uninterrupted one)."""
    from dspark_jax.engine.generate import serve

    prompts = [[1, 2, 3], [7, 8], [9, 10, 11, 12, 13], [4, 5, 6, 7], [2, 9], [30, 31, 32, 33, 34, 35]]
    full = generate(PARAMS, CFG, prompts, max_new_tokens=10, sampling=sampling, seed=4).token_ids
    assert len({tuple(t) for t in full}) == len(prompts)  # the rows do sample
    assert generate(PARAMS, CFG, prompts[2:4], max_new_tokens=10, sampling=sampling, seed=4).token_ids != full[2:4]
    for slots, alone in [(1, False), (2, False), (4, True), (6, True)]:
        out = serve(PARAMS, CFG, prompts, slots=slots, max_new_tokens=10, sampling=sampling, seed=4, each_alone=alone)
        assert out.token_ids == full, (slots, alone)
    # a subset keeps its draws when it is given its row ids
    order = [3, 0, 5]
    sub = serve(PARAMS, CFG, [prompts[i] for i in order], slots=2, max_new_tokens=10, sampling=sampling, seed=4,
                request_ids=order, each_alone=True)
    assert sub.token_ids == [full[i] for i in order]


def test_a_tie_in_one_row_leaves_the_other_rows_draws_alone():
    """Top-k draws among the k candidates, and over the vocabulary only in a row whose cutoff tie
    keeps more than k tokens; the other rows keep their candidate draws."""
    from dspark_jax.models.sampling import sample

    cfg = SamplingConfig(1.0, top_k=2)
    sample_jit = jax.jit(lambda keys, logits: sample(keys, logits, cfg))  # 80 draws: one compile, not op by op
    rng = np.random.default_rng(0)
    plain = rng.normal(size=(3, 64)).astype(np.float32)
    tied = plain.copy()
    tied[1, :5] = tied[1].max() + 1.0  # five tokens tie for first place: top-2 keeps all five
    keys = jax.random.split(jax.random.key(7), 3)
    for seed in range(20):
        keys = jax.random.split(jax.random.key(seed), 3)
        a, b = np.asarray(sample_jit(keys, jnp.asarray(plain))), np.asarray(sample_jit(keys, jnp.asarray(tied)))
        assert a[0] == b[0] and a[2] == b[2]
        assert b[1] < 5
    drawn = {int(sample_jit(jax.random.split(jax.random.key(s), 3), jnp.asarray(tied))[1]) for s in range(60)}
    assert drawn == {0, 1, 2, 3, 4}  # every tied token, not only the two top_k returned


def test_a_warmed_program_ran_once_on_zeros_before_the_caller_runs_it():
    """compiled(..., warm=True) executes the new program once (XLA:CPU's costly first execution
    happens at compile time, not in a timed step), on zeros where the arguments are shapes, keys
    included; a cached program is not run again."""
    from dspark_jax.engine.generate import compiled

    seen = []

    @jax.jit
    def step(x, state):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), state["n"])
        return x + state["n"], jax.random.split(state["key"])[0]

    shapes = {"n": jax.ShapeDtypeStruct((3,), jnp.float32), "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}
    x = jnp.ones(3)
    program = compiled(step, (x, shapes), {}, warm=True)
    assert len(seen) == 1 and np.array_equal(seen[0], np.zeros(3))
    assert compiled(step, (x, shapes), {}, warm=True) is program and len(seen) == 1
    out, _ = program(x, {"n": jnp.full(3, 2.0), "key": jax.random.key(1)})
    assert np.array_equal(np.asarray(out), np.full(3, 3.0)) and len(seen) == 2
