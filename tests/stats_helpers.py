"""Shared by the distribution tests: an exact numpy reference for logit processing, and goodness-of-fit
checks of sample counts against exactly known probabilities (Pearson chi-square + total variation)."""

import numpy as np
from scipy import stats  # a dependency of jax itself

P_MIN = 1e-4  # the p-value below which a sample is declared not drawn from the stated distribution


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The processed distribution, written from its definition (float64): softmax(logits / T), then
    top-k keeps the tokens whose logit is >= the k-th largest (ties at the cutoff are all kept),
    then top-p keeps token v iff the mass of the tokens strictly more likely than v is < top_p
    (the smallest set of most likely tokens whose mass reaches top_p, ties kept). [..., V]."""
    z = np.asarray(logits, np.float64) / temperature
    V = z.shape[-1]
    if 0 < top_k < V:
        kth = np.sort(z, axis=-1)[..., V - top_k][..., None]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        above = np.sum(np.where(z[..., None, :] > z[..., :, None], p[..., None, :], 0.0), axis=-1)
        p = np.where(above < top_p, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of `counts` (any shape) to `probs` (same shape, summing to 1). Cells
    expected to hold fewer than `min_expected` draws are pooled into one; a draw in a cell of
    probability exactly 0 is an outright failure (p-value 0)."""
    counts, probs = np.ravel(np.asarray(counts, np.float64)), np.ravel(np.asarray(probs, np.float64))
    assert counts.shape == probs.shape and abs(probs.sum() - 1) < 1e-6, probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    expected = n * probs
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    rest = (~big) & (probs > 0)
    if rest.any():
        obs.append(counts[rest].sum())
        exp.append(expected[rest].sum())
    obs, exp = np.array(obs), np.array(exp)
    if len(obs) < 2:
        return 1.0
    return float(stats.chi2.sf(np.sum((obs - exp) ** 2 / exp), len(obs) - 1))


def total_variation(counts, probs) -> float:
    counts = np.ravel(np.asarray(counts, np.float64))
    return float(0.5 * np.abs(counts / counts.sum() - np.ravel(probs)).sum())


def chance_total_variation(probs, n: int) -> float:
    """The expected TV distance between n draws' frequencies and probs (normal approximation)."""
    probs = np.ravel(np.asarray(probs, np.float64))
    return float(0.5 * np.sum(np.sqrt(2 / np.pi * probs * (1 - probs) / max(n, 1))))


def assert_drawn_from(counts, probs, what="", tv_max: float | None = None):
    """counts look like draws from probs: chi-square p-value above P_MIN, and a TV distance below
    tv_max (default: 4x what chance alone gives at this sample size)."""
    pvalue, tv = chi_square_pvalue(counts, probs), total_variation(counts, probs)
    if tv_max is None:
        tv_max = 4 * chance_total_variation(probs, int(np.sum(counts)))
    detail = f"{what}: p-value {pvalue:.3g}, TV {tv:.4f}\n counts {np.ravel(counts)}\n expected {np.ravel(probs) * np.sum(counts)}"
    assert np.sum(counts) > 0 and pvalue > P_MIN and tv <= tv_max, detail
