"""Plain (non-speculative) batched generation with the target model.

Prompts of different lengths are right-padded to a length bucket and prefilled in one pass; decoding
then runs in jitted chunks of `chunk` steps (a `lax.while_loop` that also exits early once every
row has stopped), so Python is touched once per chunk, which is where the progress bar advances.
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

from dspark_jax.core.errors import UserError
from dspark_jax.core.platform import traced_for_cpu
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.models.sampling import SamplingConfig, sample


def bucket(n: int, minimum: int = 16, step: int = 128) -> int:
    """Static length for n tokens: the next power of two up to `step`, then the next multiple of
    `step` (one compilation per bucket, not per length, without padding long prompts by up to 2x)."""
    if n <= step:
        return max(minimum, 1 << max(0, int(n - 1).bit_length()))
    return -(-n // step) * step


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: decoder.KVCache
    last_token: jax.Array  # [B] the token to feed next
    output: jax.Array  # [B, max_new] generated ids (valid up to num_generated)
    num_generated: jax.Array  # [B]
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] each row's random key: its t-th token is drawn with fold_in(key, t)
    step: jax.Array  # scalar int32


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated ids per prompt (a stop token, if hit, is the last id)
    prefill_s: float
    decode_s: float
    compile_s: float  # XLA compilation, kept out of the timings above

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s


def stop_mask(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.any(tokens[..., None] == jnp.asarray(stop_ids, jnp.int32), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_len", "max_new", "stop_ids", "width"))
def prefill(params, flat: FlatPrompts, lengths, keys, *, cfg: ModelConfig, sampling: SamplingConfig, max_len: int,
            max_new: int, stop_ids: tuple[int, ...], width: int) -> DecodeState:
    """Prefill every row from its prompt's tokens, flattened (see `flatten_prompts`); keys: one
    random key per row (`DecodeState.keys`)."""
    B = lengths.shape[0]
    cache = decoder.cache_for(params, cfg, B, max_len)
    hidden, cache, _ = decoder.forward_flat(params, cfg, flat.tokens, flat.rows, flat.positions, flat.valid, cache,
                                            width=width, prefill=True)
    cache = dataclasses.replace(cache, lengths=lengths)
    last_hidden = hidden[jnp.cumsum(lengths) - 1]  # each row's last prompt token
    first = sample(token_keys(keys, jnp.zeros((B,), jnp.int32)), decoder.logits(params, cfg, last_hidden), sampling)
    output = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(first)
    done = stop_mask(first, stop_ids) | (max_new <= 1)
    return DecodeState(cache, first, output, jnp.ones((B,), jnp.int32), done, keys, jnp.int32(1))


def token_keys(keys: jax.Array, index: jax.Array) -> jax.Array:
    """The key each row draws its index-th new token with: a row's tokens depend on its own key
    alone, not on the batch it runs in, its row or the step count (continuous batching, resumes)."""
    return jax.vmap(jax.random.fold_in)(keys, index)


def row_keys(key: jax.Array, ids) -> jax.Array:
    """One key per request id, fold_in(key, id): how `generate` (id = row) and `serve` (id = the
    request's index, or the ids the caller gives) key their rows, so both give the same draws."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.asarray(ids, jnp.uint32))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "stop_ids", "steps"), donate_argnames=("state",))
def decode_chunk(params, state: DecodeState, *, cfg: ModelConfig, sampling: SamplingConfig,
                 stop_ids: tuple[int, ...], steps: int) -> DecodeState:
    max_new = state.output.shape[1]
    end = jnp.minimum(state.step + steps, max_new)

    def cond(s: DecodeState):
        return (s.step < end) & ~jnp.all(s.done)

    def body(s: DecodeState):
        return decode_step(params, s, cfg=cfg, sampling=sampling, stop_ids=stop_ids)

    return jax.lax.while_loop(cond, body, state)


def decode_step(params, s: DecodeState, *, cfg: ModelConfig, sampling: SamplingConfig,
                stop_ids: tuple[int, ...]) -> DecodeState:
    """One token for every row that is not done (the body of the decode loops)."""
    max_new = s.output.shape[1]
    active = ~s.done
    hidden, cache, _ = decoder.forward(params, cfg, s.last_token[:, None], s.cache, active.astype(jnp.int32))
    token = sample(token_keys(s.keys, s.num_generated), decoder.logits(params, cfg, hidden[:, 0]), sampling)
    token = jnp.where(active, token, s.last_token)
    rows = jnp.arange(token.shape[0])
    output = s.output.at[rows, s.num_generated].set(jnp.where(active, token, 0), mode="drop")
    num_generated = s.num_generated + active
    done = s.done | (active & stop_mask(token, stop_ids)) | (num_generated >= max_new)
    return DecodeState(cache, token, output, num_generated, done, s.keys, s.step + 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FlatPrompts:
    """All prompts' tokens back to back, padded to a token bucket: the dense layers of a prefill
    then cost the batch's real tokens, not rows x the longest prompt (often 2-3x less)."""
    tokens: jax.Array  # [N] int32
    rows: jax.Array  # [N] int32 the prompt each token belongs to
    positions: jax.Array  # [N] int32 its position in that prompt
    valid: jax.Array  # [N] bool: False for the padding at the end


def flatten_prompts(prompts: Sequence[Sequence[int]]) -> FlatPrompts:
    lengths = [len(p) for p in prompts]
    n = bucket(sum(lengths))
    tokens, rows, positions = (np.zeros(n, np.int32) for _ in range(3))
    tokens[: sum(lengths)] = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    rows[: sum(lengths)] = np.repeat(np.arange(len(prompts)), lengths)
    positions[: sum(lengths)] = np.concatenate([np.arange(length) for length in lengths])
    return FlatPrompts(jnp.asarray(tokens), jnp.asarray(rows), jnp.asarray(positions),
                       jnp.asarray(np.arange(n) < sum(lengths)))


def padded_as_flat(tokens: jax.Array, lengths: jax.Array) -> FlatPrompts:
    """Right-padded prompts [B, W] as FlatPrompts of all B x W slots, the padding invalid (for a
    caller that holds only the padded layout; the dense layers then run on every slot)."""
    B, W = tokens.shape
    rows = jnp.repeat(jnp.arange(B, dtype=jnp.int32), W)
    positions = jnp.tile(jnp.arange(W, dtype=jnp.int32), B)
    return FlatPrompts(tokens.reshape(-1).astype(jnp.int32), rows, positions, positions < lengths[rows])


def unflatten(x: jax.Array, flat: FlatPrompts, rows: int, width: int) -> jax.Array:
    """Per-token values of a flat prefill [N, ...] laid out per row, [rows, width, ...] (zeros
    where a row has no token)."""
    target = jnp.where(flat.valid, flat.rows, rows)  # padding goes out of range and is dropped
    return jnp.zeros((rows, width) + x.shape[1:], x.dtype).at[target, flat.positions].set(x, mode="drop")


def check_context(cfg: ModelConfig, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
    longest = max(prompt_lengths)
    if min(prompt_lengths) == 0:
        raise UserError("empty prompt: nothing to condition on")
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise UserError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the model's context "
                        f"of {cfg.max_position_embeddings} tokens")


def pad_prompts(cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int, slack: int = 0):
    """Right-pad prompts to a length bucket -> (tokens [B, W], lengths, KV-cache length). The cache
    covers the prompt bucket (prefill writes padding there), every generated token and `slack`
    positions a speculative round may write past them."""
    lengths = [len(p) for p in prompts]
    check_context(cfg, lengths, max_new_tokens)
    width = bucket(max(lengths))
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths, bucket(max(width, max(lengths) + max_new_tokens + slack), minimum=64)


def generate(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    chunk: int = 16,
    progress: bool = False,
) -> GenerationResult:
    """Generate up to `max_new_tokens` for every prompt (token ids); rows stop at a stop id."""
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    tokens, lengths, max_len = pad_prompts(cfg, prompts, max_new_tokens)
    stop = tuple(sorted(set(int(s) for s in stop_ids)))

    args = (params, flatten_prompts(prompts), jnp.asarray(lengths, jnp.int32),
            row_keys(jax.random.key(seed), np.arange(len(prompts))))
    t0 = time.perf_counter()
    run_prefill = compiled(prefill, args, dict(cfg=cfg, sampling=sampling, max_len=max_len, max_new=max_new_tokens,
                                               stop_ids=stop, width=tokens.shape[1]), warm=True)
    run_chunk = compiled(decode_chunk, (params, run_prefill.out_info),
                         dict(cfg=cfg, sampling=sampling, stop_ids=stop, steps=chunk), warm=True)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    state = run_prefill(*args)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    bar = tqdm(total=max_new_tokens, disable=not progress, unit="tok", desc="decode", leave=False)
    bar.update(1)
    while True:
        step, done = int(state.step), bool(np.all(np.asarray(state.done)))  # numpy: no eager program to compile
        if done or step >= max_new_tokens:
            break
        state = run_chunk(params, state)
        bar.update(int(state.step) - step)
    bar.close()
    output, counts = np.asarray(state.output), np.asarray(state.num_generated)
    t2 = time.perf_counter()
    return GenerationResult([output[i, : counts[i]].tolist() for i in range(len(prompts))],
                            t1 - t0, t2 - t1, compile_s)



# ------------------------------------------------------------------ continuous batching


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "stop_ids", "steps"), donate_argnames=("state",))
def serve_chunk(params, state: DecodeState, *, cfg: ModelConfig, sampling: SamplingConfig,
                stop_ids: tuple[int, ...], steps: int) -> DecodeState:
    """Up to `steps` decode steps, ending early as soon as a row that was decoding finishes (so the
    host refills its slot at once) or every row is done."""
    decoding = ~state.done

    def cond(carry):
        i, s = carry
        return (i < steps) & ~jnp.any(s.done & decoding) & ~jnp.all(s.done)

    def body(carry):
        i, s = carry
        return i + 1, decode_step(params, s, cfg=cfg, sampling=sampling, stop_ids=stop_ids)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def set_cache_row(batched: decoder.KVCache, single: decoder.KVCache, row) -> decoder.KVCache:
    """`batched` with row `row` replaced by the one row of `single` (same layout and length)."""
    axis = batched.batch_axis

    def put(b, s):
        return jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), row, axis)

    return decoder.KVCache(jax.tree.map(put, batched.k, single.k), jax.tree.map(put, batched.v, single.v),
                           jax.lax.dynamic_update_slice_in_dim(batched.lengths, single.lengths, row, 0))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "max_len", "max_new", "stop_ids", "width"))
def prefill_request(params, flat: FlatPrompts, lengths, key, request_id, *, cfg: ModelConfig,
                    sampling: SamplingConfig, max_len: int, max_new: int, stop_ids: tuple[int, ...],
                    width: int) -> DecodeState:
    """`prefill` of one request keyed by `row_keys(key, [request_id])` (no host-side key op per refill)."""
    return prefill(params, flat, lengths, row_keys(key, request_id[None]), cfg=cfg, sampling=sampling,
                   max_len=max_len, max_new=max_new, stop_ids=stop_ids, width=width)


@functools.partial(jax.jit, donate_argnames=("state",))
def admit_row(state: DecodeState, new: DecodeState, row) -> DecodeState:
    """Put a freshly prefilled one-request state into slot `row` of the running batch; the other
    rows keep their caches, progress and keys."""
    def put(b, s):
        return jax.lax.dynamic_update_slice_in_dim(b, s.astype(b.dtype), row, 0)

    return DecodeState(set_cache_row(state.cache, new.cache, row), put(state.last_token, new.last_token),
                       put(state.output, new.output), put(state.num_generated, new.num_generated),
                       put(state.done, new.done), put(state.keys, new.keys), state.step)


def serve(
    params: dict,
    cfg: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    slots: int,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_ids: Sequence[int] = (),
    seed: int = 0,
    request_ids: Sequence[int] | None = None,
    each_alone: bool = False,
    chunk: int = 16,
    on_finish=None,
    on_progress=None,
) -> GenerationResult:
    """Plain decoding with continuous batching: `slots` rows decode together and a finished
    request's row is refilled with the next waiting prompt at once (prefilled on its own, then
    copied into the row), while the other rows keep decoding. Results are in input order.

    The KV cache is sized for the longest prompt. on_finish(index, token_ids, {"wall_s": ...}) is
    called as each request completes (wall_s: from its prefill to its last token, XLA compilation
    excluded); on_progress(tokens, seconds) after every chunk with the tokens generated so far.
    Request i draws its tokens with key fold_in(key(seed), request_ids[i]) (default: i, as row i
    of `generate`), so greedy and sampled output are token for token `generate`'s whatever the
    slots, up to floating-point differences between batch shapes. `each_alone` prefills the first
    `slots` requests one by one too (slower to start): with the batch-invariant CPU kernels
    (`models.cpu_kernels`: fp32, <= 32 slots) a request's tokens then do not depend on which others
    run beside it, which makes resumed datagen runs reproduce uninterrupted ones."""
    if max_new_tokens < 1:
        raise UserError("max_new_tokens must be at least 1")
    n = len(prompts)
    slots = min(slots, n)
    ids = np.asarray(range(n) if request_ids is None else request_ids, np.uint32)
    if len(ids) != n:
        raise ValueError("one request id per prompt")
    _, _, max_len = pad_prompts(cfg, prompts, max_new_tokens)
    stop = tuple(sorted(set(int(s) for s in stop_ids)))
    base_key = jax.random.key(seed)
    statics = dict(cfg=cfg, sampling=sampling, max_len=max_len, max_new=max_new_tokens, stop_ids=stop)

    def prefill_args(batch):
        return (params, flatten_prompts(batch), jnp.asarray([len(p) for p in batch], jnp.int32))

    t0 = time.perf_counter()
    if each_alone:
        first_args = (params,)
        run_first = compiled(empty_state, first_args, dict(cfg=cfg, rows=slots, max_len=max_len, max_new=max_new_tokens),
                             warm=True)
    else:
        first_args = prefill_args(prompts[:slots]) + (row_keys(base_key, ids[:slots]),)
        run_first = compiled(prefill, first_args, dict(statics, width=bucket(max(len(p) for p in prompts[:slots]))),
                             warm=True)
    run_chunk = compiled(serve_chunk, (params, run_first.out_info),
                         dict(cfg=cfg, sampling=sampling, stop_ids=stop, steps=chunk), warm=True)
    run_refill = {}  # one program per prompt length bucket
    for p in prompts if each_alone else prompts[slots:]:
        w = bucket(len(p))
        if w not in run_refill:
            run_refill[w] = compiled(prefill_request, prefill_args([p]) + (base_key, np.uint32(0)),
                                     dict(statics, width=w), warm=True)
    run_admit = None
    if run_refill:
        one = next(iter(run_refill.values())).out_info
        run_admit = compiled(admit_row, (run_first.out_info, one, np.int32(0)), {}, warm=True)
    compile_s = time.perf_counter() - t0

    def refill(state, row, index):
        p = prompts[index]
        new = run_refill[bucket(len(p))](*prefill_args([p]), base_key, ids[index])
        return run_admit(state, new, np.int32(row))

    def first():
        state = run_first(*first_args)
        if each_alone:
            for row in range(slots):
                state = refill(state, row, row)
        return state

    results, _, prefill_s, decode_s = continuous_batching(
        first, refill, lambda state, owner: run_chunk(params, state),
        requests=n, owner=list(range(slots)), on_finish=on_finish, on_progress=on_progress)
    return GenerationResult(results, prefill_s, decode_s, compile_s)


@functools.partial(jax.jit, static_argnames=("cfg", "rows", "max_len", "max_new"))
def empty_state(params, *, cfg: ModelConfig, rows: int, max_len: int, max_new: int) -> DecodeState:
    """A batch of `rows` empty slots (every row done), for `serve` to fill request by request."""
    zeros = jnp.zeros((rows,), jnp.int32)
    return DecodeState(decoder.cache_for(params, cfg, rows, max_len), zeros, jnp.zeros((rows, max_new), jnp.int32),
                       zeros, jnp.ones((rows,), bool), row_keys(jax.random.key(0), np.arange(rows)), jnp.int32(0))


def continuous_batching(first, refill, step, *, requests: int, owner: list[int], take=None, on_finish=None,
                        on_progress=None):
    """The refill loop both engines share. `first()` prefills the first requests into their rows
    (owner[row]: the request a row holds, -1 for none); whenever rows are done (`state.done`),
    their tokens are taken (`state.output[row, :state.num_generated[row]]`, stats `take(row)` plus
    "wall_s" from the request's prefill) and `refill(state, row, index)` admits the next waiting
    request into the row; otherwise `step(state, owner)` advances every row. Returns (tokens and
    stats per request in input order, prefill seconds, decode seconds), all on `running_clock`."""
    t_start = running_clock()
    state = first()
    jax.block_until_ready(state)
    prefill_s = running_clock() - t_start
    results: list[list[int] | None] = [None] * requests
    stats: list[dict | None] = [None] * requests
    started = [t_start] * len(owner)
    waiting, finished_tokens = sum(o >= 0 for o in owner), 0
    while True:
        done, counts = np.asarray(state.done), np.asarray(state.num_generated)
        finished = [r for r, i in enumerate(owner) if i >= 0 and done[r]]
        if finished:
            output, now = np.asarray(state.output), running_clock()
            for r in finished:
                i = owner[r]
                results[i] = output[r, : counts[r]].tolist()
                stats[i] = {**(take(r) if take is not None else {}), "wall_s": now - started[r]}
                finished_tokens += len(results[i])
                owner[r] = -1
                if on_finish is not None:
                    on_finish(i, results[i], stats[i])
                if waiting < requests:
                    t = running_clock()
                    state = refill(state, r, waiting)
                    jax.block_until_ready(state)
                    owner[r], started[r] = waiting, t
                    waiting += 1
                    prefill_s += running_clock() - t
            continue  # a refilled request may be done already (a stop token first)
        if all(o < 0 for o in owner):
            break
        state = step(state, owner)
        if on_progress is not None:
            counts = np.asarray(state.num_generated)
            on_progress(finished_tokens + sum(int(counts[r]) for r, i in enumerate(owner) if i >= 0),
                        running_clock() - t_start)
    wall = running_clock() - t_start
    return results, stats, prefill_s, wall - prefill_s


_COMPILED: dict = {}
_COMPILING_S = [0.0]  # seconds `compiled` spent compiling and warming new programs, in all


def compiling_seconds() -> float:
    """Seconds spent so far compiling (and warming) programs in `compiled`."""
    return _COMPILING_S[0]


def running_clock() -> float:
    """A clock (seconds) that stops while `compiled` compiles: the speculative engine compiles a
    verify bucket's program when a round first needs it, and the engines time their runs on this
    clock, so compilation stays out of every timing wherever it happens."""
    return time.perf_counter() - _COMPILING_S[0]


def compiled(fn, args: tuple, statics: dict, warm: bool = False):
    """Ahead-of-time compile jitted `fn` for these argument shapes and static keyword arguments
    (cached), so the caller can time execution without XLA compilation. The key holds each
    argument's sharding too: a program compiled for replicated params does not take sharded ones.

    warm=True also runs the new program once, on zeros wherever `args` holds a shape
    (jax.ShapeDtypeStruct: pass shapes, not arrays, for donated arguments), where the caller
    times steps: on XLA:CPU a program's first execution costs 2-5x its later ones (30-130 ms for
    a SmolLM2 round), a one-off cost per program like its compilation, and a decode loop runs a
    program per shape (the engine one per verify bucket)."""
    leaves, treedef = jax.tree.flatten(args)
    key = (fn.__name__, treedef, tuple((a.shape, str(a.dtype), getattr(a, "sharding", None)) for a in leaves),
           tuple(sorted(statics.items())))
    if key not in _COMPILED:
        start = time.perf_counter()
        program = fn.lower(*args, **statics).compile()
        if warm and traced_for_cpu() and jax.process_count() == 1:
            jax.block_until_ready(program(*jax.tree.map(_zeros_like_shape, args)))
        _COMPILED[key] = program
        _COMPILING_S[0] += time.perf_counter() - start
    return _COMPILED[key]


def _zeros_like_shape(leaf):
    """Zeros (keys: key 0 and its splits) for a shape, placed as the program expects; arrays as they are."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        out = jax.random.split(jax.random.key(0), leaf.shape) if leaf.shape else jax.random.key(0)
    else:
        out = jnp.zeros(leaf.shape, leaf.dtype)
    return out if leaf.sharding is None else jax.device_put(out, leaf.sharding)
