"""The invariant speculative verification rests on: prefill + ragged extends + decode steps (with
rollbacks) give the same logits as one full prefill of each row."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=128, qk_norm=True)


def reference_logits(params, cfg, row_tokens):
    n = len(row_tokens)
    cache = decoder.init_cache(cfg, 1, n)
    h, _, _ = decoder.forward(params, cfg, jnp.asarray([row_tokens]), cache, jnp.array([n]))
    return np.asarray(decoder.logits(params, cfg, h))[0]


def run_schedule(params, cfg, sequences, chunks, max_len=64, rollback_garbage=False):
    """Feed each row its tokens in the given per-row chunk sizes; collect logits per position."""
    B = len(sequences)
    cache = decoder.init_cache(cfg, B, max_len)
    got = [dict() for _ in range(B)]
    fed = [0] * B
    rng = np.random.default_rng(7)
    for sizes in chunks:
        T = max(max(sizes), 1)
        tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)  # padding is random junk
        if rollback_garbage:
            # Speculative-style: write junk first, then roll back to the committed length.
            junk_cache = decoder.forward(params, cfg, jnp.asarray(tokens), cache, jnp.full((B,), T))[1]
            cache = dataclasses.replace(junk_cache, lengths=cache.lengths)
        for b, n in enumerate(sizes):
            tokens[b, :n] = sequences[b][fed[b]: fed[b] + n]
        h, cache, _ = decoder.forward(params, cfg, jnp.asarray(tokens), cache, jnp.asarray(sizes, jnp.int32))
        lg = np.asarray(decoder.logits(params, cfg, h))
        for b, n in enumerate(sizes):
            for t in range(n):
                got[b][fed[b] + t] = lg[b, t]
            fed[b] += n
    np.testing.assert_array_equal(np.asarray(cache.lengths), fed)
    return got


@pytest.mark.parametrize("rollback_garbage,weights", [(False, "float32"), (True, "float32"), (True, "bfloat16")])
def test_ragged_extend_matches_full_prefill(rollback_garbage, weights):
    """bfloat16: weights stored in bf16, activations in fp32 (`--dtype bfloat16` on a CPU), where
    decode steps run their one-row products as two rows (`decoder.weight_einsum`)."""
    params = decoder.init_params(CFG, jax.random.key(0), scale=0.1)
    params = jax.tree.map(lambda a: a.astype(weights), params)
    rng = np.random.default_rng(0)
    lengths = [30, 22, 27]
    sequences = [rng.integers(0, CFG.vocab_size, size=n).tolist() for n in lengths]
    # prefill of different lengths, ragged extends (one row idle), then single-token decode steps.
    chunks = [[5, 9, 3], [4, 0, 6], [7, 5, 2], [8, 8, 8]] + [[1, 0, 1]] * 6
    totals = np.sum(chunks, axis=0)
    chunks.append([int(l - t) for l, t in zip(lengths, totals)])
    got = run_schedule(params, CFG, sequences, chunks, rollback_garbage=rollback_garbage)
    for b, seq in enumerate(sequences):
        ref = reference_logits(params, CFG, seq)
        ours = np.stack([got[b][i] for i in range(len(seq))])
        np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=0)


def test_cache_tail_is_invisible():
    """Anything past a row's length, whatever it holds, cannot change the outputs."""
    params = decoder.init_params(CFG, jax.random.key(1), scale=0.1)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, size=(2, 10)), jnp.int32)
    cache = decoder.init_cache(CFG, 2, 32)
    h1, c1, _ = decoder.forward(params, CFG, tokens, cache, jnp.array([10, 6]))
    # keys are cached transposed, [L, B, Hkv, D, S]; values [L, B, Hkv, S, D]
    noisy = dataclasses.replace(c1, k=c1.k.at[..., 10:].set(5.0), v=c1.v.at[:, :, :, 10:].set(-3.0))
    noisy = dataclasses.replace(noisy, k=noisy.k.at[:, 1, ..., 6:].set(7.0))
    nxt = jnp.array([[3], [4]], jnp.int32)
    a, _, _ = decoder.forward(params, CFG, nxt, c1, jnp.array([1, 1]))
    b, _, _ = decoder.forward(params, CFG, nxt, noisy, jnp.array([1, 1]))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_packed_forward_matches_each_sequence_alone():
    """Sequences packed into one row (training) never see each other; positions restart per sequence."""
    params = decoder.init_params(CFG, jax.random.key(2), scale=0.1)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(1, CFG.vocab_size, size=n).tolist() for n in (9, 5, 11)]
    tokens = np.zeros((1, 32), np.int32)
    positions = np.zeros((1, 32), np.int32)
    segments = np.zeros((1, 32), np.int32)
    start = 0
    for i, s in enumerate(seqs):
        tokens[0, start:start + len(s)] = s
        positions[0, start:start + len(s)] = np.arange(len(s))
        segments[0, start:start + len(s)] = i + 1
        start += len(s)
    hidden, taps = decoder.forward_packed(params, CFG, jnp.asarray(tokens), jnp.asarray(positions),
                                          jnp.asarray(segments), tap_layers=(0, 1, 2))
    start = 0
    for s in seqs:
        cache = decoder.init_cache(CFG, 1, len(s))
        h_alone, _, taps_alone = decoder.forward(params, CFG, jnp.asarray([s]), cache, jnp.array([len(s)]), (0, 1, 2))
        np.testing.assert_allclose(np.asarray(hidden[0, start:start + len(s)]), np.asarray(h_alone[0]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(taps[:, 0, start:start + len(s)]), np.asarray(taps_alone[:, 0]), atol=2e-5)
        start += len(s)


def test_packed_rows_longer_than_an_attention_block_match_each_sequence_alone():
    """Rows of 300 slots: sequences span several of the packed attention's 128-token key blocks
    and straddle block edges; a row boundary falls inside a block of the flattened rows."""
    params = decoder.init_params(CFG, jax.random.key(4), scale=0.1)
    rng = np.random.default_rng(4)
    # The third row starts 88 slots into a block; its block from slot 896 needs 4 key blocks back.
    lengths = [(299,), (130, 100, 60), (299,)]
    S = 300
    tokens, positions, segments = (np.zeros((len(lengths), S), np.int32) for _ in range(3))
    seqs = []
    for b, row in enumerate(lengths):
        start = 0
        for i, n in enumerate(row):
            seqs.append((b, start, rng.integers(1, CFG.vocab_size, size=n).tolist()))
            tokens[b, start:start + n] = seqs[-1][2]
            positions[b, start:start + n] = np.arange(n)
            segments[b, start:start + n] = i + 1
            start += n
    hidden, taps = decoder.forward_packed(params, CFG, jnp.asarray(tokens), jnp.asarray(positions),
                                          jnp.asarray(segments), tap_layers=(1,))
    for b, start, s in seqs:
        cache = decoder.init_cache(CFG, 1, len(s))
        h_alone, _, taps_alone = decoder.forward(params, CFG, jnp.asarray([s]), cache, jnp.array([len(s)]), (1,))
        np.testing.assert_allclose(np.asarray(hidden[b, start:start + len(s)]), np.asarray(h_alone[0]), atol=2e-5)
        np.testing.assert_allclose(np.asarray(taps[:, b, start:start + len(s)]), np.asarray(taps_alone[:, 0]),
                                   atol=2e-5)


def test_one_row_decode_steps_match_full_prefill_with_bf16_weights():
    """A single row decoding token by token: every product has one row, which bf16 weights run as
    two on a CPU; the logits must be the full prefill's."""
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), decoder.init_params(CFG, jax.random.key(3), scale=0.1))
    seq = np.random.default_rng(3).integers(0, CFG.vocab_size, size=20).tolist()
    got = run_schedule(params, CFG, [seq], [[6]] + [[1]] * 14)
    ours = np.stack([got[0][i] for i in range(len(seq))])
    np.testing.assert_allclose(ours, reference_logits(params, CFG, seq), atol=2e-5, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the rotary tables are fenced on a CPU only")
def test_rotary_tables_are_computed_once_per_pass():
    """XLA:CPU would otherwise evaluate cos and sin inside every layer's q and k rotation, per head
    and element (`decoder._materialized`): a decode pass computes each table once."""
    cfg = dataclasses.replace(CFG, num_layers=3)
    params = decoder.with_layout(decoder.init_params(cfg, jax.random.key(0), scale=0.1), cfg, "per_layer")
    cache = decoder.init_cache(cfg, 2, 32)

    def step(params, cache, tokens):
        return decoder.forward(params, cfg, tokens, cache, jnp.array([4, 3]))[0]

    hlo = jax.jit(step).lower(params, cache, jnp.zeros((2, 4), jnp.int32)).compile().as_text()
    # one of each per branch of the fence; without it, one per layer for q and one for k (6)
    assert hlo.count(" cosine(") <= 2 and hlo.count(" sine(") <= 2
