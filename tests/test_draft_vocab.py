"""Draft vocabulary: the drafter scores only N target tokens (its LM head shrinks by V / N), every
other token has draft probability exactly zero, and speculative decoding stays lossless."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import (PROMPTS, SAMPLING_PROMPTS, SOFT_TARGET, TARGET, TCFG, assert_follows_target, drafter,
                              round_counts)

from dspark_jax.core.config_checks import ConfigError
from dspark_jax.drafters import dspark
from dspark_jax.drafters.checkpoint import load_drafter, save_drafter
from dspark_jax.engine.generate import generate
from dspark_jax.models.sampling import SamplingConfig
from dspark_jax.engine.speculative import SpecConfig, speculative_generate
from dspark_jax.training.losses import LossWeights, dspark_loss

# 20 of the 32 tokens: most of the permutation chain the test drafter knows, not all of it
VOCAB = tuple(sorted(np.random.default_rng(5).choice(32, 20, replace=False).tolist()))


def small_vocab_drafter(head="markov"):
    dcfg, dparams = drafter(head)
    return dcfg.replace(draft_vocab_size=len(VOCAB), draft_vocab=VOCAB), dparams


def test_config_checks_the_draft_vocabulary():
    dcfg, _ = drafter()
    with pytest.raises(ConfigError, match="draft_vocab must hold"):
        dcfg.replace(draft_vocab_size=3, draft_vocab=(4, 2, 9))  # not sorted
    with pytest.raises(ConfigError, match="draft_vocab must hold"):
        dcfg.replace(draft_vocab_size=4, draft_vocab=(2, 4, 9))  # not draft_vocab_size ids
    with pytest.raises(ConfigError, match="draft_vocab must hold"):
        dcfg.replace(draft_vocab_size=2, draft_vocab=(4, 32))  # not a token id
    with pytest.raises(ConfigError, match="must be below the vocabulary"):
        dcfg.replace(draft_vocab_size=32)
    small, _ = small_vocab_drafter()
    assert hash(small) == hash(small.replace()) and small == small.replace()


@pytest.mark.parametrize("precomputed", [False, True])
def test_base_logits_are_the_target_head_on_the_draft_vocabulary(precomputed):
    dcfg, dparams = small_vocab_drafter()
    if precomputed:
        dparams = dspark.with_draft_head(dparams, dcfg, TARGET, TCFG)
        assert dparams["draft_head"].shape == (len(VOCAB), TCFG.hidden_size)
    hidden = jax.random.normal(jax.random.key(0), (3, 5, TCFG.hidden_size))
    got = np.asarray(dspark.base_logits(dparams, dcfg, TARGET, TCFG, hidden))
    whole = {k: v for k, v in dparams.items() if k != "draft_head"}  # the rows belong to the draft vocabulary
    full = np.asarray(dspark.base_logits(whole, dcfg.replace(draft_vocab_size=0, draft_vocab=()), TARGET, TCFG,
                                         hidden))
    inside = np.isin(np.arange(32), VOCAB)
    np.testing.assert_allclose(got[..., inside], full[..., inside], rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(got[..., ~inside]))


@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.8, 8, 0.9)])
def test_proposals_stay_inside_the_draft_vocabulary(sampling):
    dcfg, dparams = small_vocab_drafter()
    B = 64
    cache = dspark.init_drafter_cache(dcfg, B, 32)
    feats = jax.random.normal(jax.random.key(1), (B, 6, 2 * dcfg.hidden_size))
    cache = dspark.append_context(dparams, dcfg, cache, feats, jnp.full((B,), 6, jnp.int32))
    anchors = jnp.asarray(np.random.default_rng(0).integers(0, 32, B), jnp.int32)
    prop = dspark.propose(dparams, dcfg, TARGET, TCFG, cache, anchors, jax.random.key(2), sampling)
    assert np.isin(np.asarray(prop.tokens), VOCAB).all()
    probs = np.exp(np.asarray(prop.log_probs))
    outside = ~np.isin(np.arange(32), VOCAB)
    assert np.all(probs[..., outside] == 0.0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("precomputed", [False, True])
def test_drafting_over_the_draft_vocabulary_is_the_whole_vocabulary_masked(precomputed):
    """`propose` drafts in the N-token space (head, Markov bias, argmax over N); its logits and greedy
    tokens are those of the whole-vocabulary computation with every other token at -inf."""
    dcfg, dparams = small_vocab_drafter()
    decoding = dspark.with_draft_head(dparams, dcfg, TARGET, TCFG) if precomputed else dparams
    assert ("draft_markov" in decoding) == precomputed
    B = 16
    cache = dspark.init_drafter_cache(dcfg, B, 32)
    feats = jax.random.normal(jax.random.key(4), (B, 6, 2 * dcfg.hidden_size))
    cache = dspark.append_context(dparams, dcfg, cache, feats, jnp.full((B,), 6, jnp.int32))
    anchors = jnp.asarray(np.random.default_rng(1).integers(0, 32, B), jnp.int32)
    prop = dspark.propose(decoding, dcfg, TARGET, TCFG, cache, anchors, jax.random.key(0), SamplingConfig(0.0))
    prev = jnp.concatenate([anchors[:, None], prop.tokens[:, :-1]], axis=1)
    want = dspark.base_logits(dparams, dcfg, TARGET, TCFG, prop.hidden) + dspark._teacher_forced_bias(
        dparams, dcfg, prop.hidden, prev)
    np.testing.assert_allclose(np.asarray(prop.logits), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(prop.tokens), np.argmax(np.asarray(want), -1))


@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_greedy_speculative_equals_greedy_target(policy):
    from test_speculative import SPS

    dcfg, dparams = small_vocab_drafter()
    want = generate(TARGET, TCFG, PROMPTS, max_new_tokens=30).token_ids
    got = speculative_generate(TARGET, TCFG, dspark.with_draft_head(dparams, dcfg, TARGET, TCFG), dcfg, PROMPTS,
                               max_new_tokens=30, cfg=SpecConfig(gamma=4, policy=policy, sps=SPS))
    assert got.token_ids == want
    accepting, rejecting = round_counts(got)
    assert accepting >= 4 and rejecting >= 4, (accepting, rejecting)
    # the target does need tokens the drafter cannot propose
    assert any(t not in VOCAB for ids in want for t in ids)


@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(0.8, 8, 0.9)])
def test_sampling_is_lossless(sampling):
    """As test_speculative.test_sampling_is_lossless: the drafter's q is zero outside the draft
    vocabulary, and the residual max(p - q, 0) puts the target's mass for those tokens back."""
    dcfg, dparams = small_vocab_drafter()
    prompts = SAMPLING_PROMPTS * 2000
    spec = speculative_generate(SOFT_TARGET, TCFG, dparams, dcfg, prompts, max_new_tokens=6, seed=2,
                                cfg=SpecConfig(gamma=4, sampling=sampling, policy="fixed"))
    assert (spec.acceptance_lengths() > 1).mean() > 0.2
    tokens = np.concatenate([np.asarray(t[:6]) for t in spec.token_ids])
    assert (~np.isin(tokens, VOCAB)).mean() > 0.05  # outside tokens are generated (by the target)
    assert_follows_target(prompts, spec.token_ids, sampling)


def test_loss_ignores_cross_entropy_on_labels_outside_and_stays_finite():
    dcfg, dparams = small_vocab_drafter()
    rng = np.random.default_rng(0)
    hidden = jax.random.normal(jax.random.key(3), (2, 4, 5, TCFG.hidden_size))
    labels = jnp.asarray(rng.integers(0, 32, (2, 4, 5)), jnp.int32)
    target_logits = jnp.asarray(rng.normal(size=(2, 4, 5, 32)), jnp.float32)

    def loss(dparams):
        draft = dspark.base_logits(dparams, dcfg, TARGET, TCFG, hidden) + dspark._head_bias(
            dparams, dspark._markov_embedding(dparams, labels))
        out = dict(draft_logits=draft, target_logits=target_logits, labels=labels,
                   label_mask=jnp.ones(labels.shape, bool))
        return dspark_loss(out, LossWeights(ce=1.0, tv=1.0, conf=0.0))

    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(dparams)
    assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    inside = np.isin(np.asarray(labels), VOCAB)
    assert 0 < inside.mean() < 1 and float(metrics["loss_ce"]) > 0


def test_a_saved_drafter_keeps_its_draft_vocabulary(tmp_path):
    dcfg, dparams = small_vocab_drafter()
    save_drafter(str(tmp_path / "d"), dcfg, jax.device_get(dparams))
    loaded = load_drafter(str(tmp_path / "d"))
    assert loaded.config == dcfg and loaded.config.draft_vocab == VOCAB


def test_draft_vocabulary_is_the_most_frequent_response_tokens(tmp_path):
    from test_data import write_fake_dataset

    from dspark_jax.data.pipeline import ShardSource, draft_vocabulary

    # prompts full of token 9 (not counted), responses: 5 x4, 7 x3, 2 x2, 3 x1
    write_fake_dataset(str(tmp_path / "a"), [([9, 9, 9, 9], [5, 5, 7, 2]), ([9, 9], [5, 7, 3])])
    write_fake_dataset(str(tmp_path / "b"), [([9, 9, 9], [5, 7, 2])])
    source = ShardSource([str(tmp_path / "a"), str(tmp_path / "b")])
    assert draft_vocabulary(source, 2, 16) == ((5, 7), 7 / 10)
    assert draft_vocabulary(source, 3, 16) == ((2, 5, 7), 9 / 10)
    assert draft_vocabulary(source, 5, 16)[0] == (0, 2, 3, 5, 7)  # ties at zero: the lower ids


def test_export_refuses_a_draft_vocabulary_in_one_line():
    from dspark_jax.core.errors import UserError
    from dspark_jax.drafters.deepspec import check_exportable

    dcfg, _ = small_vocab_drafter()
    with pytest.raises(UserError, match="draft-to-target token map"):
        check_exportable(dcfg.replace(target_name="tiny"))


def test_a_trained_drafter_gets_a_draft_vocabulary_from_the_command_line(tmp_path, capsys):
    """`python -m dspark_jax.draft_vocab`: the coverage of each N on training and held-out responses,
    then the drafter written with the N most frequent response tokens, its weights, calibration and
    storage unchanged; `--size 0` takes the vocabulary away again; bad input is one line."""
    import json

    from cli_helpers import assert_one_line_error, run_main
    from test_data import write_fake_dataset

    from dspark_jax import draft_vocab

    write_fake_dataset(str(tmp_path / "train"), [([9, 9], [5, 5, 7, 2]), ([9], [5, 7, 3])])
    write_fake_dataset(str(tmp_path / "held"), [([9], [5, 7, 11]), ([9], [2, 2])])
    dcfg, dparams = drafter()
    save_drafter(str(tmp_path / "d"), dcfg, jax.device_get(dparams), sts_temperatures=[1.5] * dcfg.block_size,
                 metadata={"steps": 7}, dtype="bfloat16")
    common = ["--drafter", str(tmp_path / "d"), "--data", str(tmp_path / "train"), "--held-out", str(tmp_path / "held")]
    code, out, err = run_main(draft_vocab.main, capsys, *common, "--sizes", "2,4")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    # train: 5 x3, 7 x2, 2 x1, 3 x1 (prompts not counted); held out: 5, 7, 11, 2, 2
    assert rows == [{"size": 2, "train": 5 / 7, "held_out": 2 / 5}, {"size": 4, "train": 1.0, "held_out": 4 / 5}]
    assert sorted(os.listdir(tmp_path / "d")) == ["drafter.json", "drafter.safetensors"]  # nothing written

    code, out, err = run_main(draft_vocab.main, capsys, *common, "--size", "4", "--save-to", str(tmp_path / "small"))
    assert code == 0, err
    small, whole = load_drafter(str(tmp_path / "small")), load_drafter(str(tmp_path / "d"))
    assert small.config == dcfg.replace(draft_vocab_size=4, draft_vocab=(2, 3, 5, 7))
    assert small.metadata["steps"] == 7 and small.metadata["draft_vocab"]["held_out"] == 4 / 5
    assert small.sts_temperatures == whole.sts_temperatures and small.storage_dtype == "bfloat16"
    jax.tree.map(np.testing.assert_array_equal, small.params, whole.params)
    assert run_main(draft_vocab.main, capsys, "--drafter", str(tmp_path / "small"), "--data", str(tmp_path / "train"),
                    "--size", "0")[0] == 0
    assert load_drafter(str(tmp_path / "small")).config == dcfg

    assert_one_line_error(draft_vocab.main, capsys, "not below the target's 32", *common, "--size", "32")
    assert_one_line_error(draft_vocab.main, capsys, "expected comma-separated integers", *common, "--sizes", "2,x")
    assert_one_line_error(draft_vocab.main, capsys, "one of the arguments", *common)
