"""Confidence-scheduled verification: how many draft tokens each request verifies (DESIGN.md 3).

Everything here is pure JAX over static shapes (jit / vmap safe, no Python per-request branching).
Input is the SURVIVAL array `a [R, gamma]`: a[r, j-1] = prod_{i<=j} c_{r,i}, the calibrated
probability that the first j draft tokens of request r are all accepted (non-increasing along j),
plus an `active [R]` mask (inactive rows verify nothing and do not count in R). Output is
`l [R] int32`: request r verifies its anchor and draft tokens x_1..x_{l_r} (B = R + sum l tokens).

Policies
--------
* `schedule_fixed` (l = gamma), `schedule_mtp1` (l = 1), `schedule_threshold` (verify while
  a_{r,j} >= h): the baselines of DESIGN.md 3.3.
* `schedule_dspark`: Algorithm 1 (DESIGN.md 3.1). Walk the candidates (r, j), a_{r,j} > 0, by a
  descending (ties: smaller j, then smaller r), adding one token at a time: B += 1, tau += a,
  Theta = tau * SPS(B); keep going while Theta strictly improves and STOP at the first
  non-improvement. Implemented as sort + cumulative sums + "leading run of improvements".
* `global_capacity` + `admit_top_k` + `schedule_dspark_async`: the asynchronous variant
  (DESIGN.md 3.2).

Why the early stop is required (losslessness)
---------------------------------------------
Rejection sampling is exact only if the decision "verify x_{r,j}" does not depend on the value of
x_{r,j} itself (given everything before it): the number of verified tokens must be a stopping time
of the draft sequence. But c_{r,j+1} is computed from the sampled x_{r,j} (Markov head), so
a_{r,j+1} carries information about x_{r,j}. With the early stop, whether (r, j) is admitted depends
only on candidates ranked BEFORE it in the walk: other requests' candidates and (r, i<j), whose
confidences depend on x_{r,<j} only — never on x_{r,j}. A search that looks past the first drop
(e.g. "argmax over all prefix lengths") lets a_{r,j+1}, hence x_{r,j}, decide whether x_{r,j} is
verified. DESIGN.md's counterexample (tests/test_scheduler.py reproduces it): one request, gamma=2,
a_1 = 0.8, SPS(1)=1, SPS(2)=0.5, SPS(3)=0.45, p = (0.7, 0.3), q = (0.5, 0.5), c_2 = 0.9 after A and
0 after B. The global search verifies x_1 only when x_1 = A and outputs A with probability 0.85;
Algorithm 1 stops at Theta_1 = 0.9 < 1.0 for both draws and outputs exactly p.

Why the asynchronous variant is also lossless (non-anticipating)
--------------------------------------------------------------
A zero-overhead pipeline fixes step t's batch size before step t-1 finishes, and real SPS curves
are jagged (cliffs at buckets) which traps the early stop. So the capacity K (draft tokens to verify
in total) used at step t is computed by an UNCONSTRAINED global search (argmax over K, no early stop)
from the survival of step t-2; step t then admits its K candidates with the largest CURRENT survival
(`admit_top_k`). K is a function of past rounds only, i.e. a constant given the history when step
t's draft is sampled, and with a constant K, (r, j) is admitted iff fewer than K candidates rank
above it, and those are other requests' candidates and (r, i<j) — again independent of x_{r,j}.
The global search is harmless there because it never sees the tokens it schedules.

`AsyncSchedulerState` is a 2-deep queue of CAPACITIES (int32 K values), not of survival arrays:
the global search runs in the step that produced the confidences (off the critical path, its result
is a scalar), and the value it pushes is popped two calls later.

Ties and floating point: the candidate order is a stable sort of -a over a j-major flattening
(index j*R + r), i.e. a descending, then smaller j, then smaller r. Because a is non-increasing
along j (enforced with a running minimum, a no-op for true cumulative products), every prefix of
this order is prefix-closed per request, so counting admitted candidates per row gives l_r.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.engine.sps import sps_lookup

__all__ = [
    "survival_from_logits", "schedule_fixed", "schedule_mtp1", "schedule_threshold", "schedule_dspark",
    "global_capacity", "admit_top_k", "AsyncSchedulerState", "init_async_state", "schedule_dspark_async",
]


# ------------------------------------------------------------------------------------------------
# Inputs and baselines


def survival_from_logits(confidence_logits: jax.Array, temperatures: jax.Array | None = None) -> jax.Array:
    """a[r, j] = prod_{i<=j} sigmoid(z_{r,i} / T_i): calibrated (STS) prefix survival, [R, gamma]."""
    z = jnp.asarray(confidence_logits, jnp.float32)
    if temperatures is not None:
        z = z / jnp.asarray(temperatures, jnp.float32)[: z.shape[-1]]
    return jnp.cumprod(jax.nn.sigmoid(z), axis=-1)


def _active(active: jax.Array | None, R: int) -> jax.Array:
    return jnp.ones((R,), bool) if active is None else jnp.asarray(active, bool)


def schedule_fixed(active: jax.Array, gamma: int) -> jax.Array:
    """Every active request verifies all gamma draft tokens (DFlash / Eagle3 style)."""
    return jnp.where(jnp.asarray(active, bool), jnp.int32(gamma), jnp.int32(0))


def schedule_mtp1(active: jax.Array, gamma: int) -> jax.Array:
    """Every active request verifies one draft token (old DeepSeek production policy, "MTP-1")."""
    return jnp.where(jnp.asarray(active, bool), jnp.int32(min(1, gamma)), jnp.int32(0))


def schedule_threshold(a: jax.Array, h: float, active: jax.Array | None = None) -> jax.Array:
    """Verify while a_{r,j} >= h (static threshold, SpecDec++ style)."""
    a = _monotone(a)
    n = jnp.sum(a >= h, axis=-1).astype(jnp.int32)  # a is non-increasing: a count is a prefix length
    return jnp.where(_active(active, a.shape[0]), n, 0)


# ------------------------------------------------------------------------------------------------
# Shared machinery: candidates in walk order


def _monotone(a: jax.Array) -> jax.Array:
    """Running minimum along gamma: a no-op for cumulative products of confidences in [0, 1]
    (kept so that admitted sets are prefix-closed even for slightly inconsistent inputs)."""
    return jax.lax.cummin(jnp.asarray(a, jnp.float32), axis=a.ndim - 1)


def _walk_order(a: jax.Array, active: jax.Array):
    """Candidates in Algorithm-1 order.

    Returns (order [N], a_sorted [N], valid_sorted [N], r_active) with N = R * gamma static; the
    flat index is j * R + r; valid candidates (active row, a > 0) come first, sorted by a
    descending, ties by smaller j then smaller r (stable sort of a j-major flattening).
    """
    a = _monotone(a)
    R, g = a.shape
    active = _active(active, R)
    valid = (a > 0) & active[:, None]
    flat_a = a.T.reshape(R * g)
    flat_valid = valid.T.reshape(R * g)
    key = jnp.where(flat_valid, -flat_a, jnp.inf)
    order = jnp.argsort(key, stable=True)
    r_active = jnp.sum(active).astype(jnp.int32)
    return order, flat_a[order], flat_valid[order], r_active


def _lengths(order: jax.Array, take_sorted: jax.Array, R: int, g: int) -> jax.Array:
    """Per-row count of admitted candidates (= l_r, since admitted sets are prefix-closed)."""
    take = jnp.zeros((R * g,), bool).at[order].set(take_sorted)
    return jnp.sum(take.reshape(g, R), axis=0).astype(jnp.int32)


def _throughput(a_sorted, valid_sorted, r_active, sps_buckets, sps_values):
    """Theta(k) = (R + sum of the first k sorted a) * SPS(R + k), k = 0..N, [N + 1] float32."""
    N = a_sorted.shape[0]
    gains = jnp.where(valid_sorted, a_sorted, 0.0)
    tau = r_active.astype(jnp.float32) + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(gains)])
    B = r_active + jnp.arange(N + 1, dtype=jnp.int32)
    sps = sps_lookup(jnp.asarray(sps_buckets, jnp.int32), jnp.asarray(sps_values, jnp.float32), B)
    return tau * sps


# ------------------------------------------------------------------------------------------------
# Algorithm 1 (synchronous, early stop)


def schedule_dspark(a: jax.Array, active: jax.Array | None, sps_buckets: jax.Array,
                    sps_values: jax.Array) -> jax.Array:
    """Algorithm 1 of DESIGN.md 3.1 -> l [R] int32.

    a [R, gamma] survival; active [R] bool (None: all active); sps_buckets [n] int ascending and
    sps_values [n] (e.g. `SPSTable.arrays()`): SPS(B) = value of the smallest bucket >= B, 0 beyond.
    Starts at B = tau = R_active, Theta_best = R_active * SPS(R_active); admits sorted candidates
    while tau * SPS(B) strictly improves and stops at the first candidate that does not improve it.
    """
    R, g = a.shape
    order, a_sorted, valid_sorted, r_active = _walk_order(a, active)
    theta = _throughput(a_sorted, valid_sorted, r_active, sps_buckets, sps_values)
    # Step k (1-based) compares with Theta_best = theta[k-1]: all previous steps improved, else we
    # would have stopped. The admitted prefix is the leading run of improving valid candidates.
    improves = (theta[1:] > theta[:-1]) & valid_sorted
    take = jnp.cumprod(improves.astype(jnp.int32)).astype(bool)
    return _lengths(order, take, R, g)


# ------------------------------------------------------------------------------------------------
# Asynchronous variant (capacity from two steps earlier, top-K admission)


def global_capacity(a: jax.Array, active: jax.Array | None, sps_buckets: jax.Array,
                    sps_values: jax.Array) -> jax.Array:
    """Unconstrained global search of the async variant -> K, scalar int32.

    Theta(K) = (R_active + sum of the K largest a) * SPS(R_active + K) over K = 0..#candidates
    (candidates: active rows, a > 0; at most R * gamma); returns the argmax (smallest K on ties),
    with no early stop. Use only on confidences of a PAST step (see module docstring): applied to
    the current step's confidences this is exactly the biased global search.
    """
    _, a_sorted, valid_sorted, r_active = _walk_order(a, active)
    theta = _throughput(a_sorted, valid_sorted, r_active, sps_buckets, sps_values)
    n_valid = jnp.sum(valid_sorted)
    theta = jnp.where(jnp.arange(theta.shape[0]) <= n_valid, theta, -jnp.inf)
    return jnp.argmax(theta).astype(jnp.int32)


def admit_top_k(a: jax.Array, active: jax.Array | None, K: jax.Array | int) -> jax.Array:
    """Admit the K candidates (active rows, a > 0) with the largest current survival -> l [R].

    Ties go to smaller j, then smaller r, so the admitted set is prefix-closed per request; exactly
    min(K, #candidates) draft tokens are admitted in total (K may be a traced scalar).
    """
    R, g = a.shape
    order, _, valid_sorted, _ = _walk_order(a, active)
    take = (jnp.arange(R * g) < jnp.asarray(K, jnp.int32)) & valid_sorted
    return _lengths(order, take, R, g)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AsyncSchedulerState:
    """2-deep FIFO of verify capacities (draft tokens in total), int32 [2].

    capacity[0] is used by the next `schedule_dspark_async` call, capacity[1] by the call after it;
    each call pops capacity[0] and pushes the global-search capacity of its own survival, so the K
    used at step t was computed from the survival of step t-2.
    """

    capacity: jax.Array  # [2] int32


def init_async_state(initial_capacity: int | jax.Array = 0) -> AsyncSchedulerState:
    """Queue for the first two steps (no confidences two steps back yet): both use this capacity,
    e.g. the number of requests (MTP-1-sized) or `global_capacity` on a representative survival."""
    return AsyncSchedulerState(jnp.full((2,), initial_capacity, jnp.int32))


def schedule_dspark_async(state: AsyncSchedulerState, a: jax.Array, active: jax.Array | None,
                          sps_buckets: jax.Array, sps_values: jax.Array) -> tuple[jax.Array, AsyncSchedulerState]:
    """Asynchronous DSpark scheduling (DESIGN.md 3.2) -> (l [R] int32, new state).

    Admits the top-K current candidates with K = the capacity queued two calls ago (clamped so that
    R_active + K stays within the largest bucket), then queues `global_capacity` of this step's
    survival for the call after next. l never depends on this step's confidences beyond their
    ranking: the total admitted is min(K, #candidates).
    """
    R = a.shape[0]
    r_active = jnp.sum(_active(active, R)).astype(jnp.int32)
    max_tokens = jnp.asarray(sps_buckets, jnp.int32)[-1]
    K = jnp.clip(state.capacity[0], 0, jnp.maximum(max_tokens - r_active, 0))
    l = admit_top_k(a, active, K)
    pushed = global_capacity(a, active, sps_buckets, sps_values)
    return l, AsyncSchedulerState(jnp.stack([state.capacity[1], pushed]).astype(jnp.int32))
