"""The DSpark objective on hand-made distributions."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.training.losses import (LossWeights, acceptance_rate, dspark_loss, expected_accept_length,
                                        position_weights)


def test_acceptance_rate_is_overlap():
    q = jnp.log(jnp.array([0.5, 0.5, 0.0 + 1e-30]))
    p = jnp.log(jnp.array([0.7, 0.2, 0.1]))
    np.testing.assert_allclose(acceptance_rate(q, p), 0.5 + 0.2 + 0.0, atol=1e-6)  # sum min
    np.testing.assert_allclose(acceptance_rate(p, p), 1.0, atol=1e-6)


def test_expected_accept_length():
    alpha = jnp.array([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0]])
    mask = jnp.array([[True, True, True], [True, False, True]])
    np.testing.assert_allclose(expected_accept_length(alpha, mask), [1 + 0.5 + 0.25 + 0.25, 1 + 1], atol=1e-6)


def test_terms_on_hand_made_distributions():
    q = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])  # two slots of one block
    p = np.array([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8]])
    out = {"draft_logits": jnp.log(q)[None], "target_logits": jnp.log(p)[None],
           "labels": jnp.array([[0, 2]]), "label_mask": jnp.array([[True, True]]),
           "confidence_logits": jnp.array([[0.0, 2.0]])}
    loss, m = dspark_loss(out, LossWeights(ce=0.1, tv=0.9, conf=1.0, decay=2.0))
    w = np.exp(-np.arange(2) / 2.0)
    ce = (w[0] * -np.log(0.5) + w[1] * -np.log(0.8)) / w.sum()
    tv = (w[0] * 0.2 + w[1] * 0.0) / w.sum()
    c_star = np.array([0.9, 1.0])
    c = 1 / (1 + np.exp(-np.array([0.0, 2.0])))
    bce = -(c_star * np.log(c) + (1 - c_star) * np.log(1 - c))
    conf = (w * bce).sum() / w.sum()
    np.testing.assert_allclose(m["loss_ce"], ce, rtol=1e-5)
    np.testing.assert_allclose(m["loss_tv"], tv, rtol=1e-5)
    np.testing.assert_allclose(m["loss_conf"], conf, rtol=1e-5)
    np.testing.assert_allclose(loss, 0.1 * ce + 0.9 * tv + conf, rtol=1e-5)
    np.testing.assert_allclose(m["expected_tau"], 1 + 0.9 + 0.9, rtol=1e-5)
    np.testing.assert_allclose(m["accuracy_per_position"], [1.0, 1.0])


def test_masked_slots_do_not_count_and_scale_is_batch_independent():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 4, 5)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(1, 4, 5)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 5, size=(1, 4)))
    mask = jnp.array([[True, True, False, False]])
    base = {"draft_logits": logits, "target_logits": target, "labels": labels, "label_mask": mask}
    loss1, _ = dspark_loss(base, LossWeights())
    junk = dict(base, draft_logits=base["draft_logits"].at[:, 2:].set(100.0))
    assert np.allclose(dspark_loss(junk, LossWeights())[0], loss1)
    doubled = {k: jnp.concatenate([v, v]) for k, v in base.items()}  # the same block twice
    np.testing.assert_allclose(dspark_loss(doubled, LossWeights())[0], loss1, rtol=1e-6)


def test_gradients_do_not_reach_the_target_distribution():
    rng = np.random.default_rng(1)
    out = {"draft_logits": jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32),
           "target_logits": jnp.asarray(rng.normal(size=(2, 3, 6)), jnp.float32),
           "labels": jnp.zeros((2, 3), jnp.int32), "label_mask": jnp.ones((2, 3), bool),
           "confidence_logits": jnp.zeros((2, 3))}
    floats = {k: v for k, v in out.items() if k.endswith("logits")}
    grads = jax.grad(lambda f: dspark_loss({**out, **f}, LossWeights())[0])(floats)
    assert np.all(np.asarray(grads["target_logits"]) == 0)
    assert np.any(np.asarray(grads["draft_logits"]) != 0) and np.any(np.asarray(grads["confidence_logits"]) != 0)


def test_position_weights():
    np.testing.assert_allclose(position_weights(3, 4.0), np.exp(-np.arange(3) / 4.0))
