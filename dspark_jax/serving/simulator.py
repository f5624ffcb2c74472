"""Serving at scale, simulated: the engine's schedulers replayed against a hardware curve.

A discrete round loop in the steady state of a server whose C request slots are always refilled:

1. every slot holds a drafted round: the calibrated prefix survival a [C, gamma] and the accepted
   length A [C] that full verification would give, taken from a `RoundPool` (`rounds.py`):
   * replay (recorded pools, the default for them): each slot serves a recorded request and is at
     some position of it; it drafts the recorded round that starts there (or the remainder of the
     one it is inside: `shifted_round`), advances by what it commits, and is refilled with a random request when it reaches the
     request's length (`replay_tables`);
   * iid (synthetic pools): each slot serves one request for `request_rounds` rounds and draws
     that request's rounds at random (`draw_rounds`);
2. each policy picks per-slot verify lengths l [C] by calling the REAL scheduler functions of
   `dspark_jax/engine/scheduler.py` (`schedule_fixed`, `schedule_mtp1`, `schedule_threshold`,
   `schedule_dspark`, `schedule_dspark_async` with its state carried from round to round), with
   the SPS table the hardware curve gives for C. All policies and all rounds of one concurrency run
   in ONE jitted program (`jax.lax.scan` over rounds, `jax.vmap` over episodes), compiled once per
   concurrency;
3. slot r commits min(A_r, l_r) + 1 tokens (in replay, at most what is left of its request); the
   verify pass runs B = sum(l + 1) tokens padded to the engine's bucket (`pad_to_bucket`; `fixed`
   uses the padded [C, gamma + 1] layout, as the engine does), and the round costs
   curve.round_seconds(padded B, C) (drafter pass included);
4. aggregate tokens/s = committed tokens / simulated time over the measured rounds (after
   `warmup` rounds, which let the asynchronous scheduler's two-deep capacity queue fill);
   per-user = aggregate / C.

Everything is seeded (numpy Generator seeded with (seed, C)), so a run is reproducible.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from dspark_jax.core.errors import UserError
from dspark_jax.serving.hardware import HardwareCurve
from dspark_jax.serving.rounds import RoundPool

POLICIES = ("fixed", "mtp1", "threshold", "dspark", "dspark-async")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    policies: tuple[str, ...] = POLICIES
    threshold: float = 0.5  # prefix-survival threshold of the threshold policy
    slot_rounds: int = 32768  # slot-rounds measured per concurrency: rounds = slot_rounds // C, clipped
    min_rounds: int = 32
    max_rounds: int = 2048
    rounds: int | None = None  # measured rounds per episode (overrides slot_rounds)
    episodes: int = 1
    warmup: int = 4  # rounds simulated before measuring (the async queue fills in 2; slots settle)
    sampling: str = "auto"  # "replay" (recorded pools), "iid", or "auto" (replay when the pool has positions)
    request_rounds: int | None = 24  # iid: rounds a slot serves one request before a refill (None: whole episode)
    pin_requests: bool = False  # slot i serves request i of the pool, no refills (validation)
    replay_shift: bool = True  # replay inside a recorded round: its remainder (True) or the round as is (False)
    seed: int = 0

    def __post_init__(self):
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise UserError(f"unknown policy {', '.join(unknown) or '(none)'} (known: {', '.join(POLICIES)})")
        if len(set(self.policies)) != len(self.policies):
            raise UserError("a policy is listed twice")
        if not 0.0 <= self.threshold <= 1.0:
            raise UserError("--threshold must be in [0, 1]")
        if self.episodes < 1 or self.warmup < 0 or self.slot_rounds < 1 or (self.rounds is not None and self.rounds < 1):
            raise UserError("need episodes >= 1, warmup >= 0 and at least one measured round")
        if self.request_rounds is not None and self.request_rounds < 1:
            raise UserError("--request-rounds must be >= 1")
        if self.sampling not in ("auto", "replay", "iid"):
            raise UserError(f"unknown sampling {self.sampling!r} (auto, replay or iid)")

    def rounds_for(self, concurrency: int) -> int:
        if self.rounds is not None:
            return self.rounds
        return int(np.clip(self.slot_rounds // concurrency, self.min_rounds, self.max_rounds))

    def replays(self, pool: RoundPool) -> bool:
        if self.sampling == "replay" and pool.position is None:
            raise UserError("replay sampling needs recorded rounds (`simulate record`), not synthetic ones")
        return self.sampling == "replay" or (self.sampling == "auto" and pool.position is not None)


@dataclasses.dataclass
class Trace:
    """What one policy did at one concurrency, every simulated round (warm-up included)."""

    policy: str
    concurrency: int
    lengths: np.ndarray  # int [E, R, C] draft tokens verified per slot
    accepted_full: np.ndarray  # int [E, R, C] A of the drafted rounds
    padded: np.ndarray  # int [E, R] verify tokens after bucket padding
    seconds: np.ndarray  # float [E, R] simulated round time
    counted: np.ndarray | None = None  # int [E, R, C] committed tokens within the request's budget (replay)

    @property
    def committed(self) -> np.ndarray:
        return np.minimum(self.accepted_full, self.lengths) + 1


# ------------------------------------------------------------------------------------------------
# Drawing rounds


def _by_request(pool: RoundPool):
    order = np.argsort(pool.request, kind="stable")
    reqs, starts, counts = np.unique(pool.request[order], return_index=True, return_counts=True)
    return order, reqs, starts, counts


def draw_rounds(pool: RoundPool, concurrency: int, episodes: int, rounds: int, cfg: SimConfig,
                rng: np.random.Generator) -> np.ndarray:
    """iid sampling: pool indices [E, R, C] of the round each slot drafts in each simulated round
    (a slot serves one request for cfg.request_rounds rounds, drawing its rounds at random)."""
    order, reqs, starts, counts = _by_request(pool)
    P, E, R, C = len(reqs), episodes, rounds, concurrency
    if cfg.pin_requests:
        slot_req = np.broadcast_to(np.arange(C) % P, (E, R, C))
    else:
        n = cfg.request_rounds or R
        phase = rng.integers(n, size=(E, 1, C))
        seg = (np.arange(R)[None, :, None] + phase) // n  # [E, R, C] which request of the slot's sequence
        table = rng.integers(P, size=(E, R // n + 2, C))
        slot_req = np.take_along_axis(table, seg, axis=1)
    u = rng.random((E, R, C))
    pick = starts[slot_req] + np.minimum((u * counts[slot_req]).astype(np.int64), counts[slot_req] - 1)
    return order[pick]


def replay_tables(pool: RoundPool, concurrency: int, episodes: int, rounds: int, cfg: SimConfig,
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Replay sampling: per request its rounds' anchor positions and pool indices (padded [P, M]),
    each slot's first request and position, and the requests that refill it (common to all policies).

    A slot at position p of its request drafts the recorded round whose anchor is the last one <= p
    (with full-length verification that is the very round recorded); a policy that verified less
    reaches positions m tokens inside a recorded round and drafts that round's remainder
    (`shifted_round`). When p reaches the
    request's length the slot is refilled with a random request at position 1 (prefill not timed).
    Pinned (validation): slot i serves request i from position 1 and is never refilled."""
    order, reqs, starts, counts = _by_request(pool)
    P, M, E, C = len(reqs), int(counts.max()), episodes, concurrency
    anchor = np.full((P, M), np.iinfo(np.int32).max, np.int32)
    index = np.zeros((P, M), np.int32)
    for i in range(P):
        rows = order[starts[i]: starts[i] + counts[i]]
        rows = rows[np.argsort(pool.position[rows], kind="stable")]
        anchor[i, : len(rows)] = pool.position[rows]
        index[i, : len(rows)] = rows
        index[i, len(rows):] = rows[-1]
    if cfg.pin_requests:
        first = np.broadcast_to(np.arange(C) % P, (E, C)).copy()
        pos = np.ones((E, C), np.int32)
    else:
        first = rng.integers(P, size=(E, C))
        # start inside a random recorded round of the request: slots are out of phase, as in a server
        # that has been running for a while (cfg.warmup rounds let the schedule settle)
        k = np.minimum((rng.random((E, C)) * counts[first]).astype(np.int64), counts[first] - 1)
        pos = anchor[first, k]
    refill = rng.integers(P, size=(E, C, rounds + 1)).astype(np.int32)
    return {"anchor": anchor, "index": index, "first": first.astype(np.int32), "position": pos.astype(np.int32),
            "refill": refill}


# ------------------------------------------------------------------------------------------------
# The scheduler program (real engine functions)


def _policy_lengths(S, jnp, p, a_t, active, state, gamma, threshold, buckets, values):
    """One policy's verify lengths for one round: the engine's scheduler function."""
    if p == "fixed":
        lengths = S.schedule_fixed(active, gamma)
    elif p == "mtp1":
        lengths = S.schedule_mtp1(active, gamma)
    elif p == "threshold":
        lengths = S.schedule_threshold(a_t, threshold, active)
    elif p == "dspark":
        lengths = S.schedule_dspark(a_t, active, buckets, values)
    else:  # dspark-async: the capacity queue is carried across rounds
        lengths, state = S.schedule_dspark_async(state, a_t, active, buckets, values)
    return jnp.asarray(lengths, jnp.int32), state


def scheduler_program(policies: Sequence[str], concurrency: int, gamma: int, threshold: float):
    """iid mode: jit(vmap over episodes of scan over rounds): survival [E, R, C, gamma] -> l [E, R, P, C].

    The scheduler functions are looked up on `dspark_jax.engine.scheduler` when the program is
    traced, so whatever that module holds is what runs."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine import scheduler as S

    policies = tuple(policies)

    def episode(a, buckets, values):
        active = jnp.ones((concurrency,), bool)

        def step(state, a_t):
            out = []
            for p in policies:
                lengths, state = _policy_lengths(S, jnp, p, a_t, active, state, gamma, threshold, buckets, values)
                out.append(lengths)
            return state, jnp.stack(out)

        _, lengths = jax.lax.scan(step, S.init_async_state(concurrency), a)
        return lengths

    return jax.jit(jax.vmap(episode, in_axes=(0, None, None)))


def shifted_round(xp, a, A, m):
    """A recorded round (survival a [C, g], accepted A [C]) seen from m >= 0 tokens past its anchor.

    The first m draft tokens are then already committed (m <= A inside the recorded round), so the
    draft from there is modelled as the recorded one's remainder: accepted A - m (the rejection
    falls on the same text position), survival a'_k = a_{m+k} / a_m (calibrated survival given the
    first m accepted); positions past the recorded block continue geometrically with the round's
    last conditional confidence a_g / a_{g-1}. m = 0 returns the round unchanged."""
    C, g = a.shape
    last = a[:, -1:] / xp.maximum(a[:, -2:-1], 1e-30) if g > 1 else a[:, -1:]
    last = xp.clip(last, 0.0, 1.0)
    tail = a[:, -1:] * last ** xp.arange(1, g + 1, dtype=a.dtype)[None, :]
    full = xp.concatenate([xp.ones((C, 1), a.dtype), a, tail], axis=1)  # [C, 2g + 1]: a_0 = 1
    m = xp.clip(m, 0, g)
    base = xp.take_along_axis(full, m[:, None], axis=1)
    ahead = xp.take_along_axis(full, m[:, None] + xp.arange(1, g + 1)[None, :], axis=1)
    shifted = xp.where(base > 0, ahead / xp.maximum(base, 1e-30), 0.0)
    return xp.minimum(shifted, 1.0).astype(a.dtype), xp.maximum(A - m, 0).astype(A.dtype)


def replay_program(policies: Sequence[str], concurrency: int, gamma: int, threshold: float, rounds: int,
                   request_tokens: int, refills: bool, shift: bool = True):
    """Replay mode: every policy follows its own trajectory through the recorded requests.

    jit(vmap over episodes of scan over rounds) -> (l, A, counted), each [E, R, P, C]."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine import scheduler as S

    policies = tuple(policies)
    P, C = len(policies), concurrency
    slots = jnp.arange(C)

    def episode(first, position, refill, survival, accepted, anchor, index, buckets, values):
        active = jnp.ones((C,), bool)
        req0 = jnp.broadcast_to(first, (P, C))
        pos0 = jnp.broadcast_to(position, (P, C))
        carry0 = (S.init_async_state(C), req0, pos0, jnp.zeros((P, C), jnp.int32))

        def step(carry, _):
            state, req, pos, used = carry
            outs, reqs, poss, useds = [], [], [], []
            for i, p in enumerate(policies):
                j = jnp.maximum(jnp.sum(anchor[req[i]] <= pos[i][:, None], axis=1) - 1, 0)
                idx = index[req[i], j]
                m = pos[i] - anchor[req[i], j] if shift else jnp.zeros_like(pos[i])
                a_t, A_t = shifted_round(jnp, survival[idx], accepted[idx], m)
                lengths, state = _policy_lengths(S, jnp, p, a_t, active, state, gamma, threshold, buckets, values)
                comm = jnp.minimum(A_t, lengths) + 1
                new = pos[i] + comm
                if refills:
                    counted = jnp.minimum(comm, jnp.maximum(request_tokens - pos[i], 0))
                    done = new >= request_tokens
                    nxt = refill[slots, jnp.minimum(used[i], rounds)]
                    reqs.append(jnp.where(done, nxt, req[i]))
                    poss.append(jnp.where(done, 1, new))
                    useds.append(used[i] + done)
                else:
                    counted = comm
                    reqs.append(req[i])
                    poss.append(new)
                    useds.append(used[i])
                outs.append(jnp.stack([lengths, A_t, counted]))
            carry = (state, jnp.stack(reqs), jnp.stack(poss).astype(jnp.int32), jnp.stack(useds).astype(jnp.int32))
            return carry, jnp.stack(outs, axis=1)  # [3, P, C]

        _, out = jax.lax.scan(step, carry0, None, length=rounds)
        return out  # [R, 3, P, C]

    return jax.jit(jax.vmap(episode, in_axes=(0, 0, 0) + (None,) * 6))


def run_concurrency(pool: RoundPool, curve: HardwareCurve, concurrency: int, cfg: SimConfig,
                    rounds: int | None = None, episodes: int | None = None) -> dict[str, Trace]:
    """Simulate every policy of cfg at one concurrency; rounds / episodes default from cfg
    (rounds = warm-up + measured)."""
    from dspark_jax.engine.sps import pad_to_bucket

    C, g = int(concurrency), pool.gamma
    if curve.gamma != g:
        raise UserError(f"the hardware curve is for gamma {curve.gamma}, the drafter statistics for gamma {g}")
    curve.check(C)
    E = episodes or cfg.episodes
    R = rounds if rounds is not None else cfg.warmup + cfg.rounds_for(C)
    rng = np.random.default_rng([cfg.seed, C])
    table = curve.sps_table(C)
    buckets, values = table.arrays()
    if buckets[-1] < C * (g + 1):
        raise UserError(f"the SPS table for concurrency {C} stops at {buckets[-1]} tokens, below C x (gamma + 1) = "
                        f"{C * (g + 1)}")
    if cfg.replays(pool):
        t = replay_tables(pool, C, E, R, cfg, rng)
        program = replay_program(cfg.policies, C, g, cfg.threshold, R, int(pool.request_tokens),
                                 refills=not cfg.pin_requests, shift=cfg.replay_shift)
        out = np.asarray(program(t["first"], t["position"], t["refill"], pool.survival, pool.accepted,
                                 t["anchor"], t["index"], buckets, values))  # [E, R, 3, P, C]
        per_policy = [(out[:, :, 0, i], out[:, :, 1, i], out[:, :, 2, i]) for i in range(len(cfg.policies))]
    else:
        idx = draw_rounds(pool, C, E, R, cfg, rng)
        A = pool.accepted[idx]
        lengths = np.asarray(scheduler_program(cfg.policies, C, g, cfg.threshold)(pool.survival[idx], buckets, values))
        per_policy = [(lengths[:, :, i, :], A, None) for i in range(len(cfg.policies))]
    traces = {}
    for p, (lp, A, counted) in zip(cfg.policies, per_policy):
        tokens = (lp + 1).sum(-1)
        if p == "fixed":
            padded = np.full(tokens.shape, C * (g + 1), np.int64)
        else:
            padded = np.asarray(pad_to_bucket(np.asarray(buckets, np.int64), tokens))
        seconds = np.asarray(curve.round_seconds(padded, C), np.float64)
        traces[p] = Trace(p, C, lp, A, padded, seconds, counted)
    return traces


def summarize(trace: Trace, warmup: int = 0, rounds: int | None = None, batches: int = 8) -> dict[str, Any]:
    """Metrics over rounds [warmup, warmup + rounds) of every episode."""
    sl = slice(warmup, None if rounds is None else warmup + rounds)
    lengths, committed = trace.lengths[:, sl], trace.committed[:, sl]
    counted = committed if trace.counted is None else trace.counted[:, sl]  # what throughput counts
    padded, seconds = trace.padded[:, sl], trace.seconds[:, sl]
    E, R, C = lengths.shape
    if R < 1:
        raise UserError("no measured round left after the warm-up")
    aggregate = float(counted.sum() / seconds.sum())
    per_episode = counted.sum((1, 2)) / seconds.sum(1)
    row = {"policy": trace.policy, "concurrency": C,
           "aggregate_tokens_per_s": aggregate, "per_user_tokens_per_s": aggregate / C,
           "tau": float(committed.mean()), "verify_budget": float(lengths.mean()),
           "verify_tokens_per_round": float((lengths + 1).sum(-1).mean()),
           "padded_tokens_per_round": float(padded.mean()), "round_ms": float(1e3 * seconds.mean()),
           "episodes": E, "rounds": R, "slot_rounds": E * R * C}
    row["tau_sd_episodes"] = float(np.std(committed.mean((1, 2)), ddof=1)) if E > 1 else None
    if E > 1:
        row["episode_sd"] = float(np.std(per_episode, ddof=1))
        row["aggregate_se"] = row["episode_sd"] / np.sqrt(E)
    else:  # batch means over consecutive chunks of rounds
        k = min(batches, R)
        chunks = np.array_split(np.arange(R), k)
        vals = [counted[:, c].sum() / seconds[:, c].sum() for c in chunks]
        row["aggregate_se"] = float(np.std(vals, ddof=1) / np.sqrt(k)) if k > 1 else float("nan")
    return row


def simulate(pool: RoundPool, curve: HardwareCurve, concurrencies: Sequence[int], cfg: SimConfig,
             progress=None) -> list[dict[str, Any]]:
    """Rows (one per policy and concurrency) of the steady-state simulation."""
    if not concurrencies or min(concurrencies) < 1:
        raise UserError("need concurrencies >= 1")
    rows = []
    for c in concurrencies:
        traces = run_concurrency(pool, curve, c, cfg)
        extras = curve.extras(c)
        for p in cfg.policies:
            rows.append({**summarize(traces[p], cfg.warmup), **extras})
        if progress is not None:
            progress(c, rows[-len(cfg.policies):])
    return rows


# ------------------------------------------------------------------------------------------------
# Pareto fronts and gains at matched speed


def pareto_front(rows: Sequence[dict], x: str = "per_user_tokens_per_s", y: str = "aggregate_tokens_per_s") -> list[dict]:
    """Rows not dominated in (x, y), both maximised, sorted by x ascending."""
    front = [r for r in rows if not any((o[x] >= r[x] and o[y] >= r[y]) and (o[x] > r[x] or o[y] > r[y])
                                        for o in rows)]
    return sorted(front, key=lambda r: r[x])


def _interp_loglog(xs, ys, x):
    xs, ys = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    lx = np.log(x)
    if len(xs) == 0 or lx < xs.min() - 1e-12 or lx > xs.max() + 1e-12:
        return None
    order = np.argsort(xs)
    return float(np.exp(np.interp(lx, xs[order], ys[order])))


def gains_over(rows: Sequence[dict], baseline: str = "mtp1") -> list[dict]:
    """For every point of the baseline's Pareto front (a concurrency it would be run at) and every
    other policy: the policy's aggregate throughput at the baseline's per-user speed, and its
    per-user speed at the baseline's aggregate throughput, both read off the policy's Pareto front
    (log-log interpolation between simulated concurrencies; None outside it)."""
    base = sorted(pareto_front([r for r in rows if r["policy"] == baseline]), key=lambda r: r["concurrency"])
    out = []
    for p in dict.fromkeys(r["policy"] for r in rows):
        if p == baseline:
            continue
        front = pareto_front([r for r in rows if r["policy"] == p])
        pu = [r["per_user_tokens_per_s"] for r in front]
        agg = [r["aggregate_tokens_per_s"] for r in front]
        for b in base:
            at_speed = _interp_loglog(pu, agg, b["per_user_tokens_per_s"])
            at_tput = _interp_loglog(agg, pu, b["aggregate_tokens_per_s"])
            out.append({"policy": p, "baseline": baseline, "baseline_concurrency": b["concurrency"],
                        "per_user_tokens_per_s": b["per_user_tokens_per_s"],
                        "aggregate_tokens_per_s": b["aggregate_tokens_per_s"],
                        "throughput_gain_at_matched_speed": None if at_speed is None
                        else at_speed / b["aggregate_tokens_per_s"] - 1,
                        "speed_gain_at_matched_throughput": None if at_tput is None
                        else at_tput / b["per_user_tokens_per_s"] - 1})
    return out
