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
        # above[v] = the mass of the tokens with a strictly larger logit than v's: in descending order,
        # the mass before the first token of v's run of equal logits
        order = np.argsort(-z, axis=-1, kind="stable")
        zs, ps = np.take_along_axis(z, order, -1), np.take_along_axis(p, order, -1)
        before = np.cumsum(ps, -1) - ps
        index = np.broadcast_to(np.arange(V), zs.shape)
        new_run = np.concatenate([np.ones_like(zs[..., :1], bool), zs[..., 1:] != zs[..., :-1]], -1)
        run_start = np.maximum.accumulate(np.where(new_run, index, 0), axis=-1)
        above = np.empty_like(p)
        np.put_along_axis(above, order, np.take_along_axis(before, run_start, -1), -1)
        p = np.where(above < top_p, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def _pooled(observed: np.ndarray, expected: np.ndarray, min_expected: float):
    """Cells expected to hold at least `min_expected` draws, plus one cell pooling the rest (merged
    into the smallest kept cell if the pool itself is expected to hold fewer)."""
    big = expected >= min_expected
    rest = (~big) & (expected > 0)
    obs, exp = list(observed[big]), list(expected[big])
    if rest.any():
        o, e = observed[rest].sum(), expected[rest].sum()
        if e >= min_expected or not obs:
            obs.append(o)
            exp.append(e)
        else:
            i = int(np.argmin(exp))
            obs[i] += o
            exp[i] += e
    return np.array(obs, np.float64), np.array(exp, np.float64)


def stratified_chi_square_pvalue(observed, expected, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of observed counts [S, V] to expected counts [S, V], where each
    stratum (row) holds the same total in both: the statistics of the strata add up, with
    sum_s (cells_s - 1) degrees of freedom. A draw in a cell of expectation exactly 0 is an outright
    failure (p-value 0). When the expectations are sums of per-sample probabilities that differ from
    sample to sample, the test is conservative (the counts vary less than multinomially)."""
    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    assert observed.shape == expected.shape and observed.ndim == 2
    np.testing.assert_allclose(observed.sum(1), expected.sum(1), rtol=1e-6, atol=1e-6)
    if observed[expected == 0].sum() > 0:
        return 0.0
    stat, dof = 0.0, 0
    for o, e in zip(observed, expected):
        o, e = _pooled(o, e, min_expected)
        if len(o) >= 2:
            stat += float(np.sum((o - e) ** 2 / e))
            dof += len(o) - 1
    return float(stats.chi2.sf(stat, dof)) if dof else 1.0


def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson goodness of fit of `counts` (any shape) to `probs` (same shape, summing to 1)."""
    counts, probs = np.ravel(np.asarray(counts, np.float64)), np.ravel(np.asarray(probs, np.float64))
    assert counts.shape == probs.shape and abs(probs.sum() - 1) < 1e-6, probs.sum()
    return stratified_chi_square_pvalue(counts[None], counts.sum() * probs[None], min_expected)


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
