"""Confidence-scheduled verification (DESIGN.md 3): Algorithm 1, the async variant, SPS tables."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.engine.acceptance import verify_sampled
from dspark_jax.engine.scheduler import (
    AsyncSchedulerState, admit_top_k, global_capacity, init_async_state, schedule_dspark, schedule_dspark_async,
    schedule_fixed, schedule_mtp1, schedule_threshold, survival_from_logits,
)
from dspark_jax.engine.sps import (
    SPSTable, load_sps_table, pad_to_bucket, profile_sps, save_sps_table, sps_of, token_buckets,
)
from dspark_jax.core.errors import UserError

dspark_jit = jax.jit(schedule_dspark)
capacity_jit = jax.jit(global_capacity)
top_k_jit = jax.jit(admit_top_k)
async_jit = jax.jit(schedule_dspark_async)


# ------------------------------------------------------------------------------------------------
# References (plain Python, float64)


def sps_ref(buckets, values, n):
    for b, v in zip(buckets, values):
        if b >= n:
            return float(v)
    return 0.0


def candidates_ref(a, active):
    """(a, j, r) for active rows with a > 0, in Algorithm-1 order (a desc, then j, then r)."""
    R, g = a.shape
    c = [(float(a[r, j]), j, r) for r in range(R) for j in range(g) if active[r] and a[r, j] > 0]
    return sorted(c, key=lambda t: (-t[0], t[1], t[2]))


def algorithm1_ref(a, active, buckets, values):
    """DESIGN.md 3.1 step by step."""
    R = a.shape[0]
    l = [0] * R
    B = int(np.sum(active))
    tau = float(B)
    best = tau * sps_ref(buckets, values, B)
    for v, j, r in candidates_ref(a, active):
        B += 1
        tau += v
        theta = tau * sps_ref(buckets, values, B)
        if theta > best:
            best = theta
            l[r] = j + 1
        else:
            break
    return l


def theta_of(l, a, active, buckets, values):
    Ra = int(np.sum(active))
    tau = Ra + sum(float(np.sum(a[r, : l[r]], dtype=np.float64)) for r in range(len(l)))
    return tau * sps_ref(buckets, values, Ra + sum(l))


def brute_force_best(a, active, buckets, values):
    """max Theta over every prefix-respecting allocation (l_r <= #positive a in row r)."""
    ranges = [range(int(np.sum(a[r] > 0)) + 1) if active[r] else [0] for r in range(a.shape[0])]
    return max(theta_of(list(ls), a, active, buckets, values) for ls in itertools.product(*ranges))


def capacity_ref(a, active, buckets, values):
    c = candidates_ref(a, active)
    Ra = int(np.sum(active))
    thetas = [(Ra + sum(v for v, _, _ in c[:K])) * sps_ref(buckets, values, Ra + K) for K in range(len(c) + 1)]
    return int(np.argmax(thetas)), max(thetas)


def random_survival(rng, R, g, quantized=False, levels=8):
    if quantized:  # multiples of 1/levels (dyadic): exact in float32, so ties (in a, Theta) really happen
        a = -np.sort(-rng.integers(0, levels + 1, size=(R, g)), axis=1) / levels
    else:
        a = np.cumprod(rng.uniform(0.2, 1.0, size=(R, g)), axis=1)
        a[rng.random((R, g)) < 0.1] = 0.0
        a = np.minimum.accumulate(a, axis=1)
    return a.astype(np.float32)


def table_arrays(buckets, values):
    return jnp.asarray(buckets, jnp.int32), jnp.asarray(np.asarray(values, np.float32))


# ------------------------------------------------------------------------------------------------
# DESIGN.md 3.1 counterexample: why the early stop is required

A, B_ = 0, 1
P_TARGET = np.array([0.7, 0.3])
Q_DRAFT = np.array([0.5, 0.5])
CE_BUCKETS, CE_SPS = (1, 2, 3), (1.0, 0.5, 0.45)


def ce_survival(x1):
    """One request, gamma = 2: a_1 = 0.8; c_2 = 0.9 after A, 0 after B."""
    return np.array([[0.8, 0.8 * (0.9 if x1 == A else 0.0)]], np.float32)


def ours(a):
    return schedule_dspark(a, None, *table_arrays(CE_BUCKETS, CE_SPS))


def global_search(a):
    """A scheduler without early stop: best prefix length by unconstrained search on the CURRENT
    confidences (= global_capacity then top-K admission applied to the same step)."""
    return admit_top_k(a, None, global_capacity(a, None, *table_arrays(CE_BUCKETS, CE_SPS)))


def first_token_prob_a(policy) -> float:
    """Exact P(first output token = A): enumerate x_1 ~ q and the rejection-sampling outcome."""
    residual = np.maximum(P_TARGET - Q_DRAFT, 0)
    residual /= residual.sum()
    total = 0.0
    for x1 in (A, B_):
        l = int(np.asarray(policy(jnp.asarray(ce_survival(x1))))[0])
        if l == 0:  # nothing verified: the first token is the target's bonus sample from p
            p_a = P_TARGET[A]
        else:  # x_1 verified: kept w.p. min(1, p/q), else replaced by a residual sample
            acc = min(1.0, P_TARGET[x1] / Q_DRAFT[x1])
            p_a = acc * (x1 == A) + (1 - acc) * residual[A]
        total += Q_DRAFT[x1] * p_a
    return total


def test_counterexample_exact():
    # The schedules themselves: the global search verifies x_1 only when x_1 = A ...
    assert int(global_search(ce_survival(A))[0]) == 2 and int(global_search(ce_survival(B_))[0]) == 0
    # ... Algorithm 1 stops at Theta_1 = 1.8 * 0.5 = 0.9 < 1.0 whatever x_1 is.
    assert int(ours(ce_survival(A))[0]) == 0 and int(ours(ce_survival(B_))[0]) == 0
    assert first_token_prob_a(global_search) == pytest.approx(0.85, abs=1e-12)
    assert first_token_prob_a(ours) == pytest.approx(0.7, abs=1e-12)
    # Any schedule that does not look at x_1 is lossless too (sanity check of the enumeration).
    assert first_token_prob_a(lambda a: jnp.ones((1,), jnp.int32)) == pytest.approx(0.7, abs=1e-12)


@pytest.mark.parametrize("queued", [0, 1, 2])
def test_counterexample_async_is_lossless(queued):
    """With a capacity queued from earlier steps, the decision to verify x_1 ignores x_1."""
    state = init_async_state(queued)
    buckets, values = table_arrays(CE_BUCKETS, CE_SPS)
    policy = lambda a: schedule_dspark_async(state, a, None, buckets, values)[0]  # noqa: E731
    assert first_token_prob_a(policy) == pytest.approx(0.7, abs=1e-12)


def test_counterexample_monte_carlo():
    n = 100_000
    k_x, k_verify = jax.random.split(jax.random.key(0))
    log_q = jnp.log(jnp.asarray(Q_DRAFT, jnp.float32))
    log_p = jnp.log(jnp.asarray(P_TARGET, jnp.float32))
    drafts = jax.random.categorical(k_x, log_q, shape=(n, 2)).astype(jnp.int32)  # x_1, x_2 ~ q
    c2 = jnp.where(drafts[:, 0] == A, 0.9, 0.0)
    a = jnp.stack([jnp.full((n,), 0.8), 0.8 * c2], axis=1)[:, None, :]  # [n, R=1, gamma=2]
    draft_lp = jnp.broadcast_to(log_q, (n, 2, 2))
    target_lp = jnp.broadcast_to(log_p, (n, 3, 2))
    freqs = {}
    for name, policy in (("ours", ours), ("global", global_search)):
        l = jax.jit(jax.vmap(lambda s: policy(s)[0]))(a)  # one independent request per sample
        accepted, bonus = verify_sampled(k_verify, drafts, draft_lp, target_lp, l)
        first = jnp.where(accepted >= 1, drafts[:, 0], bonus)
        freqs[name] = float(jnp.mean(first == A))
    # Standard error ~0.0015: ten of them below.
    assert abs(freqs["ours"] - 0.7) < 0.015, freqs
    assert abs(freqs["global"] - 0.85) < 0.015, freqs


# ------------------------------------------------------------------------------------------------
# Algorithm 1


def hyperbolic_table(n_max, c0, s):
    """SPS(B) = 1 / (c0 + s B): a step time affine in the tokens, one bucket per token count."""
    buckets = tuple(range(1, n_max + 1))
    return buckets, tuple(float(np.float32(1.0 / (c0 + s * b))) for b in buckets)


def linear_table(n_max, s):
    """SPS(B) = 1 - s B (positive on the table): log-concave."""
    buckets = tuple(range(1, n_max + 1))
    return buckets, tuple(float(np.float32(1.0 - s * b)) for b in buckets)


def test_algorithm1_is_optimal_on_unimodal_cases():
    """If Theta(K) = (R + S_K) SPS(R + K) is unimodal in K the early stop loses nothing: S_K is
    concave (sorted gains), and concave / affine (hyperbolic SPS) is quasi-concave, concave x affine
    (linear SPS) is log-concave. The best allocation of K tokens is the top-K set, so the optimum
    over all prefix-respecting allocations is max_K Theta(K)."""
    rng = np.random.default_rng(1)
    n_max = 12  # >= R * (gamma + 1) for R, gamma <= 3: one compiled shape per (R, gamma)
    for trial in range(120):
        R, g = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        a = random_survival(rng, R, g)
        active = rng.random(R) < 0.8
        if trial % 2:
            buckets, values = hyperbolic_table(n_max, c0=rng.uniform(0.5, 2.0), s=rng.uniform(0.01, 0.5))
        else:
            buckets, values = linear_table(n_max, s=rng.uniform(0.005, 0.08))
        l = np.asarray(dspark_jit(a, active, *table_arrays(buckets, values)))
        assert np.all(l[~active] == 0)
        best = brute_force_best(a, active, buckets, values)
        assert theta_of(list(l), a, active, buckets, values) == pytest.approx(best, rel=1e-5), (a, active, l)


@pytest.mark.parametrize("quantized", [False, True])
def test_algorithm1_matches_python_reference(quantized):
    """Random survival (generic, or multiples of 1/8 with many ties in a and in Theta), inactive
    rows, and jagged bucketed tables: the vectorised walk equals the literal loop."""
    rng = np.random.default_rng(2 + quantized)
    buckets = token_buckets(4 * 5)  # R <= 4, gamma <= 4 -> at most 20 tokens
    for _ in range(150):
        R, g = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        a = random_survival(rng, R, g, quantized)
        active = rng.random(R) < 0.75
        if quantized:  # dyadic SPS: every tau * SPS is exact in float32, so Theta ties are real ties
            values = tuple(sorted(rng.integers(1, 17, size=len(buckets)) / 16.0, reverse=bool(rng.random() < 0.7)))
        else:
            values = tuple(np.sort(rng.uniform(0.05, 1.0, size=len(buckets)))[::-1].astype(np.float32))
            if rng.random() < 0.3:  # jagged: a faster bucket after a slower one
                values = tuple(np.asarray(values)[rng.permutation(len(values))])
        l = np.asarray(dspark_jit(a, active, *table_arrays(buckets, values)))
        assert list(l) == algorithm1_ref(a, active, buckets, values), (a, active, values)
        assert l.dtype == np.int32 and l.shape == (R,)


def test_algorithm1_edge_cases():
    buckets, values = table_arrays((1, 2, 4, 8), (1.0, 0.9, 0.8, 0.7))
    a = np.array([[0.9, 0.8], [0.9, 0.1]], np.float32)
    # No active request: nothing to verify.
    assert list(np.asarray(dspark_jit(a, np.zeros(2, bool), buckets, values))) == [0, 0]
    # Beyond the largest bucket SPS is 0, so B never exceeds it even with certain acceptance.
    a = np.ones((3, 4), np.float32)
    l = np.asarray(dspark_jit(a, np.ones(3, bool), buckets, values))
    assert 3 + l.sum() <= 8 and list(l) == algorithm1_ref(a, np.ones(3, bool), (1, 2, 4, 8), (1.0, 0.9, 0.8, 0.7))
    # A free table (flat SPS) verifies every candidate with a > 0, and no zero-survival token.
    flat = table_arrays(tuple(range(1, 17)), (1.0,) * 16)
    a = np.array([[0.9, 0.5, 0.0], [0.3, 0.0, 0.0]], np.float32)
    assert list(np.asarray(dspark_jit(a, None, *flat))) == [2, 1]


def budget(a_row, R, table):
    a = np.tile(a_row, (R, 1))
    return float(np.mean(np.asarray(dspark_jit(a, np.ones(R, bool), *table_arrays(*table)))))


def test_budgets_shrink_with_steeper_sps_and_more_requests():
    a_row = np.cumprod([0.97, 0.93, 0.9, 0.85, 0.8, 0.7, 0.6]).astype(np.float32)  # gamma = 7
    n_max = 32 * 8
    by_slope = [budget(a_row, 4, hyperbolic_table(n_max, 1.0, s)) for s in (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 10.0)]
    assert by_slope[0] == 7 and by_slope[-1] == 0
    assert all(x >= y for x, y in zip(by_slope, by_slope[1:])) and len(set(by_slope)) > 3, by_slope
    by_r = [budget(a_row, R, hyperbolic_table(n_max, 1.0, 0.05)) for R in (1, 2, 4, 8, 16, 32)]
    assert all(x >= y for x, y in zip(by_r, by_r[1:])) and by_r[0] == 7 and by_r[-1] <= 3, by_r


# ------------------------------------------------------------------------------------------------
# Baselines


def test_baseline_policies():
    active = jnp.array([True, False, True])
    assert list(np.asarray(schedule_fixed(active, 5))) == [5, 0, 5]
    assert list(np.asarray(schedule_mtp1(active, 5))) == [1, 0, 1]
    a = jnp.array([[0.9, 0.6, 0.5, 0.1], [0.9, 0.9, 0.9, 0.9], [0.4, 0.3, 0.2, 0.1]])
    assert list(np.asarray(jax.jit(schedule_threshold)(a, 0.5, active))) == [3, 0, 0]
    assert list(np.asarray(schedule_threshold(a, 0.5))) == [3, 4, 0]
    z = jnp.array([[2.0, 1.0, 0.0]])
    t = jnp.array([2.0, 1.0, 0.5])
    expected = np.cumprod(1 / (1 + np.exp(-np.array([1.0, 1.0, 0.0]))))
    np.testing.assert_allclose(np.asarray(survival_from_logits(z, t))[0], expected, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Asynchronous variant


def test_global_capacity_equals_brute_force():
    """Argmax over K of (R + top-K sum) SPS(R + K) — also the optimum over all prefix-respecting
    allocations, jagged tables included (where the early stop can get trapped)."""
    rng = np.random.default_rng(4)
    buckets = token_buckets(12)
    trapped = 0
    for trial in range(120):
        R, g = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        a = random_survival(rng, R, g, quantized=trial % 2 == 1)
        active = rng.random(R) < 0.8
        values = tuple(rng.uniform(0.05, 1.0, size=len(buckets)).astype(np.float32))
        K = int(capacity_jit(a, active, *table_arrays(buckets, values)))
        k_ref, best = capacity_ref(a, active, buckets, values)
        assert K == k_ref
        assert best == pytest.approx(brute_force_best(a, active, buckets, values), rel=1e-6)
        l = algorithm1_ref(a, active, buckets, values)
        trapped += theta_of(l, a, active, buckets, values) < best * (1 - 1e-6)
    assert trapped > 0  # jagged tables do trap the early stop: the reason for the async variant


def test_admit_top_k():
    # Ties across rows go to the smaller j: (r=1, j=1) before (r=0, j=2).
    assert list(np.asarray(admit_top_k(np.array([[0.5, 0.5], [0.5, 0.0]], np.float32), None, 2))) == [1, 1]
    rng = np.random.default_rng(5)
    for trial in range(200):
        R, g = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        a = random_survival(rng, R, g, quantized=trial % 2 == 1, levels=4)
        active = rng.random(R) < 0.8
        cands = candidates_ref(a, active)
        K = int(rng.integers(0, R * g + 3))
        l = np.asarray(top_k_jit(a, active, K))
        assert l.sum() == min(K, len(cands))
        admitted = {(r, j) for r in range(R) for j in range(l[r])}  # a length = a prefix
        assert admitted == {(r, j) for _, j, r in cands[:K]}  # exactly the top-K, ties by (j, r)
        assert np.all(l[~active] == 0) and np.all(l <= np.sum(a > 0, axis=1))


def test_async_uses_capacity_from_two_steps_earlier():
    rng = np.random.default_rng(6)
    R, g = 4, 3
    buckets, values = token_buckets(R * (g + 1)), (1.0, 0.95, 0.9, 0.7, 0.5)
    tb = table_arrays(buckets, values)
    steps = [(random_survival(rng, R, g), rng.random(R) < 0.8) for _ in range(6)]
    state = init_async_state(3)
    pushed = []
    for t, (a, active) in enumerate(steps):
        l, state = async_jit(state, a, active, *tb)
        expected_k = 3 if t < 2 else pushed[t - 2]
        assert list(np.asarray(l)) == list(np.asarray(admit_top_k(a, active, expected_k)))
        assert int(np.sum(l)) == min(expected_k, len(candidates_ref(a, active)))
        pushed.append(capacity_ref(a, active, buckets, values)[0])
        assert list(np.asarray(state.capacity)) == ([3] + pushed)[-2:]


def test_async_capacity_ignores_current_confidences():
    """The K used now depends only on the queue, not on this step's confidences or tokens."""
    tb = table_arrays(token_buckets(16), (1.0, 0.9, 0.8, 0.6, 0.4))
    state = AsyncSchedulerState(jnp.array([2, 5], jnp.int32))
    high = np.full((3, 4), 0.99, np.float32).cumprod(axis=1)
    low = np.full((3, 4), 0.3, np.float32).cumprod(axis=1)
    for a in (high, low):
        l, new = schedule_dspark_async(state, a, None, *tb)
        assert int(np.sum(l)) == 2
        assert int(new.capacity[0]) == 5 and int(new.capacity[1]) == int(global_capacity(a, None, *tb))
    # Clamp: R_active + K never exceeds the largest bucket.
    l, _ = schedule_dspark_async(AsyncSchedulerState(jnp.array([100, 0], jnp.int32)), high, None, *tb)
    assert 3 + int(np.sum(l)) <= 16


# ------------------------------------------------------------------------------------------------
# SPS tables


def test_token_buckets_and_padding():
    assert token_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert token_buckets(16) == (1, 2, 4, 8, 16)
    assert token_buckets(1) == (1,)
    buckets = token_buckets(40)
    table = SPSTable(buckets, tuple(1.0 / b for b in buckets))
    for n in range(1, 41):
        padded = int(pad_to_bucket(buckets, n))
        assert padded == min(b for b in buckets if b >= n)
        assert float(sps_of(table, n)) == pytest.approx(1.0 / padded)
    assert int(pad_to_bucket(jnp.asarray(buckets), jnp.int32(33))) == 40


def test_sps_of_numpy_and_jit():
    table = SPSTable((1, 2, 4, 8), (10.0, 9.0, 7.0, 4.0))
    ns = [0, 1, 2, 3, 4, 5, 8, 9, 100]
    expected = [10.0, 10.0, 9.0, 7.0, 7.0, 4.0, 4.0, 0.0, 0.0]
    assert [float(sps_of(table, n)) for n in ns] == expected
    assert list(sps_of(table, np.array(ns))) == expected
    traced = jax.jit(lambda n: sps_of(table, n))(jnp.asarray(ns, jnp.int32))
    assert list(np.asarray(traced)) == expected
    # Hashable, so it can be a static jit argument (e.g. inside the engine's static config).
    static = jax.jit(sps_of, static_argnums=0)
    assert float(static(table, jnp.int32(3))) == 7.0
    assert hash(table) == hash(SPSTable((1, 2, 4, 8), (10.0, 9.0, 7.0, 4.0)))


def test_sps_table_json_round_trip_and_errors(tmp_path):
    table = SPSTable((1, 2, 4), (100.5, 90.25, 50.0), device="NVIDIA H200", model="qwen3-8b tp=1",
                     created="2026-01-01T00:00:00+00:00")
    path = tmp_path / "new_cache_folder" / "sps.json"  # created on save (a fresh checkout has no .dspark_cache/)
    save_sps_table(path, table)
    assert load_sps_table(path, device="NVIDIA H200", model="qwen3-8b tp=1", buckets=(1, 2, 4)) == table
    assert load_sps_table(str(path)) == table

    with pytest.raises(UserError, match=r"profiled on device 'NVIDIA H200', not on this device 'cpu'") as e:
        load_sps_table(path, device="cpu", model="qwen3-8b tp=1")
    assert "\n" not in str(e.value) and "re-profile" in str(e.value)
    with pytest.raises(UserError, match=r"profiled for model 'qwen3-8b tp=1', not 'llama-3-8b'"):
        load_sps_table(path, device="NVIDIA H200", model="llama-3-8b")
    with pytest.raises(UserError, match=r"covers token buckets \[1, 2, 4\], but the engine uses \[1, 2, 4, 8\]"):
        load_sps_table(path, buckets=(1, 2, 4, 8))
    with pytest.raises(UserError, match="no such SPS table .*; profile the verify step first"):
        load_sps_table(tmp_path / "missing.json")

    bad = tmp_path / "bad.json"
    obj = table.to_json()
    for content in ["{not json", json.dumps({"format": "something else"}),
                    json.dumps({k: v for k, v in obj.items() if k != "sps"}),
                    json.dumps(dict(obj, buckets=[4, 2, 1])), json.dumps(dict(obj, sps=[1.0, -2.0, 3.0])),
                    json.dumps(dict(obj, sps=[1.0])), json.dumps(dict(obj, version=99))]:
        bad.write_text(content)
        with pytest.raises(UserError) as e:
            load_sps_table(bad)
        assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_profile_sps_with_a_fake_clock():
    """SPS = 1 / median seconds per timed call; warmup calls are not timed."""
    now = [0.0]
    calls = []
    durations = {1: [9.0, 9.0, 0.1, 0.1, 5.0], 4: [9.0, 9.0, 0.5, 0.25, 0.25]}  # 2 warmup + 3 repeats

    def step(b):
        calls.append(b)
        now[0] += durations[b][sum(c == b for c in calls) - 1]
        return jnp.zeros(())

    table = profile_sps(step, (1, 4), warmup=2, repeats=3, model="fake", clock=lambda: now[0])
    assert table.buckets == (1, 4) and table.model == "fake" and table.device == jax.devices()[0].device_kind
    assert table.sps == pytest.approx((10.0, 4.0))
    assert calls == [1] * 5 + [4] * 5 and table.created


def test_profile_sps_with_sleeps():
    import time

    def step(b):
        time.sleep(0.001 if b <= 2 else 0.02)
        return jnp.zeros((b,))

    table = profile_sps(step, (1, 2, 4, 8), warmup=1, repeats=3, device="cpu", model="fake")
    assert table.buckets == (1, 2, 4, 8) and len(table.sps) == 4 and table.device == "cpu"
    assert all(np.isfinite(table.sps)) and all(s > 0 for s in table.sps)
    assert min(table.sps[:2]) > max(table.sps[2:])  # the clearly slower buckets get a lower SPS


def test_sps_code_tag_follows_the_decoding_code(tmp_path, monkeypatch):
    """A cached table's key holds a hash of the code a round runs (`sps.code_tag`): another version
    of any of those modules gets a table of its own instead of the old one's costs."""
    from dspark_jax.engine import sps

    for name, body in (("round_mod_a", "x = 1\n"), ("round_mod_b", "y = 2\n")):
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sps, "_ROUND_MODULES", ("round_mod_a", "round_mod_b"))
    sps.code_tag.cache_clear()
    before = sps.code_tag()
    (tmp_path / "round_mod_b.py").write_text("y = 3\n")
    sps.code_tag.cache_clear()
    after = sps.code_tag()
    sps.code_tag.cache_clear()
    assert before != after and len(before) == 8
