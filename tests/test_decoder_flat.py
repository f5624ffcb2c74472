"""forward_flat (flattened verify over a token bucket) == forward over the padded [B, T] layout."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig

CFG = ModelConfig(family="qwen3", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=128, qk_norm=True)
TAPS = (0, 1, 2)
MAX_LEN = 24
COMMITTED = [7, 11, 4]   # per-row committed lengths (plus a 4th row never mentioned by the flat call)
NUM_NEW = [3, 0, 2, 0]


def committed_cache(params, rng):
    B = len(NUM_NEW)
    lengths = COMMITTED + [9]
    tokens = rng.integers(0, CFG.vocab_size, size=(B, max(lengths))).astype(np.int32)
    cache = decoder.init_cache(CFG, B, MAX_LEN)
    _, cache, _ = decoder.forward(params, CFG, jnp.asarray(tokens), cache, jnp.asarray(lengths, jnp.int32))
    return cache


def flat_layout(new_tokens, order, n_bucket, rng):
    """Flatten (row, t) pairs in the given order, then pad with junk entries up to n_bucket."""
    tokens, rows, positions, valid = [], [], [], []
    for b, t in order:
        tokens.append(new_tokens[b, t]); rows.append(b); positions.append(COMMITTED[b] + t); valid.append(True)
    while len(tokens) < n_bucket:  # padding pointing at real rows and live positions: must be dropped
        tokens.append(int(rng.integers(0, CFG.vocab_size))); rows.append(int(rng.integers(0, 4)))
        positions.append(int(rng.integers(0, MAX_LEN))); valid.append(False)
    return (jnp.asarray(tokens, jnp.int32), jnp.asarray(rows, jnp.int32), jnp.asarray(positions, jnp.int32),
            jnp.asarray(valid))


def test_flat_matches_padded_forward():
    params = decoder.init_params(CFG, jax.random.key(0), scale=0.1)
    rng = np.random.default_rng(0)
    cache = committed_cache(params, rng)
    new_tokens = rng.integers(0, CFG.vocab_size, size=(4, 3)).astype(np.int32)
    h_ref, c_ref, taps_ref = decoder.forward(params, CFG, jnp.asarray(new_tokens), cache,
                                             jnp.asarray(NUM_NEW, jnp.int32), TAPS)
    order = [(2, 1), (0, 0), (0, 2), (2, 0), (0, 1)]  # interleaved, out of position order
    tok, rows, pos, valid = flat_layout(new_tokens, order, 8, rng)
    h, c, taps = decoder.forward_flat(params, CFG, tok, rows, pos, valid, cache, TAPS)
    assert h.shape == (8, CFG.hidden_size) and taps.shape == (len(TAPS), 8, CFG.hidden_size)
    np.testing.assert_array_equal(np.asarray(c.lengths), np.asarray(cache.lengths))  # not committed

    for n, (b, t) in enumerate(order):
        np.testing.assert_allclose(np.asarray(h[n]), np.asarray(h_ref[b, t]), atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(taps[:, n]), np.asarray(taps_ref[:, b, t]), atol=2e-5, rtol=0)
        p = COMMITTED[b] + t
        np.testing.assert_allclose(np.asarray(c.k[:, b, ..., p]), np.asarray(c_ref.k[:, b, ..., p]), atol=2e-5, rtol=0)
        np.testing.assert_allclose(np.asarray(c.v[:, b, :, p]), np.asarray(c_ref.v[:, b, :, p]), atol=2e-5, rtol=0)

    # Everything else in the cache (committed prefixes, padding targets, row 1, row 3) is untouched.
    written = np.zeros((c.v.shape[1], c.v.shape[3]), bool)  # (row, position) of values [L, B, Hkv, S, D]
    for b, t in order:
        written[b, COMMITTED[b] + t] = True
    # keys are [L, B, Hkv, D, S], values [L, B, Hkv, S, D]: bring (row, position) to the front of both
    for new, old, order_axes in ((c.k, cache.k, (0, 1, 4, 2, 3)), (c.v, cache.v, (0, 1, 3, 2, 4))):
        new, old = (np.asarray(a).transpose(order_axes) for a in (new, old))
        np.testing.assert_array_equal(new[:, ~written], old[:, ~written])


def test_flat_jit_fixed_bucket_varying_valid_counts():
    params = decoder.init_params(CFG, jax.random.key(1), scale=0.1)
    rng = np.random.default_rng(1)
    cache = committed_cache(params, rng)
    new_tokens = rng.integers(0, CFG.vocab_size, size=(4, 3)).astype(np.int32)
    traces = []

    @jax.jit
    def step(tok, rows, pos, valid, cache):
        traces.append(1)
        return decoder.forward_flat(params, CFG, tok, rows, pos, valid, cache)

    for num_new in ([3, 0, 2, 0], [1, 1, 1, 0], [0, 0, 0, 0], [3, 3, 2, 0]):
        order = [(b, t) for t in range(3) for b in range(3) if t < num_new[b]]
        tok, rows, pos, valid = flat_layout(new_tokens, order, 8, rng)
        h, c, _ = step(tok, rows, pos, valid, cache)
        h_ref, c_ref, _ = decoder.forward(params, CFG, jnp.asarray(new_tokens), cache,
                                          jnp.asarray(num_new, jnp.int32))
        for n, (b, t) in enumerate(order):
            np.testing.assert_allclose(np.asarray(h[n]), np.asarray(h_ref[b, t]), atol=2e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(c.k[:, b, ..., COMMITTED[b] + t]),
                                       np.asarray(c_ref.k[:, b, ..., COMMITTED[b] + t]), atol=2e-5, rtol=0)
        if not order:
            np.testing.assert_array_equal(np.asarray(c.k), np.asarray(cache.k))
    assert len(traces) == 1  # one compile for the bucket, whatever the valid count


def flattened_prompts(lengths, pad, rng, vocab):
    """Prompts back to back from position 0 (generate.flatten_prompts' layout) plus `pad` padding
    entries, which flatten_prompts gives row 0 and position 0."""
    n = sum(lengths) + pad
    tokens, rows, positions = (np.zeros(n, np.int32) for _ in range(3))
    tokens[: sum(lengths)] = rng.integers(0, vocab, size=sum(lengths))
    rows[: sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    positions[: sum(lengths)] = np.concatenate([np.arange(length) for length in lengths])
    return tokens, rows, positions, np.arange(n) < sum(lengths)


def test_prefill_attention_equals_masked_attention():
    """Rows spanning several query blocks, a block holding several rows, a one-token row, padding
    at the end (row 0, position 0: must stay invisible to row 0), and a window."""
    rng = np.random.default_rng(3)
    H, Hkv, D = 6, 2, 8
    for lengths, chunk, window in (([5, 17, 1, 40], 8, None), ([3, 9, 30], 16, 4), ([50], 16, None),
                                   ([7, 7], 128, None)):
        _, rows, positions, valid = flattened_prompts(lengths, 5, rng, 2)
        n = len(rows)
        q, k, v = (jnp.asarray(rng.normal(size=(n, h, D)), jnp.float32) for h in (H, Hkv, Hkv))
        got = decoder.prefill_attention(q, k, v, jnp.asarray(rows), jnp.asarray(positions), jnp.asarray(valid),
                                        window=None if window is None else jnp.int32(window), chunk=chunk)
        index = np.arange(n)
        visible = (index[None] <= index[:, None]) & (rows[None] == rows[:, None]) & valid[None]
        if window is not None:
            visible &= index[None] > index[:, None] - window
        want = decoder.attention(q[None], decoder.transposed_keys(k[None]), decoder.heads_major(v[None]),
                                 jnp.asarray(visible)[None])[0]
        np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], atol=1e-5, rtol=0)


def test_prefill_flat_equals_the_padded_layout():
    """forward_flat(prefill=True) on an empty cache == the general path: same hidden states, same
    cache (what later decode steps read)."""
    params = decoder.init_params(CFG, jax.random.key(4), scale=0.1)
    rng = np.random.default_rng(4)
    lengths = [9, 1, 14]
    tokens, rows, positions, valid = (jnp.asarray(a) for a in flattened_prompts(lengths, 8, rng, CFG.vocab_size))
    cache = decoder.init_cache(CFG, len(lengths), MAX_LEN)
    want, want_cache, _ = decoder.forward_flat(params, CFG, tokens, rows, positions, valid, cache, width=16)
    got, got_cache, _ = decoder.forward_flat(params, CFG, tokens, rows, positions, valid, cache, width=16,
                                             prefill=True)
    np.testing.assert_allclose(np.asarray(got)[np.asarray(valid)], np.asarray(want)[np.asarray(valid)],
                               atol=2e-5, rtol=0)
    for a, b in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=0)
