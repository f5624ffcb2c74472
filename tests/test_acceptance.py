"""verify_greedy and verify_sampled on their own, against exactly known distributions (DESIGN.md 1).

Sampled verification is checked where a wrong rule would show: every emitted token (accepted drafts,
then the residual sample or the bonus) must follow the target's p at its position, the accepted
lengths must follow prod_k beta_k with beta_k = sum_v min(p_k, q_k), a rejection's token must follow
normalize(max(0, p - q)), and the first three tokens of a whole multi-round decode of a Markov chain
must follow the chain exactly. Each check draws >= 1e5 samples in one jitted call with a fixed seed
and applies a chi-square test (p-value > 1e-4) plus a total-variation bound (4x the distance chance alone gives).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats_helpers import assert_drawn_from

from dspark_jax.engine.acceptance import verify_greedy, verify_sampled
from dspark_jax.models.sampling import SamplingConfig, processed_log_probs

G = 3  # draft tokens per round in the sampled tests
PER_GROUP = 100_000  # samples per num_draft value (rows are split evenly over num_draft = 0..G)


# --------------------------------------------------------------------------------------------------
# Greedy


def test_greedy_exhaustive_against_reference():
    """Every draft sequence x in {0,1,2}^3, every argmax pattern of the target at the 4 verify positions
    and every num_draft in 0..3, in one batch: accepted = the longest scheduled prefix with
    x_k == argmax p_k, bonus = argmax p at the first mismatch (or after the last scheduled token)."""
    V, g = 3, 3
    rows = list(itertools.product(itertools.product(range(V), repeat=g), itertools.product(range(V), repeat=g + 1),
                                  range(g + 1)))
    drafts = np.array([r[0] for r in rows], np.int32)
    best = np.array([r[1] for r in rows], np.int32)
    num_draft = np.array([r[2] for r in rows], np.int32)
    logits = np.random.default_rng(0).normal(size=(len(rows), g + 1, V)).astype(np.float32)
    np.put_along_axis(logits, best[..., None], logits.max(-1, keepdims=True) + 0.5, axis=-1)
    accepted, bonus = jax.jit(verify_greedy)(jnp.asarray(drafts), jnp.asarray(logits), jnp.asarray(num_draft))
    want_accepted = []
    for x, b, n in zip(drafts, best, num_draft):
        a = 0
        while a < n and x[a] == b[a]:
            a += 1
        want_accepted.append(a)
    want_accepted = np.array(want_accepted)
    np.testing.assert_array_equal(np.asarray(accepted), want_accepted)
    np.testing.assert_array_equal(np.asarray(bonus), best[np.arange(len(rows)), want_accepted])
    # the enumeration covers every outcome, including full acceptance of 3 drafts and num_draft = 0
    assert set(want_accepted.tolist()) == {0, 1, 2, 3} and (want_accepted[num_draft == 0] == 0).all()


def test_greedy_stops_at_the_first_mismatch_even_if_later_tokens_match():
    best = np.array([[4, 1, 2, 3, 0]])
    logits = jnp.asarray(np.eye(5, dtype=np.float32)[best] * 3.0)
    drafts = jnp.asarray([[4, 0, 2, 3]], jnp.int32)  # x_2 mismatches, x_3 and x_4 would match
    for n, want in [(0, (0, 4)), (1, (1, 1)), (4, (1, 1))]:
        a, b = verify_greedy(drafts, logits, jnp.asarray([n], jnp.int32))
        assert (int(a[0]), int(b[0])) == want, n
    a, b = verify_greedy(jnp.asarray([[4, 1, 2, 3]], jnp.int32), logits, jnp.asarray([4], jnp.int32))
    assert (int(a[0]), int(b[0])) == (4, 0)  # all accepted: the bonus is argmax p_5


# --------------------------------------------------------------------------------------------------
# Sampled: one round with fixed p_1..p_{G+1} and q_1..q_G


def _normalize(x):
    x = np.asarray(x, np.float64)
    return x / x.sum()


def _processed(seed, V, cfg):
    logits = np.random.default_rng(seed).normal(scale=0.5, size=(V,)).astype(np.float32)
    return np.exp(np.asarray(processed_log_probs(jnp.asarray(logits), cfg), np.float64))


TOPKP = SamplingConfig(temperature=0.9, top_k=4, top_p=0.9)
CASES = {
    # (p, q) at draft position 1; positions 2..G use the same pair with the vocabulary rolled
    "q_mass_where_p_has_none": ([0.6, 0.3, 0.1, 0.0, 0.0], [0.2] * 5),
    "p_mass_where_q_has_none": ([0.1, 0.2, 0.3, 0.4], [0.6, 0.4, 0.0, 0.0]),
    "identical": ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),
    "disjoint": ([0.7, 0.3, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.1, 0.2, 0.3, 0.4]),
    "dense": (_normalize(np.random.default_rng(1).dirichlet(np.ones(5))),
              _normalize(np.random.default_rng(2).dirichlet(np.ones(5)))),
    "top_k_top_p": (_processed(3, 6, TOPKP), _processed(4, 6, TOPKP)),
    "top_p_only": (_processed(5, 6, SamplingConfig(1.0, top_p=0.7)), _processed(6, 6, SamplingConfig(1.0, top_p=0.7))),
}


def case_distributions(name):
    """p [G+1, V] (p_{G+1} is the bonus distribution after all G drafts) and q [G, V], float64."""
    p1, q1 = (np.asarray(_normalize(x)) for x in CASES[name])
    p = np.stack([np.roll(p1, k) for k in range(G)] + [_normalize(np.arange(1, len(p1) + 1) ** 2)])
    q = np.stack([np.roll(q1, k) for k in range(G)])
    return p, q


@functools.partial(jax.jit, static_argnames=("n",))
def sampled_round(key, p, q, num_draft, n):
    """n independent rounds: drafts x_k ~ q_k, then verify_sampled. Returns (drafts, accepted, bonus)."""
    k_draft, k_verify = jax.random.split(key)
    log_p, log_q = jnp.log(p.astype(jnp.float32)), jnp.log(q.astype(jnp.float32))
    g, V = q.shape
    drafts = jax.random.categorical(k_draft, log_q, shape=(n, g)).astype(jnp.int32)
    accepted, bonus = verify_sampled(k_verify, drafts, jnp.broadcast_to(log_q, (n, g, V)),
                                     jnp.broadcast_to(log_p, (n, g + 1, V)), num_draft)
    return drafts, accepted, bonus


def run_round(p, q, seed):
    """PER_GROUP rounds for each num_draft in 0..G, interleaved in one batch (masking is per row)."""
    n = PER_GROUP * (G + 1)
    num_draft = jnp.arange(n, dtype=jnp.int32) % (G + 1)
    out = sampled_round(jax.random.key(seed), jnp.asarray(p), jnp.asarray(q), num_draft, n)
    return np.asarray(num_draft), *(np.asarray(x) for x in out)


def emitted_tokens(drafts, accepted, bonus):
    """[n, G+1] the round's emitted tokens x_1..x_a then the bonus; -1 past the bonus."""
    slot = np.arange(G + 1)[None, :]
    padded = np.pad(drafts, ((0, 0), (0, 1)), constant_values=-1)
    return np.where(slot < accepted[:, None], padded, np.where(slot == accepted[:, None], bonus[:, None], -1))


@pytest.mark.parametrize("case", list(CASES))
def test_every_emitted_token_follows_the_target(case):
    """Given that a round reached position j (tokens 1..j-1 were accepted drafts), the token it emits
    there (the accepted draft, else the residual sample, else - after all num_draft drafts - the
    bonus from p_j) is distributed as p_j; for num_draft = 0 the only token is a sample of p_1."""
    p, q = case_distributions(case)
    V = p.shape[1]
    num_draft, drafts, accepted, bonus = run_round(p, q, seed=11)
    beta = np.minimum(p[:G], q).sum(-1)
    assert (accepted <= num_draft).all()
    tokens = emitted_tokens(drafts, accepted, bonus)
    for n in range(G + 1):
        rows = num_draft == n
        for j in range(n + 1):  # 0-based position j: emitted iff accepted >= j
            reached = rows & (accepted >= j)
            if np.prod(beta[:j]) == 0:  # no round gets here (disjoint supports)
                assert not reached.any()
                continue
            counts = np.bincount(tokens[reached, j], minlength=V)
            assert_drawn_from(counts, p[j], f"{case}: num_draft {n}, position {j + 1}")


@pytest.mark.parametrize("case", list(CASES))
def test_acceptance_lengths_and_residual(case):
    """P(accepted = a) = beta_1 ... beta_a (1 - beta_{a+1}) (the last factor absent at a = num_draft),
    and the token emitted at a rejection follows normalize(max(0, p - q))."""
    p, q = case_distributions(case)
    V = p.shape[1]
    num_draft, drafts, accepted, bonus = run_round(p, q, seed=12)
    beta = np.minimum(p[:G], q).sum(-1)
    for n in range(G + 1):
        rows = num_draft == n
        want = np.array([np.prod(beta[:a]) * (1 - beta[a] if a < n else 1.0) for a in range(n + 1)])
        assert_drawn_from(np.bincount(accepted[rows], minlength=n + 1), want / want.sum(), f"{case}: lengths, n={n}")
        for j in range(n):
            rejected = rows & (accepted == j)
            if np.prod(beta[:j]) > 0 and beta[j] < 1 - 1e-9:
                residual = _normalize(np.maximum(p[j] - q[j], 0.0))
                assert_drawn_from(np.bincount(bonus[rejected], minlength=V), residual,
                                  f"{case}: residual at position {j + 1}, n={n}")
            else:
                assert not rejected.any()
        full = rows & (accepted == n)  # every scheduled draft accepted: the bonus comes from p_{n+1}
        if np.prod(beta[:n]) == 0:
            assert not full.any()
            continue
        assert_drawn_from(np.bincount(bonus[full], minlength=V), p[n], f"{case}: bonus after {n}")


def test_edge_cases_are_exact():
    """p = q: every scheduled draft is accepted; disjoint supports: none is; p(x) = 0: never accepted."""
    for case, want in [("identical", lambda n: n), ("disjoint", lambda n: 0 * n)]:
        p, q = case_distributions(case)
        num_draft, _, accepted, _ = run_round(p, q, seed=13)
        np.testing.assert_array_equal(accepted, want(num_draft))
    p, q = case_distributions("q_mass_where_p_has_none")
    num_draft, drafts, accepted, bonus = run_round(p, q, seed=14)
    first_impossible = p[0][drafts[:, 0]] == 0
    assert first_impossible.any() and (accepted[first_impossible] == 0).all()
    assert (p[0][bonus[(accepted == 0)]] > 0).all()  # the emitted token always has target mass


# --------------------------------------------------------------------------------------------------
# Sampled: a whole multi-round decode of a context-dependent target


def markov_tables(V=4, seed=0):
    """Target P[prev] and draft Q[prev] rows (next-token distributions given the previous token) that
    overlap partly, with zeros on both sides."""
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.ones(V), size=V)
    Q = rng.dirichlet(np.ones(V) * 0.5, size=V)
    P[0, 3] = 0.0  # p has no mass where q may have some
    Q[1, 2] = Q[2, 0] = 0.0  # q has no mass where p has some
    Q[3] = P[3]  # one context where the drafter is exact
    return P / P.sum(1, keepdims=True), Q / Q.sum(1, keepdims=True)


@functools.partial(jax.jit, static_argnames=("n", "length", "g", "random_num_draft"))
def markov_decode(key, P, Q, anchor, *, n, length, g, random_num_draft):
    """Speculative decoding of n sequences of `length` tokens after `anchor`: each round drafts g tokens
    from Q (x_k ~ Q[x_{k-1}]), verifies num_draft of them (g, or uniform in 0..g drawn independently of
    the tokens) against P with verify_sampled, and emits the accepted drafts then the bonus."""
    log_P, log_Q = jnp.log(P), jnp.log(Q)
    out = jnp.full((n, length), -1, jnp.int32)
    count = jnp.zeros((n,), jnp.int32)
    anchor = jnp.full((n,), anchor, jnp.int32)
    rows = jnp.arange(n)[:, None]
    for key_round in jax.random.split(key, length):  # every round emits at least one token
        k_draft, k_sched, k_verify = jax.random.split(key_round, 3)
        prev, drafts = anchor, []
        for k_tok in jax.random.split(k_draft, g):
            prev = jax.random.categorical(k_tok, log_Q[prev]).astype(jnp.int32)
            drafts.append(prev)
        drafts = jnp.stack(drafts, 1)  # [n, g]
        verify_tokens = jnp.concatenate([anchor[:, None], drafts], 1)  # [n, g+1]
        num_draft = (jax.random.randint(k_sched, (n,), 0, g + 1) if random_num_draft
                     else jnp.full((n,), g, jnp.int32))
        accepted, bonus = verify_sampled(k_verify, drafts, log_Q[verify_tokens[:, :g]], log_P[verify_tokens],
                                         num_draft)
        slot = jnp.arange(g + 1)[None, :]
        emitted = jnp.where(slot < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus[:, None])
        write_at = jnp.where(slot <= accepted[:, None], count[:, None] + slot, length)
        out = out.at[rows, write_at].set(emitted, mode="drop")
        count, anchor = count + accepted + 1, bonus
    return out


@pytest.mark.parametrize("random_num_draft", [False, True], ids=["num_draft=g", "num_draft=random"])
def test_multi_round_decode_follows_the_chain_exactly(random_num_draft):
    """The joint distribution of the first 3 emitted tokens (64 cells) of 2e5 decodes is exactly
    P[x0, x1] P[x1, x2] P[x2, x3]: accepted drafts, residual samples and bonus tokens chained over rounds.
    The marginals of the first two tokens and their pair are checked as well."""
    V, length, n, x0 = 4, 3, 200_000, 1
    P, Q = markov_tables(V)
    out = np.asarray(markov_decode(jax.random.key(21), jnp.asarray(P, jnp.float32), jnp.asarray(Q, jnp.float32), x0,
                                   n=n, length=length, g=G, random_num_draft=random_num_draft))
    assert (out >= 0).all()
    joint = np.einsum("a,ab,bc->abc", P[x0], P, P)  # [x1, x2, x3]
    counts = np.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2], minlength=V ** 3)
    assert_drawn_from(counts, joint, "first 3 tokens")
    assert_drawn_from(np.bincount(out[:, 0] * V + out[:, 1], minlength=V * V), joint.sum(2), "first 2 tokens")
    for j in range(length):
        assert_drawn_from(np.bincount(out[:, j], minlength=V), joint.sum(tuple(i for i in range(3) if i != j)),
                          f"token {j + 1}")
