"""Batched speculative decoding with a DSpark / DFlash / Eagle3 drafter (static shapes, one jit per round).

Invariant between rounds, per row b:
  * the target KV cache holds every committed token except the newest one, the ANCHOR x_0, which
    sits at position p = cache.lengths[b] and has been emitted but not yet fed to the target;
  * the drafter's context (engine/drafting.py) holds the target features of the same tokens.

A round: draft gamma tokens after x_0 (one backbone pass + head scan) -> schedule l_b draft tokens
per row -> verify [x_0, x_1..x_l] in ONE target extend pass (padded [B, gamma+1] layout; rows append
their own l_b + 1 tokens) -> accept a_b tokens + one bonus -> commit: the cache keeps x_0..x_a (a
rollback is just the length), their features (taps of the same verify pass) go to the drafter
cache, and the bonus becomes the next anchor. Each round emits a_b + 1 tokens (tau).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dspark_jax.core.config_checks import setting, validate
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.engine import drafting
from dspark_jax.engine import scheduler as S
from dspark_jax.engine.acceptance import verify_greedy, verify_sampled
from dspark_jax.engine.fallback import PlainStepGate
from dspark_jax.engine.sps import SPSTable, pad_to_bucket
from dspark_jax.engine.generate import (FlatPrompts, GenerationResult, compiled, compiling_seconds,
                                         continuous_batching, flatten_prompts, pad_prompts, padded_as_flat,
                                         running_clock, stop_mask)
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig, processed_log_probs, sample


POLICIES = ("fixed", "mtp1", "threshold", "dspark", "dspark_async")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    gamma: int = setting(ge=1)  # draft tokens per round (<= the drafter's block size)
    sampling: SamplingConfig = SamplingConfig()
    policy: str = setting("fixed", choices=POLICIES)  # draft tokens verified per row
    threshold: float = setting(0.5, ge=0, le=1)  # for policy="threshold": verify while prefix survival >= threshold
    stop_ids: tuple[int, ...] = setting((), ge=0)
    sps: SPSTable | None = None  # verify steps/s per token bucket, for the dspark policies
    # Verify over flattened tokens padded to one of these token buckets (cost follows the schedule;
    # the host picks the bucket between drafting and verification). None: padded [B, gamma+1].
    verify_buckets: tuple[int, ...] | None = setting(None, ge=1)
    # Run plain target steps instead of rounds while drafts do not pay (engine/fallback.py).
    plain_steps: bool = False

    def __post_init__(self):
        validate(self)

    def unscheduled(self) -> "SpecConfig":
        """These settings less the scheduler's (policy, threshold, SPS table, buckets, plain steps):
        all that the prefill, verify and plain-step programs read. Those programs are compiled for
        this, so every scheduler shares them and only the draft program is one per scheduler."""
        return SpecConfig(gamma=self.gamma, sampling=self.sampling, stop_ids=self.stop_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: decoder.KVCache
    draft: drafting.DraftState  # the drafter's context (features of the committed tokens)
    anchor: jax.Array  # [B] x_0 of the next round
    output: jax.Array  # [B, max_new + gamma + 1] emitted tokens (slack absorbs a last block)
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    max_new: jax.Array  # [B] int32 per-row budget
    key: jax.Array
    sched: S.AsyncSchedulerState  # verify capacities queued by the dspark_async policy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundStats:
    active: jax.Array  # [B] bool: the row took part in this round
    num_draft: jax.Array  # [B] draft tokens verified
    accepted: jax.Array  # [B] draft tokens accepted (tau = accepted + 1)
    confidence_logits: jax.Array  # [B, gamma] raw confidence logits (zeros without a head)
    # [B] the tokens the head forecast for the round: 1 + the calibrated prefix survival of the drafts
    # verified (what the plain-step gate reads: engine/fallback.py; meaningless without a head)
    forecast: jax.Array
    # [] int32: 0 for a round; else the plain target steps this entry ran instead (DESIGN.md 3.3b), `active`
    # then counting the steps each row took part in
    plain: jax.Array


def schedule(cfg: SpecConfig, confidence_logits: jax.Array | None, temperatures: jax.Array | None,
             active: jax.Array, sched: S.AsyncSchedulerState) -> tuple[jax.Array, S.AsyncSchedulerState]:
    """Draft tokens to verify per row, [B] int32 (0 for inactive rows), and the scheduler state."""
    if cfg.policy == "fixed":
        return S.schedule_fixed(active, cfg.gamma), sched
    if cfg.policy == "mtp1":
        return S.schedule_mtp1(active, cfg.gamma), sched
    if confidence_logits is None:
        raise ValueError(f"policy {cfg.policy!r} needs a drafter with a confidence head")
    a = S.survival_from_logits(confidence_logits[:, : cfg.gamma], temperatures)
    if cfg.policy == "threshold":
        return S.schedule_threshold(a, cfg.threshold, active), sched
    if cfg.sps is None:
        raise ValueError(f"policy {cfg.policy!r} needs an SPS table")
    buckets, values = (jnp.asarray(x) for x in cfg.sps.arrays())
    if cfg.policy == "dspark":
        return S.schedule_dspark(a, active, buckets, values), sched
    if cfg.policy == "dspark_async":
        return S.schedule_dspark_async(sched, a, active, buckets, values)
    raise ValueError(f"unknown policy {cfg.policy!r} (known: {', '.join(POLICIES)})")


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "cfg", "max_len"))
def spec_prefill(target_params, dparams, tokens, lengths, max_new, key, flat: FlatPrompts | None = None, *,
                 tcfg: ModelConfig, dcfg: DrafterConfig, cfg: SpecConfig, max_len: int) -> SpecState:
    """Prefill the target and the drafter from right-padded prompts tokens [B, W] with `lengths`.
    The target runs over the prompts flattened (`flat`, from `flatten_prompts`: its dense layers
    then cost the real tokens, not B x W; default: every padded slot)."""
    B, W = tokens.shape
    flat = padded_as_flat(tokens, lengths) if flat is None else flat
    cache = decoder.cache_for(target_params, tcfg, B, max_len)
    hidden, cache, taps = decoder.forward_flat(target_params, tcfg, flat.tokens, flat.rows, flat.positions, flat.valid,
                                               cache, dcfg.tap_layers, width=W, prefill=True)
    cache = dataclasses.replace(cache, lengths=lengths)
    draft = drafting.start_flat(dparams, dcfg, target_params, tokens, lengths, flat, jnp.concatenate(list(taps), -1),
                                max_len, jnp.dtype(tcfg.dtype))
    is_last = flat.valid & (flat.positions == lengths[flat.rows] - 1)  # each row's last prompt token
    last = hidden[jnp.zeros((B,), jnp.int32).at[jnp.where(is_last, flat.rows, B)].set(
        jnp.arange(flat.tokens.shape[0], dtype=jnp.int32), mode="drop")]
    key, sub = jax.random.split(key)
    first = sample(sub, decoder.logits(target_params, tcfg, last), cfg.sampling)
    output = jnp.zeros((B, int(max_len)), jnp.int32).at[:, 0].set(first)
    done = stop_mask(first, cfg.stop_ids) | (max_new <= 1)
    return SpecState(cache, draft, first, output, jnp.ones((B,), jnp.int32), done, max_new, key,
                     S.init_async_state(B))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafted:
    """A round's draft and schedule, before verification."""

    tokens: jax.Array  # [B, g] draft tokens x_1..x_g
    log_probs: jax.Array | None  # [B, g, V] processed draft distributions (None when greedy: unused)
    confidence_logits: jax.Array  # [B, g] raw (zeros without a confidence head)
    num_draft: jax.Array  # [B] draft tokens to verify (0 for inactive rows)
    forecast: jax.Array  # [B] see RoundStats
    sched: S.AsyncSchedulerState
    key: jax.Array  # the state's next key
    verify_key: jax.Array


def draft_and_schedule(target_params, dparams, state: SpecState, temperatures, *, tcfg: ModelConfig,
                       dcfg: DrafterConfig, cfg: SpecConfig) -> Drafted:
    active = ~state.done
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    proposal = drafting.propose(dparams, dcfg, target_params, tcfg, state.draft, state.anchor, k_draft, cfg.sampling,
                                cfg.gamma)
    conf = proposal.confidence_logits
    num_draft, sched = schedule(cfg, conf, temperatures, active, state.sched)
    conf = jnp.zeros(proposal.tokens.shape, jnp.float32) if conf is None else conf.astype(jnp.float32)
    # Greedy verification compares tokens only: without the V-wide distributions as an output, jit
    # drops their computation from the draft pass (a log-softmax over the vocabulary per slot).
    log_probs = None if cfg.sampling.greedy else proposal.log_probs
    verified = jnp.arange(conf.shape[-1]) < num_draft[:, None]
    forecast = 1.0 + jnp.sum(jnp.where(verified, S.survival_from_logits(conf, temperatures), 0.0), axis=-1)
    return Drafted(proposal.tokens, log_probs, conf, num_draft, forecast, sched, key, k_verify)


def _target_pass(target_params, *, tcfg: ModelConfig, tap_layers, cache: decoder.KVCache, verify_tokens, num_new,
                 bucket: int | None):
    """Target logits [B, g+1, V] and taps [B, g+1, m*d] of the verify tokens; the cache gets their K/V
    (lengths are set by the caller). bucket=None: padded [B, g+1] layout. bucket=N: the sum(num_new)
    scheduled tokens flattened and padded to N, so the pass costs what was scheduled (DESIGN.md 3.4)."""
    if bucket is None:
        hidden, cache, taps = decoder.forward(target_params, tcfg, verify_tokens, cache, num_new, tap_layers)
        return decoder.logits(target_params, tcfg, hidden), jnp.concatenate(list(taps), -1), cache
    B, width = verify_tokens.shape
    ends = jnp.cumsum(num_new)
    n = jnp.arange(bucket)
    row = jnp.minimum(jnp.searchsorted(ends, n, side="right"), B - 1)
    valid = n < ends[-1]
    slot = jnp.clip(n - (ends - num_new)[row], 0, width - 1)
    hidden, cache, taps = decoder.forward_flat(target_params, tcfg, verify_tokens[row, slot], row,
                                               cache.lengths[row] + slot, valid, cache, tap_layers, width=width)
    back_row = jnp.where(valid, row, B)  # padding entries scatter out of range (dropped)
    unflatten = lambda x: jnp.zeros((B, width) + x.shape[1:], x.dtype).at[back_row, slot].set(x, mode="drop")  # noqa: E731
    features = jnp.concatenate(list(taps), -1)
    return unflatten(decoder.logits(target_params, tcfg, hidden)), unflatten(features), cache


def verify_and_commit(target_params, dparams, state: SpecState, drafted: Drafted, *, tcfg: ModelConfig,
                      dcfg: DrafterConfig, cfg: SpecConfig, bucket: int | None = None) -> tuple[SpecState, RoundStats]:
    active = ~state.done
    draft_tokens, num_draft = drafted.tokens, drafted.num_draft
    verify_tokens = jnp.concatenate([state.anchor[:, None], draft_tokens], axis=1)  # [B, g+1]
    num_new = jnp.where(active, num_draft + 1, 0)
    target_logits, taps, cache = _target_pass(target_params, tcfg=tcfg, tap_layers=dcfg.tap_layers, cache=state.cache,
                                              verify_tokens=verify_tokens, num_new=num_new, bucket=bucket)
    if cfg.sampling.greedy:
        accepted, bonus = verify_greedy(draft_tokens, target_logits, num_draft)
    else:
        accepted, bonus = verify_sampled(drafted.verify_key, draft_tokens, drafted.log_probs,
                                         processed_log_probs(target_logits, cfg.sampling), num_draft)
    accepted = jnp.where(active, accepted, 0)
    # Emit x_1..x_a then the bonus
    slot = jnp.arange(cfg.gamma + 1)[None, :]
    emitted = jnp.where(slot < accepted[:, None], jnp.pad(draft_tokens, ((0, 0), (0, 1))), bonus[:, None])
    new_state = _commit(dparams, dcfg, target_params, state, cache, verify_tokens, taps, emitted, accepted,
                        drafted.key, drafted.sched, cfg)
    return new_state, RoundStats(active, num_draft, accepted, drafted.confidence_logits, drafted.forecast,
                                 jnp.zeros((), jnp.int32))


def plain_and_commit(target_params, dparams, state: SpecState, *, tcfg: ModelConfig, dcfg: DrafterConfig,
                     cfg: SpecConfig) -> tuple[SpecState, jax.Array]:
    """A plain target decode step in place of a round (DESIGN.md 3.3b): no drafter pass; the target
    reads the anchor alone and emits its own next token (argmax, or a draw from its processed
    distribution, as plain decoding does). The drafter's context is left to the caller: returns
    the anchor's features [B, m*d], which `plain_steps` commits for a whole run of steps at once."""
    active = ~state.done
    key, _, k_sample = jax.random.split(state.key, 3)  # as a round splits it
    verify_tokens = state.anchor[:, None]  # [B, 1]
    target_logits, taps, cache = _target_pass(target_params, tcfg=tcfg, tap_layers=dcfg.tap_layers, cache=state.cache,
                                              verify_tokens=verify_tokens, num_new=active.astype(jnp.int32),
                                              bucket=None)
    token = sample(k_sample, target_logits[:, 0], cfg.sampling)
    return _commit(dparams, dcfg, target_params, state, cache, verify_tokens, taps, token[:, None],
                   jnp.zeros_like(state.num_generated), key, state.sched, cfg, commit_draft=False), taps[:, 0]


def plain_steps(target_params, dparams, state: SpecState, steps, *, tcfg: ModelConfig, dcfg: DrafterConfig,
                cfg: SpecConfig) -> tuple[SpecState, RoundStats]:
    """Up to `steps` <= MAX_PLAIN_RUN (a traced int: one program serves every run length) plain
    target steps in one program, stopping early once a row finishes, so a run of them costs what
    plain decoding's chunks cost: no host round trip per token. The anchors' features go to the
    drafter's context after the run, all at once, as one round committing them would (a round
    drafts from the whole prefix); committing them step by step streamed the drafter's context
    weights once per token, ~5% of a plain step here."""
    B = state.anchor.shape[0]
    tap_shape = jax.eval_shape(lambda s: plain_and_commit(target_params, dparams, s, tcfg=tcfg, dcfg=dcfg,
                                                          cfg=cfg)[1], state)
    decoding = ~state.done

    # The run ends once a row that was decoding finishes: under continuous batching its slot is then
    # refilled at once (as plain serving's chunks do) instead of idling to the end of the run.
    def more(carry):
        i, s = carry[:2]
        return (i < jnp.minimum(steps, MAX_PLAIN_RUN)) & ~jnp.any(s.done & decoding) & ~jnp.all(s.done)

    def step(carry):
        i, s, took, anchors, taps = carry
        new, tap = plain_and_commit(target_params, dparams, s, tcfg=tcfg, dcfg=dcfg, cfg=cfg)
        return i + 1, new, took + ~s.done, anchors.at[:, i].set(s.anchor), taps.at[:, i].set(tap)

    start = (jnp.int32(0), state, jnp.zeros((B,), jnp.int32), jnp.zeros((B, MAX_PLAIN_RUN), state.anchor.dtype),
             jnp.zeros((B, MAX_PLAIN_RUN) + tap_shape.shape[1:], tap_shape.dtype))
    ran, end, took, anchors, taps = jax.lax.while_loop(more, step, start)
    # A row took its steps first (done never clears), so its anchors and features are slots 0..took-1.
    draft = drafting.commit(dparams, dcfg, target_params, state.draft, anchors, taps, took, took > 0)
    zeros = jnp.zeros((B,), jnp.int32)
    return dataclasses.replace(end, draft=draft), RoundStats(took, zeros, zeros, jnp.zeros((B, cfg.gamma), jnp.float32),
                                                             jnp.ones((B,), jnp.float32), ran)


def _commit(dparams, dcfg: DrafterConfig, target_params, state: SpecState, cache: decoder.KVCache, verify_tokens,
            taps, emitted, accepted, key, sched, cfg: SpecConfig, commit_draft: bool = True) -> SpecState:
    """The end of a step: keep x_0..x_a of the verify tokens (the target cache rolls back to them,
    their features feed the drafter unless `commit_draft` is False) and emit emitted[:, :a+1]
    (accepted drafts, then the bonus or the plain step's token); a stop token or the budget may end
    the row inside them."""
    B, width = emitted.shape
    active = ~state.done
    committed = jnp.where(active, accepted + 1, 0)
    cache = dataclasses.replace(cache, lengths=state.cache.lengths + committed)
    draft = (drafting.commit(dparams, dcfg, target_params, state.draft, verify_tokens, taps, committed, active)
             if commit_draft else state.draft)
    slot = jnp.arange(width)[None, :]
    in_step = slot <= accepted[:, None]
    stops = stop_mask(emitted, cfg.stop_ids) & in_step
    first_stop = jnp.where(jnp.any(stops, -1), jnp.argmax(stops, -1) + 1, accepted + 1)
    budget = state.max_new - state.num_generated
    count = jnp.where(active, jnp.minimum(first_stop, budget), 0)
    rows = jnp.arange(B)[:, None]
    write_at = jnp.where(slot < count[:, None], state.num_generated[:, None] + slot, state.output.shape[1])
    output = state.output.at[rows, write_at].set(emitted, mode="drop")
    num_generated = state.num_generated + count
    done = state.done | (active & jnp.any(stops, -1)) | (num_generated >= state.max_new)
    bonus = emitted[jnp.arange(B), accepted]  # the last emitted token: the next step's anchor
    return SpecState(cache, draft, bonus, output, num_generated, done, state.max_new, key, sched)


_STATIC = ("tcfg", "dcfg", "cfg")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def spec_round(target_params, dparams, state: SpecState, temperatures, *, tcfg: ModelConfig, dcfg: DrafterConfig,
               cfg: SpecConfig) -> tuple[SpecState, RoundStats]:
    """A whole round in one program, verifying in the padded [B, g+1] layout."""
    drafted = draft_and_schedule(target_params, dparams, state, temperatures, tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    return verify_and_commit(target_params, dparams, state, drafted, tcfg=tcfg, dcfg=dcfg, cfg=cfg)


spec_draft = jax.jit(draft_and_schedule, static_argnames=_STATIC)
spec_verify = jax.jit(verify_and_commit, static_argnames=_STATIC + ("bucket",), donate_argnames=("state",))
spec_plain = jax.jit(plain_steps, static_argnames=_STATIC, donate_argnames=("state",))
MAX_PLAIN_RUN = 16  # plain steps one call runs at most (fewer once a row finishes)


@dataclasses.dataclass
class SpecResult(GenerationResult):
    # Per round: RoundStats as numpy, per row; speculative_generate adds the round's wall time "seconds".
    rounds: list[dict] = dataclasses.field(default_factory=list)
    # speculative_serve: per request (input order), its RequestStats totals and "wall_s".
    request_stats: list[dict] = dataclasses.field(default_factory=list)

    def acceptance_lengths(self) -> np.ndarray:
        """tau (accepted + bonus) of every (round, active row)."""
        taus = [r["accepted"][r["active"]] + 1 for r in self.rounds if not r.get("plain", 0)]
        return np.concatenate(taus) if taus else np.zeros(0)

    @property
    def plain_steps(self) -> int:
        return sum(int(r.get("plain", 0)) for r in self.rounds)


def round_program(target_params, dparams, state_shape, temps, *, tcfg: ModelConfig, dcfg: DrafterConfig,
                  cfg: SpecConfig, gate: PlainStepGate | None = None):
    """Compile one decoding step for states shaped like `state_shape`: a round with the padded
    [B, g+1] verify, or, with cfg.verify_buckets, draft + a flattened verify padded to the smallest
    bucket that holds this round's scheduled tokens (the host reads the count and picks the
    program, compiling it the first time: a run of 8 slots has 7 buckets and may use 3; the
    compilation stops `running_clock`, which the callers time on). With a `gate`, each step is a
    round or a plain target step as the gate decides from the steps before it, and what the step
    cost is reported back to it."""
    statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    committing = dict(statics, cfg=cfg.unscheduled())  # the verify and plain-step programs' statics
    state_shape = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                               state_shape)  # shapes: the programs are warmed on scratch states (`compiled`)
    ran = set()  # the programs run so far (see run_step)
    if cfg.verify_buckets is None:
        whole_round = compiled(spec_round, (target_params, dparams, state_shape, temps), statics, warm=True)

        def run_round(target_params, dparams, state, temps):
            ran.add("round")
            return whole_round(target_params, dparams, state, temps)
    else:
        rows = state_shape.anchor.shape[0]
        if cfg.verify_buckets[-1] < rows * (cfg.gamma + 1):
            raise ValueError(f"verify buckets {cfg.verify_buckets} do not cover {rows} x (gamma + 1) tokens")
        run_draft = compiled(spec_draft, (target_params, dparams, state_shape, temps), statics, warm=True)
        run_verify = {}  # per bucket, compiled when a round first needs it: a run uses few of them

        def run_round(target_params, dparams, state, temps):
            drafted = run_draft(target_params, dparams, state, temps)
            # numpy, not jnp: an eager jnp op compiles on its first call, inside the timed path
            scheduled = int(np.sum(np.where(np.asarray(state.done), 0, np.asarray(drafted.num_draft) + 1)))
            bucket = int(pad_to_bucket(cfg.verify_buckets, scheduled))
            if bucket not in run_verify:  # off `running_clock`, like every compilation
                run_verify[bucket] = compiled(spec_verify, (target_params, dparams, state_shape, run_draft.out_info),
                                              dict(committing, bucket=bucket), warm=True)
            ran.add(bucket)
            return run_verify[bucket](target_params, dparams, state, drafted)
    if gate is None:
        return run_round
    run_plain = compiled(spec_plain, (target_params, dparams, state_shape, np.int32(1)), committing, warm=True)
    head = dcfg.kind == "dspark" and dcfg.confidence

    def run_step(target_params, dparams, state, temps):
        # A program's first execution on XLA:CPU costs 2-5x the later ones (buffers, thunks): its
        # time would tell the gate that rounds (a program per verify bucket) cost more than they do.
        before = len(ran)
        t = time.perf_counter()
        planned = gate.plain_run_length()
        if planned:
            ran.add("plain")
            state, stats = run_plain(target_params, dparams, state, np.int32(min(planned, MAX_PLAIN_RUN)))
            steps = int(stats.plain)  # waits for the program
            gate.observe_plain(time.perf_counter() - t if len(ran) == before else None, steps=steps)
        else:
            state, stats = run_round(target_params, dparams, state, temps)
            active, accepted = np.asarray(stats.active), np.asarray(stats.accepted)
            gate.observe_round(time.perf_counter() - t if len(ran) == before else None, accepted[active] + 1,
                               np.asarray(stats.forecast)[active] if head else None)
        return state, stats

    return run_step


def host_stats(stats: RoundStats) -> dict:
    """A step's stats as numpy arrays by name (not `dataclasses.asdict`, which deep-copies every
    array on the device first: a program per array, compiled on the first round, timed)."""
    return {f.name: np.asarray(getattr(stats, f.name)) for f in dataclasses.fields(stats)}


def _check_gamma(cfg: SpecConfig, dcfg: DrafterConfig) -> None:
    if dcfg.kind == "dspark" and cfg.gamma > dcfg.block_size:
        from dspark_jax.core.errors import UserError

        raise UserError(f"gamma={cfg.gamma} is larger than the drafter's block size {dcfg.block_size}")


def speculative_generate(
    target_params: dict, tcfg: ModelConfig, dparams: dict, dcfg: DrafterConfig, prompts: Sequence[Sequence[int]],
    *, max_new_tokens: int, cfg: SpecConfig, temperatures: Sequence[float] | None = None, seed: int = 0,
    progress: bool = False, gate: PlainStepGate | None = None,
) -> SpecResult:
    """Speculative decoding of a static batch of prompts (token ids). With cfg.plain_steps (or a
    `gate`), plain target steps replace rounds while drafts do not pay; they are recorded in
    `rounds` with "plain" set, and left out of `acceptance_lengths`."""
    _check_gamma(cfg, dcfg)
    tokens, lengths, max_len = pad_prompts(tcfg, prompts, max_new_tokens, slack=cfg.gamma + 1)
    temps = None if temperatures is None else jnp.asarray(temperatures, jnp.float32)
    args = (target_params, dparams, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32),
            jnp.full((len(prompts),), max_new_tokens, jnp.int32), jax.random.key(seed), flatten_prompts(prompts))
    t0 = time.perf_counter()
    run_prefill = compiled(spec_prefill, args, dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg.unscheduled(), max_len=max_len),
                           warm=True)
    gate = gate or (PlainStepGate.from_table(cfg.sps, len(prompts), cfg.gamma) if cfg.plain_steps else None)
    run_round = round_program(target_params, dparams, run_prefill.out_info, temps, tcfg=tcfg, dcfg=dcfg, cfg=cfg,
                              gate=gate)
    compile_s = time.perf_counter() - t0
    compiling = compiling_seconds()  # what the rounds compile (verify buckets) moves to compile_s
    t0 = running_clock()
    state = run_prefill(*args)
    jax.block_until_ready(state)
    t1 = running_clock()
    rounds = []
    bar = tqdm(total=max_new_tokens * len(prompts), disable=not progress, unit="tok", desc="speculative", leave=False)
    generated = int(np.sum(np.asarray(state.num_generated)))
    bar.update(generated)
    while not np.asarray(state.done).all():
        start = running_clock()
        state, stats = run_round(target_params, dparams, state, temps)
        rounds.append(host_stats(stats))
        rounds[-1]["seconds"] = running_clock() - start  # reading the stats waited for the round
        now = int(np.sum(np.asarray(state.num_generated)))
        bar.update(now - generated)
        generated = now
    bar.close()
    output, counts = np.asarray(state.output), np.asarray(state.num_generated)
    t2 = running_clock()
    return SpecResult([output[i, : counts[i]].tolist() for i in range(len(prompts))], t1 - t0, t2 - t1,
                      compile_s + compiling_seconds() - compiling, rounds)


def profile_verify(target_params, tcfg: ModelConfig, dcfg: DrafterConfig, *, rows: int, gamma: int, max_len: int,
                   model: str, dparams=None, repeats: int = 3):
    """Profile a round's cost for every token bucket up to rows x (gamma + 1) on this device: the
    SPS table the dspark schedulers plan with.

    The target verify pass is timed at each bucket. With `dparams`, the drafter's pass for `rows`
    rows (which every round pays whatever the scheduler decides) is timed in the same call, so
    SPS(B) = 1 / (draft + verify(B)) and Theta = tau x SPS(B) is the round's real throughput. On
    an accelerator serving a large target the draft is a rounding error; on a CPU with a 135M
    target it is a quarter of a round, and leaving it out makes verifying more look dearer than it
    is (the scheduler then under-verifies). The table also holds the plain step's cost (the verify
    pass of one token per row, no draft): what `fallback.PlainStepGate` starts from."""
    from dspark_jax.engine.sps import profile_sps, token_buckets

    buckets = token_buckets(rows * (gamma + 1))
    cache = decoder.cache_for(target_params, tcfg, rows, max_len)
    cache = dataclasses.replace(cache, lengths=jnp.full((rows,), max_len // 2, jnp.int32))  # a half-full context
    programs = {}
    for n in buckets:
        counts = jnp.full((rows,), n // rows, jnp.int32).at[: n % rows].add(1)
        verify = jnp.zeros((rows, gamma + 1), jnp.int32)
        fn = jax.jit(functools.partial(_target_pass, tcfg=tcfg, tap_layers=dcfg.tap_layers, bucket=n))
        programs[n] = functools.partial(fn.lower(target_params, cache=cache, verify_tokens=verify,
                                                 num_new=counts).compile(), target_params, cache=cache,
                                        verify_tokens=verify, num_new=counts)
    draft = lambda: None  # noqa: E731
    if dparams is not None:
        cfg = SpecConfig(gamma=gamma)
        prompt = jnp.ones((rows, max_len // 2), jnp.int32)
        state = spec_prefill(target_params, dparams, prompt, jnp.full((rows,), max_len // 2, jnp.int32),
                             jnp.full((rows,), max_len, jnp.int32), jax.random.key(0), tcfg=tcfg, dcfg=dcfg, cfg=cfg,
                             max_len=max_len)
        run_draft = compiled(spec_draft, (target_params, dparams, state, None), dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg))
        draft = functools.partial(run_draft, target_params, dparams, state, None)
    table = profile_sps(lambda n: (draft(), programs[n]()), buckets, warmup=1, repeats=repeats, model=model)
    # A plain step (DESIGN.md 3.3b) is the target's pass over one token per row, without the drafter.
    one = jnp.zeros((rows, 1), jnp.int32)
    fn = jax.jit(functools.partial(_target_pass, tcfg=tcfg, tap_layers=dcfg.tap_layers, bucket=None))
    step = functools.partial(fn.lower(target_params, cache=cache, verify_tokens=one, num_new=jnp.ones((rows,), jnp.int32))
                             .compile(), target_params, cache=cache, verify_tokens=one,
                             num_new=jnp.ones((rows,), jnp.int32))
    plain = profile_sps(lambda n: step(), (1,), warmup=1, repeats=repeats)
    return dataclasses.replace(table, plain_sps=plain.sps[0])


def _set_row(batched: jax.Array, single: jax.Array, row, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(batched, single.astype(batched.dtype), row, axis)


@functools.partial(jax.jit, donate_argnames=("state",))
def admit(state: SpecState, new: SpecState, row) -> SpecState:
    """Put a freshly prefilled one-request state into slot `row` of the running batch (continuous
    batching): the other slots keep their caches and progress untouched."""
    def cache_row(batched, single):  # KVCache, DrafterCache and Eagle3Cache share k, v, lengths
        axis = getattr(batched, "batch_axis", 1)  # the drafters' caches are always layer-stacked
        set_rows = lambda b, s: _set_row(b, s, row, axis)  # noqa: E731
        return dataclasses.replace(batched, k=jax.tree.map(set_rows, batched.k, single.k),
                                   v=jax.tree.map(set_rows, batched.v, single.v),
                                   lengths=_set_row(batched.lengths, single.lengths, row, 0))

    draft = drafting.DraftState(cache_row(state.draft.cache, new.draft.cache),
                                _set_row(state.draft.last_feature, new.draft.last_feature, row, 0))
    per_row = {f: _set_row(getattr(state, f), getattr(new, f), row, 0)
               for f in ("anchor", "output", "num_generated", "done", "max_new")}
    return SpecState(cache_row(state.cache, new.cache), draft, key=state.key, sched=state.sched, **per_row)


class RequestStats:
    """Per-slot running totals of the rounds a request took part in (continuous batching): rounds,
    tau (accepted + bonus) summed, draft tokens verified and, per draft position k, the rounds that
    reached k (1..k-1 accepted, k verified) and accepted it (decode's JSON fields); and the plain
    target steps it took instead of rounds."""

    def __init__(self, slots: int, gamma: int):
        self.k = np.arange(1, gamma + 1)[None, :]
        self.rounds = np.zeros(slots, np.int64)
        self.tau = np.zeros(slots, np.int64)
        self.verified = np.zeros(slots, np.int64)
        self.reached = np.zeros((slots, gamma), np.int64)
        self.accepted = np.zeros((slots, gamma), np.int64)
        self.plain = np.zeros(slots, np.int64)

    def add(self, stats: dict) -> None:
        active, a, n = stats["active"], stats["accepted"], stats["num_draft"]
        if stats.get("plain", 0):  # plain target steps: one token each, no draft, not a round
            self.plain += active  # the steps each row took part in
            return
        reached = (n[:, None] >= self.k) & (a[:, None] >= self.k - 1) & active[:, None]
        self.rounds += active
        self.tau += np.where(active, a + 1, 0)
        self.verified += np.where(active, n, 0)
        self.reached += reached
        self.accepted += reached & (a[:, None] >= self.k)

    def take(self, row: int) -> dict:
        """The totals of slot `row` (then reset for its next request)."""
        out = {"rounds": int(self.rounds[row]), "tau_sum": int(self.tau[row]),
               "verified_tokens": int(self.verified[row]), "position_reached": self.reached[row].tolist(),
               "position_accepted": self.accepted[row].tolist(), "plain_steps": int(self.plain[row])}
        for a in (self.rounds, self.tau, self.verified, self.reached, self.accepted, self.plain):
            a[row] = 0
        return out


def speculative_serve(
    target_params: dict, tcfg: ModelConfig, dparams: dict, dcfg: DrafterConfig, prompts: Sequence[Sequence[int]],
    *, slots: int, max_new_tokens: int, cfg: SpecConfig, temperatures: Sequence[float] | None = None, seed: int = 0,
    on_finish=None, on_progress=None, keep_rounds: bool = True, gate: PlainStepGate | None = None,
) -> SpecResult:
    """Continuous batching over `slots` request slots: when a request finishes, the next waiting
    prompt is prefilled into its slot while the other slots keep decoding. Rounds record which
    request each slot held ("request", -1 for an empty slot) unless keep_rounds=False (a long
    offline run need not keep every round).

    Every program (the prefill of each prompt-length bucket, the round, the admission) is compiled
    before the clock starts, but a verify bucket's, compiled off the clock when first needed. on_finish(index, token_ids, stats) is called as each request completes,
    stats holding its `RequestStats` totals and "wall_s" (its prefill to its last round);
    on_progress(tokens, seconds) after every round with the tokens generated so far. The result's
    `request_stats` holds the same dicts in input order. With cfg.plain_steps (or a `gate`),
    plain target steps replace rounds while drafts do not pay (counted as "plain_steps")."""
    _check_gamma(cfg, dcfg)
    _, _, max_len = pad_prompts(tcfg, prompts, max_new_tokens, slack=cfg.gamma + 1)
    temps = None if temperatures is None else jnp.asarray(temperatures, jnp.float32)
    statics = dict(tcfg=tcfg, dcfg=dcfg, cfg=cfg)
    prefill_statics = dict(statics, cfg=cfg.unscheduled(), max_len=max_len)

    def prefill_args(batch, budgets, key):
        tokens, lengths, _ = pad_prompts(tcfg, batch, max_new_tokens)
        return (target_params, dparams, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32),
                jnp.asarray(budgets, jnp.int32), key, flatten_prompts(batch))

    first = list(prompts[:slots])
    owner = list(range(len(first))) + [-1] * (slots - len(first))
    # Empty slots hold a copy of the first prompt with a budget of 1 token: done at once, never decoded.
    first_args = prefill_args(first + [prompts[0]] * (slots - len(first)),
                              [max_new_tokens] * len(first) + [1] * (slots - len(first)), jax.random.key(seed))
    t0 = time.perf_counter()
    run_first = compiled(spec_prefill, first_args, prefill_statics, warm=True)
    gate = gate or (PlainStepGate.from_table(cfg.sps, slots, cfg.gamma) if cfg.plain_steps else None)
    run_round = round_program(target_params, dparams, run_first.out_info, temps, **statics, gate=gate)
    run_refill, run_admit = {}, {}  # per prompt width bucket
    for p in prompts[slots:]:
        args = prefill_args([p], [max_new_tokens], jax.random.key(0))
        width = args[2].shape[1]
        if width not in run_refill:
            run_refill[width] = compiled(spec_prefill, args, prefill_statics, warm=True)
            run_admit[width] = compiled(admit, (run_first.out_info, run_refill[width].out_info, np.int32(0)), {},
                                        warm=True)
    jax.random.key(seed)  # the refills' key op, compiled here rather than at the first refill
    compile_s = time.perf_counter() - t0
    compiling = compiling_seconds()

    totals = RequestStats(slots, cfg.gamma)
    rounds = []

    def refill(state, row, index):
        args = prefill_args([prompts[index]], [max_new_tokens], jax.random.key(seed + 1 + index))
        new = run_refill[args[2].shape[1]](*args)
        return run_admit[args[2].shape[1]](state, new, np.int32(row))

    def step(state, owner):
        t = running_clock()
        state, stats = run_round(target_params, dparams, state, temps)
        stats = host_stats(stats)
        totals.add(stats)
        if keep_rounds:
            rounds.append({"request": np.asarray(owner), **stats, "seconds": running_clock() - t})
        return state

    results, request_stats, prefill_s, decode_s = continuous_batching(
        lambda: run_first(*first_args), refill, step, requests=len(prompts), owner=owner, take=totals.take,
        on_finish=on_finish, on_progress=on_progress)
    return SpecResult(results, prefill_s, decode_s, compile_s + compiling_seconds() - compiling, rounds,
                      request_stats)
