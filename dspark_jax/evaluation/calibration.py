"""Confidence-head evaluation and Sequential Temperature Scaling (DESIGN.md 2.4, 2.6, 5). numpy only.

Everything here works on *round records* from decoding rounds run with FULL-length verification
(every one of the gamma draft tokens is verified, scheduler off):

    confidence_logits  float [N, gamma]  raw pre-sigmoid confidence logits z_1..z_gamma of a round
    accepted           int   [N]         draft tokens accepted in that round, 0..gamma (bonus NOT
                                         included, so tau = accepted + 1)

Notation: c_k = sigmoid(z_k / T_k) is the head's probability that draft token k survives given that
1..k-1 survived; a_k = prod_{i<=k} c_i is the prefix survival; the event it predicts is
"the first k draft tokens were all accepted", i.e. accepted >= k.

Public functions (all pure):
    prefix_survival(confidence_logits, temperatures=None) -> a [N, gamma]
    survival_events(accepted, gamma) -> bool [N, gamma]
    expected_calibration_error(probs, events, bins=10) -> float
    roc_auc(scores, labels) -> float
    reliability_curve(probs, events, bins=10) -> ReliabilityCurve(mean_predicted, observed, counts)
    conditional_acceptance(accepted, gamma) -> (rates [gamma], counts [gamma])
    fit_sts(confidence_logits, accepted, grid=None, bins=10, refine=True) -> temperatures [gamma]
    calibration_report(confidence_logits, accepted, temperatures=None, bins=10) -> dict
    threshold_sweep(confidence_logits, accepted, thresholds, temperatures=None) -> dict
    to_jsonable(obj) -> the same structure with numpy scalars/arrays as Python values, NaN -> None
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

DEFAULT_BINS = 10
# Coarse STS grid: log-spaced temperatures; the best point is then refined between its neighbours.
DEFAULT_GRID = np.geomspace(0.05, 20.0, 301)
_REFINE_POINTS = 41
# Elements per chunk when the ECE of many candidate temperatures is evaluated at once.
_CHUNK_ELEMENTS = 1 << 22


# ------------------------------------------------------------------------------------------------
# input checks


def _check_logits(confidence_logits) -> np.ndarray:
    z = np.asarray(confidence_logits, dtype=np.float64)
    if z.ndim != 2 or z.shape[1] < 1:
        raise ValueError(f"confidence_logits must be [N, gamma] with gamma >= 1, got shape {z.shape}")
    if not np.all(np.isfinite(z)):
        raise ValueError("confidence_logits contain NaN or infinite values")
    return z


def _check_accepted(accepted, gamma: int, n: int | None = None) -> np.ndarray:
    a = np.asarray(accepted)
    if a.ndim != 1:
        raise ValueError(f"accepted must be a 1-D array [N], got shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"accepted has {a.shape[0]} rounds but confidence_logits has {n}")
    if a.size and not np.all(np.equal(np.mod(a, 1), 0)):
        raise ValueError("accepted must hold whole numbers of tokens")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() > gamma):
        raise ValueError(f"accepted must be in 0..{gamma} (draft tokens only, no bonus), "
                         f"got range {a.min()}..{a.max()}")
    return a


def _check_temperatures(temperatures, gamma: int) -> np.ndarray:
    if temperatures is None:
        return np.ones(gamma)
    t = np.asarray(temperatures, dtype=np.float64).reshape(-1)
    if t.shape[0] != gamma:
        raise ValueError(f"expected {gamma} temperatures (one per position), got {t.shape[0]}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t


def _check_probs_events(probs, events) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(events).reshape(-1)
    if p.shape != y.shape:
        raise ValueError(f"probs and events differ in size: {p.shape[0]} vs {y.shape[0]}")
    if not np.all(np.isfinite(p)) or (p.size and (p.min() < 0.0 or p.max() > 1.0)):
        raise ValueError("probs must be finite probabilities in [0, 1]")
    return p, y.astype(np.float64)


def _check_bins(bins: int) -> int:
    if int(bins) != bins or bins < 1:
        raise ValueError(f"bins must be a positive integer, got {bins!r}")
    return int(bins)


# ------------------------------------------------------------------------------------------------
# survival and events


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    """log(sigmoid(x)) without overflow: -log(1 + exp(-x))."""
    return -np.logaddexp(0.0, -x)


def prefix_survival(confidence_logits, temperatures=None) -> np.ndarray:
    """a [N, gamma] with a_k = prod_{i<=k} sigmoid(z_i / T_i) (T = 1 everywhere when None).

    Computed as exp(cumsum(log sigmoid)) so long products of small factors do not underflow early;
    the result is non-increasing along each row.
    """
    z = _check_logits(confidence_logits)
    t = _check_temperatures(temperatures, z.shape[1])
    return np.exp(np.cumsum(_log_sigmoid(z / t), axis=1))


def survival_events(accepted, gamma: int) -> np.ndarray:
    """bool [N, gamma]: column k-1 is the event "the first k draft tokens were all accepted"."""
    if int(gamma) != gamma or gamma < 1:
        raise ValueError(f"gamma must be a positive integer, got {gamma!r}")
    acc = _check_accepted(accepted, int(gamma))
    return acc[:, None] >= np.arange(1, int(gamma) + 1)[None, :]


def conditional_acceptance(accepted, gamma: int) -> tuple[np.ndarray, np.ndarray]:
    """Position-wise conditional acceptance (DESIGN.md 5).

    rates[k-1] = among rounds whose draft tokens 1..k-1 were all accepted (accepted >= k-1), the
    fraction that also accepted token k (accepted >= k); NaN where no round reached position k.
    counts[k-1] = the number of rounds that reached position k (the denominator).
    """
    acc = _check_accepted(accepted, int(gamma))
    k = np.arange(1, int(gamma) + 1)
    reached = (acc[:, None] >= (k - 1)[None, :]).sum(axis=0)
    passed = (acc[:, None] >= k[None, :]).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = np.where(reached > 0, passed / np.maximum(reached, 1), np.nan)
    return rates.astype(np.float64), reached.astype(np.int64)


# ------------------------------------------------------------------------------------------------
# calibration metrics


def _bin_index(p: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width bins on [0, 1]: [0, 1/B), [1/B, 2/B), ..., [(B-1)/B, 1] (1.0 in the last bin)."""
    return np.minimum((p * bins).astype(np.int64), bins - 1)


def _ece_rows(probs: np.ndarray, events: np.ndarray, bins: int) -> np.ndarray:
    """ECE of every row of probs [G, N] against one event vector [N] (vectorised over G)."""
    g, n = probs.shape
    idx = (_bin_index(probs, bins) + (np.arange(g) * bins)[:, None]).ravel()
    sum_p = np.bincount(idx, weights=probs.ravel(), minlength=g * bins)
    sum_y = np.bincount(idx, weights=np.broadcast_to(events, (g, n)).ravel(), minlength=g * bins)
    # sum_b (n_b / N) |mean_p_b - mean_y_b| == sum_b |sum_p_b - sum_y_b| / N
    return np.abs(sum_p - sum_y).reshape(g, bins).sum(axis=1) / n


def expected_calibration_error(probs, events, bins: int = DEFAULT_BINS) -> float:
    """Expected Calibration Error with `bins` equal-width bins on [0, 1], weighted by bin counts.

    ECE = sum_b (n_b / N) * |mean predicted in b - observed frequency in b|. NaN for empty input.
    """
    p, y = _check_probs_events(probs, events)
    bins = _check_bins(bins)
    if p.size == 0:
        return float("nan")
    return float(_ece_rows(p[None, :], y, bins)[0])


class ReliabilityCurve(NamedTuple):
    """Per bin: mean predicted probability and observed frequency (NaN for empty bins), counts."""

    mean_predicted: np.ndarray
    observed: np.ndarray
    counts: np.ndarray


def reliability_curve(probs, events, bins: int = DEFAULT_BINS) -> ReliabilityCurve:
    """The points of a reliability diagram (same equal-width bins as expected_calibration_error)."""
    p, y = _check_probs_events(probs, events)
    bins = _check_bins(bins)
    idx = _bin_index(p, bins)
    counts = np.bincount(idx, minlength=bins)
    sum_p = np.bincount(idx, weights=p, minlength=bins)
    sum_y = np.bincount(idx, weights=y, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.where(counts > 0, sum_p / np.maximum(counts, 1), np.nan)
        obs = np.where(counts > 0, sum_y / np.maximum(counts, 1), np.nan)
    return ReliabilityCurve(mean_p, obs, counts.astype(np.int64))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of x; tied values share the average of the ranks they span."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts + 1  # first rank of each distinct value
    return (first + (counts - 1) / 2.0)[inverse.reshape(-1)]


def roc_auc(scores, labels) -> float:
    """ROC-AUC by the rank (Mann-Whitney) formula; ties count one half. NaN if a class is absent."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in size: {s.shape[0]} vs {y.shape[0]}")
    if np.any(np.isnan(s)):
        raise ValueError("scores contain NaN")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _average_ranks(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ------------------------------------------------------------------------------------------------
# Sequential Temperature Scaling


def _best_temperature(log_prefix: np.ndarray, z_k: np.ndarray, events_k: np.ndarray, candidates: np.ndarray,
                      bins: int) -> tuple[float, float]:
    """(T, ECE) minimising the ECE of exp(log_prefix + log sigmoid(z_k / T)) over `candidates`.

    Ties (ECE equal to 1e-12) go to the temperature closest to 1 in log space.
    """
    n = z_k.shape[0]
    chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
    eces = np.empty(candidates.shape[0])
    for start in range(0, candidates.shape[0], chunk):
        t = candidates[start:start + chunk, None]
        probs = np.exp(log_prefix[None, :] + _log_sigmoid(z_k[None, :] / t))
        eces[start:start + chunk] = _ece_rows(probs, events_k, bins)
    best = eces.min()
    tied = np.flatnonzero(eces <= best + 1e-12)
    pick = tied[np.argmin(np.abs(np.log(candidates[tied])))]
    return float(candidates[pick]), float(eces[pick])


def _check_rounds(confidence_logits, accepted, bins, what: str):
    """Validated (logits [N, gamma], accepted [N], bins) of at least one round."""
    z = _check_logits(confidence_logits)
    acc = _check_accepted(accepted, z.shape[1], z.shape[0])
    if z.shape[0] == 0:
        raise ValueError(f"{what} needs at least one round")
    return z, acc, _check_bins(bins)


def fit_sts(confidence_logits, accepted, grid=None, bins: int = DEFAULT_BINS, refine: bool = True) -> np.ndarray:
    """Sequential Temperature Scaling (DESIGN.md 2.6): temperatures T [gamma], one per position.

    For k = 1..gamma in order, T_k is the grid point minimising the ECE of
    a_k = prod_{i<=k} sigmoid(z_i / T_i) against the event "first k draft tokens accepted", with
    T_1..T_{k-1} already fixed. `grid` defaults to 301 log-spaced values in [0.05, 20]; with
    `refine`, 41 more log-spaced values between the best grid point's neighbours are tried too.
    Fit on held-out rounds and store the result with the drafter checkpoint.
    """
    z, acc, bins = _check_rounds(confidence_logits, accepted, bins, "fit_sts")
    n, gamma = z.shape
    grid = DEFAULT_GRID if grid is None else np.asarray(grid, dtype=np.float64).reshape(-1)
    if grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError("grid must be a non-empty set of finite temperatures > 0")
    grid = np.unique(grid)
    events = survival_events(acc, gamma).astype(np.float64)
    temperatures = np.ones(gamma)
    log_prefix = np.zeros(n)  # sum_{i<k} log c_i with the temperatures fixed so far
    for k in range(gamma):
        t, _ = _best_temperature(log_prefix, z[:, k], events[:, k], grid, bins)
        if refine and grid.size > 1:
            i = int(np.searchsorted(grid, t))
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]
            fine = np.concatenate([np.geomspace(lo, hi, _REFINE_POINTS), [t]])
            t, _ = _best_temperature(log_prefix, z[:, k], events[:, k], fine, bins)
        temperatures[k] = t
        log_prefix = log_prefix + _log_sigmoid(z[:, k] / t)
    return temperatures


# ------------------------------------------------------------------------------------------------
# reports


def _per_position(fn, probs: np.ndarray, events: np.ndarray) -> list[float]:
    return [float(fn(probs[:, k], events[:, k])) for k in range(probs.shape[1])]


def _curves(probs: np.ndarray, events: np.ndarray, bins: int) -> list[dict]:
    out = []
    for k in range(probs.shape[1]):
        c = reliability_curve(probs[:, k], events[:, k], bins)
        out.append({"mean_predicted": c.mean_predicted.tolist(), "observed": c.observed.tolist(),
                    "counts": c.counts.tolist()})
    return out


def calibration_report(confidence_logits, accepted, temperatures=None, bins: int = DEFAULT_BINS) -> dict:
    """Per-position calibration of the prefix survival a_k, raw (T = 1) and after STS.

    `temperatures` should come from fit_sts on HELD-OUT rounds; when None they are fitted here on
    the same rounds (in-sample, optimistic; "temperatures_source" says which).

    Keys (lists have one entry per position k = 1..gamma):
      num_rounds, gamma, bins, temperatures, temperatures_source ("given" | "fitted_in_sample")
      event_count / event_rate      rounds (fraction) whose first k draft tokens were all accepted
      mean_survival_raw / _sts      mean predicted a_k (calibration-in-the-large vs event_rate)
      ece_raw / ece_sts             ECE of a_k against the event (equal-width bins)
      auc_raw / auc_sts             ROC-AUC of a_k against the event (NaN if one class is absent)
      auc_conditional               ROC-AUC of c_k for "token k accepted" among rounds that reached
                                    k (unchanged by any temperature: scaling is order-preserving)
      conditional_acceptance        P(token k accepted | tokens 1..k-1 accepted)
      conditional_count             rounds that reached position k (its denominator)
      mean_ece_raw / mean_ece_sts   unweighted mean over positions
      mean_accepted, tau_full       mean accepted draft tokens, and that + 1 (bonus)
      reliability_raw / _sts        per position {"mean_predicted", "observed", "counts"} per bin
    """
    z, acc, bins = _check_rounds(confidence_logits, accepted, bins, "calibration_report")
    n, gamma = z.shape
    source = "given"
    if temperatures is None:
        temperatures, source = fit_sts(z, acc, bins=bins), "fitted_in_sample"
    t = _check_temperatures(temperatures, gamma)
    events = survival_events(acc, gamma)
    raw = prefix_survival(z)
    sts = prefix_survival(z, t)
    ece = lambda p, y: expected_calibration_error(p, y, bins)  # noqa: E731
    rates, reached = conditional_acceptance(acc, gamma)
    auc_cond = []
    for k in range(gamma):
        at_k = acc >= k  # rounds that reached position k + 1: draft tokens 1..k all accepted
        auc_cond.append(roc_auc(z[at_k, k], acc[at_k] >= k + 1) if at_k.any() else float("nan"))
    ece_raw, ece_sts = _per_position(ece, raw, events), _per_position(ece, sts, events)
    return {
        "num_rounds": int(n),
        "gamma": int(gamma),
        "bins": bins,
        "temperatures": t.tolist(),
        "temperatures_source": source,
        "event_count": events.sum(axis=0).astype(int).tolist(),
        "event_rate": events.mean(axis=0).tolist(),
        "mean_survival_raw": raw.mean(axis=0).tolist(),
        "mean_survival_sts": sts.mean(axis=0).tolist(),
        "ece_raw": ece_raw,
        "ece_sts": ece_sts,
        "auc_raw": _per_position(roc_auc, raw, events),
        "auc_sts": _per_position(roc_auc, sts, events),
        "auc_conditional": auc_cond,
        "conditional_acceptance": rates.tolist(),
        "conditional_count": reached.tolist(),
        "mean_ece_raw": float(np.mean(ece_raw)),
        "mean_ece_sts": float(np.mean(ece_sts)),
        "mean_accepted": float(acc.mean()),
        "tau_full": float(acc.mean() + 1.0),
        "reliability_raw": _curves(raw, events, bins),
        "reliability_sts": _curves(sts, events, bins),
    }


def verified_lengths(survival: np.ndarray, threshold: float) -> np.ndarray:
    """int [N]: the longest prefix length l with a_1..a_l >= threshold (0 if a_1 < threshold)."""
    keep = np.asarray(survival) >= threshold
    return np.cumprod(keep, axis=1).sum(axis=1)


def threshold_sweep(confidence_logits, accepted, thresholds: Sequence[float], temperatures=None) -> dict:
    """Static-threshold verification (DESIGN.md 3.3 / 5) replayed on full-length round records.

    For each threshold h a round verifies l = the longest prefix with a_k >= h (a from
    prefix_survival with `temperatures`); it then accepts min(accepted, l) draft tokens and emits
    one bonus/correction token. Per threshold (lists aligned with `thresholds`):
      tokens_per_step        mean(min(accepted, l) + 1)
      verified_per_step      mean(l), draft tokens sent to verification per round
      acceptance_rate        sum(min(accepted, l)) / sum(l) (NaN when nothing was verified)
      tokens_per_verified    tokens_per_step / (verified_per_step + 1): committed tokens per
                             token of verify batch (the anchor counts)
    Plus thresholds, num_rounds, gamma, and the full-length reference (l = gamma for all rounds):
    full_tokens_per_step, full_acceptance_rate.
    """
    z = _check_logits(confidence_logits)
    n, gamma = z.shape
    acc = _check_accepted(accepted, gamma, n)
    if n == 0:
        raise ValueError("threshold_sweep needs at least one round")
    hs = np.asarray(thresholds, dtype=np.float64).reshape(-1)
    if hs.size == 0 or np.any(np.isnan(hs)):
        raise ValueError("thresholds must be a non-empty list of numbers")
    a = prefix_survival(z, temperatures)
    tokens, verified, rate, per_verified = [], [], [], []
    for h in hs:
        l = verified_lengths(a, h)
        got = np.minimum(acc, l)
        tokens.append(float(np.mean(got + 1)))
        verified.append(float(np.mean(l)))
        rate.append(float(got.sum() / l.sum()) if l.sum() > 0 else float("nan"))
        per_verified.append(float(np.mean(got + 1) / (np.mean(l) + 1)))
    return {
        "thresholds": hs.tolist(),
        "num_rounds": int(n),
        "gamma": int(gamma),
        "tokens_per_step": tokens,
        "verified_per_step": verified,
        "acceptance_rate": rate,
        "tokens_per_verified": per_verified,
        "full_tokens_per_step": float(acc.mean() + 1.0),
        "full_acceptance_rate": float(acc.mean() / gamma),
    }


def to_jsonable(obj):
    """Numpy scalars/arrays -> Python values, tuples -> lists, NaN/inf -> None (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
