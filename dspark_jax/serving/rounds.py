"""Drafter statistics for the serving simulator: pools of (survival a_1..a_gamma, accepted length) rounds.

A `RoundPool` holds N rounds of FULL-length verification, each with the calibrated prefix survival
a[k] = prod_{i<=k} c_i the schedulers see and the number A of draft tokens the target accepted,
plus the request each round came from. A simulated round draws one pooled round per slot; a policy
that verifies l tokens then commits min(A, l) + 1. That is exact for the round itself: the
acceptance of draft tokens 1..l does not depend on how many tokens after them are verified (greedy:
a comparison with the target's argmax; T > 0: the same accept/reject events, coupled). What it
leaves out: under a policy that verifies fewer tokens the rounds start at other positions of the
text, and resampled rounds are independent given their request (see docs/decoding.md, "Serving
simulator").

Three sources:

* `record_rounds` (`python -m dspark_jax.simulate record`): decode real prompts with the real
  engine and full-length verification, keep each round's raw confidence logits, accepted length
  and request (a "dspark-round-records" JSON). The survival is computed from the logits with the
  drafter's STS temperatures by the engine's own `survival_from_logits`. The prompts are the
  ones `benchmarks/bench_serving.py` serves (eval split, math / code / chat round robin, at most
  --max-prompt-tokens), stop tokens ignored, so a record of N prompts contains exactly the requests
  bench_serving's first N slots decode.
* `pool_from_eval` with model="reliability": synthetic rounds from `python -m dspark_jax.eval`'s
  JSON, which keeps per-position summaries, not per-round records. The accepted length is drawn
  from eval's accepted-length histogram (exact marginal), and each a_k from that position's
  reliability diagram conditioned on whether position k survived (bin weight = count x observed
  rate, or x (1 - observed)), placed inside the bin around its mean prediction; one uniform per
  round drives every position's quantile (a comonotone copula: a round that is confident at one
  position is confident at all), then a running minimum keeps a non-increasing. This reproduces
  per position the joint distribution of (a_k, survived k) at the diagram's resolution, hence the
  calibration, and the accepted-length distribution exactly; the dependence between positions is
  modelled, not measured (checked against eval's measured threshold sweep: `threshold_check`).
* `pool_from_rates` (model="beta"): only per-position conditional acceptance rates alpha_k are
  known (eval's `conditional_acceptance`, or a what-if). Per round c_k ~ Beta(alpha_k kappa,
  (1 - alpha_k) kappa) independently, position k is accepted with probability c_k given 1..k-1
  were: calibrated by construction, and conditional acceptance = alpha_k exactly. kappa sets how
  informative confidences are (small kappa: c near 0 or 1, a sharp head; large: every c near
  alpha_k, an uninformative head); `fit_concentration` picks the kappa whose threshold sweep is
  closest to a measured one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from typing import Any, Sequence

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.errors import UserError

FORMAT = "dspark-round-records"
VERSION = 1


@dataclasses.dataclass
class RoundPool:
    survival: np.ndarray  # float32 [N, gamma], non-increasing along gamma
    accepted: np.ndarray  # int32 [N] draft tokens accepted under full-length verification, 0..gamma
    request: np.ndarray  # int32 [N] request id of each round (0 for a synthetic pool)
    source: dict
    # Recorded pools only: the round's anchor position in its request (tokens generated before the
    # round's bonus, 1 for the first round: the prefill emits one token) and the tokens a request
    # generates in all (--max-new-tokens of the recording). None for synthetic pools.
    position: np.ndarray | None = None
    request_tokens: int | None = None

    def __post_init__(self):
        self.survival = np.asarray(self.survival, np.float32)
        self.accepted = np.asarray(self.accepted, np.int32)
        self.request = np.asarray(self.request, np.int32)
        if self.position is not None:
            self.position = np.asarray(self.position, np.int32)
            if self.position.shape != self.request.shape or self.request_tokens is None:
                raise UserError("positions need one entry per round and the request length")
        n = len(self.accepted)
        if self.survival.ndim != 2 or self.survival.shape[0] != n or len(self.request) != n or n == 0:
            raise UserError("a round pool needs survival [N, gamma], accepted [N] and request [N] with N >= 1")
        if self.accepted.min() < 0 or self.accepted.max() > self.gamma:
            raise UserError(f"accepted lengths must lie in 0..gamma={self.gamma}")
        if not np.all(np.isfinite(self.survival)) or self.survival.min() < 0 or self.survival.max() > 1:
            raise UserError("survival probabilities must be finite and in [0, 1]")

    @property
    def gamma(self) -> int:
        return int(self.survival.shape[1])

    @property
    def requests(self) -> np.ndarray:
        return np.unique(self.request)

    def truncated(self, gamma: int) -> RoundPool:
        """The same rounds drafted to `gamma` <= self.gamma positions (a full-length record of a
        longer block contains the shorter one: its first gamma acceptances)."""
        if not 1 <= gamma <= self.gamma:
            raise UserError(f"gamma must be between 1 and the pool's {self.gamma}")
        if gamma == self.gamma:
            return self
        # positions stay those of the recorded (longer-block) rounds: the replay is then approximate
        return RoundPool(self.survival[:, :gamma], np.minimum(self.accepted, gamma), self.request,
                         dict(self.source, gamma_truncated_to=gamma), self.position, self.request_tokens)

    def subset_requests(self, requests: Sequence[int]) -> RoundPool:
        keep = np.isin(self.request, np.asarray(requests))
        if not keep.any():
            raise UserError("no pooled round belongs to the requested requests")
        return RoundPool(self.survival[keep], self.accepted[keep], self.request[keep], self.source,
                         None if self.position is None else self.position[keep], self.request_tokens)

    def full_tau(self) -> float:
        return float(self.accepted.mean() + 1)


# ------------------------------------------------------------------------------------------------
# Round records (real decoding)


def survival_of(confidence_logits: np.ndarray, temperatures) -> np.ndarray:
    """The engine's survival_from_logits (jax) on numpy input."""
    from dspark_jax.engine.scheduler import survival_from_logits

    t = None if temperatures is None else np.asarray(temperatures, np.float32)
    return np.asarray(survival_from_logits(np.asarray(confidence_logits, np.float32), t))


def pool_from_records(obj: dict, path: str = "") -> RoundPool:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise UserError(f"{path or 'round records'} is not a {FORMAT} file")
    if obj.get("version") != VERSION:
        raise UserError(f"{path}: unsupported round-records version {obj.get('version')!r} (expected {VERSION})")
    try:
        logits = np.asarray(obj["confidence_logits"], np.float32)
        accepted = np.asarray(obj["accepted"], np.int32)
        request = np.asarray(obj["request"], np.int32)
        temps = obj.get("sts_temperatures")
        gamma = int(obj["gamma"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path}: corrupt round records ({type(e).__name__}: {e})") from None
    if logits.ndim != 2 or logits.shape[1] != gamma:
        raise UserError(f"{path}: confidence_logits must be [N, gamma={gamma}]")
    if temps is not None and len(temps) < gamma:
        raise UserError(f"{path}: {len(temps)} STS temperatures for gamma {gamma}")
    if len(accepted) != len(logits) or len(request) != len(logits):
        raise UserError(f"{path}: confidence_logits, accepted and request differ in length")
    survival = survival_of(logits, None if temps is None else np.asarray(temps)[:gamma])
    meta = {k: v for k, v in obj.items() if k not in ("confidence_logits", "accepted", "request")}
    # A request's rounds are stored in decoding order, none missing but its last: positions follow.
    position = np.zeros(len(accepted), np.int64)
    for r in np.unique(request):
        rows = np.flatnonzero(request == r)
        position[rows] = 1 + np.concatenate([[0], np.cumsum(accepted[rows] + 1)[:-1]])
    tokens = obj.get("max_new_tokens")
    return RoundPool(survival, accepted, request, {"kind": "records", "path": path, **meta},
                     position if isinstance(tokens, int) else None, tokens if isinstance(tokens, int) else None)


def load_pool(path: str) -> RoundPool:
    return pool_from_records(load_json(path, "round-records file"), path)


def write_json(path: str, obj: Any, indent: int | None = 1) -> None:
    """Atomic JSON write (`files.atomic_write_text`), its folder created first."""
    files.make_parent(path)
    files.atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def serving_prompts(tokenizer, count: int, max_prompt_tokens: int) -> list[list[int]]:
    """The prompts benchmarks/bench_serving.py serves: eval prompts, math / code / chat in turn."""
    from dspark_jax.data.splits import mixed_eval_prompts

    return mixed_eval_prompts(tokenizer, count, max_prompt_tokens)


def _shown_path(path: str) -> str:
    """A path relative to the working directory when it lies under it (records stay portable)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def record_rounds(*, drafter: str, target: str, prompts: int, max_new_tokens: int, temperature: float,
                  max_prompt_tokens: int, batch_size: int, seed: int, progress: bool = True) -> dict:
    """Decode `prompts` serving prompts with full-length verification; every round of every row as
    a records dict (JSON-ready), each request's rounds in decoding order. A row's last round (where
    its token budget can cut the accepted length) is left out, as bench_serving leaves finishing
    rounds out of its steady state; no other round is."""
    from dspark_jax.checkpoints.registry import default_drafter_path, load_target
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.models.sampling import SamplingConfig

    tgt = load_target(target)
    if drafter == "default":
        drafter = default_drafter_path(tgt.name) or ""
        if not drafter:
            raise UserError(f"no drafter is shipped for {tgt.name}: pass --drafter DIR")
    loaded = load_drafter(drafter, tgt.config, tgt.name)
    dcfg = loaded.config
    if not dcfg.confidence:
        raise UserError("this drafter has no confidence head: the confidence schedulers have nothing to plan with")
    gamma = dcfg.block_size
    ids = serving_prompts(tgt.tokenizer, prompts, max_prompt_tokens)
    cfg = SpecConfig(gamma=gamma, sampling=SamplingConfig(temperature), policy="fixed",
                     stop_ids=())  # stop tokens ignored, as bench_serving does
    dparams = loaded.decoding_params(tgt)
    calibrated = loaded.sts_for(temperature)
    temps = None if calibrated is None else [float(t) for t in calibrated[:gamma]]
    logits, accepted, request = [], [], []
    for start in range(0, len(ids), batch_size):
        if progress:
            print(f"recording prompts {start}..{min(start + batch_size, len(ids)) - 1} of {len(ids)}",
                  file=sys.stderr, flush=True)
        res = speculative_generate(tgt.params, tgt.config, dparams, dcfg, ids[start: start + batch_size],
                                   max_new_tokens=max_new_tokens, cfg=cfg, temperatures=temps, seed=seed + start,
                                   progress=False)
        for r, nxt in zip(res.rounds, res.rounds[1:] + [None]):
            keep = r["active"] & (nxt["active"] if nxt is not None else False)
            rows = np.flatnonzero(keep)
            logits += np.asarray(r["confidence_logits"])[rows, :gamma].tolist()
            accepted += np.asarray(r["accepted"])[rows].tolist()
            request += (rows + start).tolist()
    if not accepted:
        raise UserError("no complete round was recorded: raise --max-new-tokens")
    logits = [[round(float(x), 5) for x in row] for row in logits]
    return {"format": FORMAT, "version": VERSION, "gamma": gamma, "sts_temperatures": temps,
            "drafter": _shown_path(drafter), "target": tgt.name, "temperature": temperature, "max_new_tokens": max_new_tokens,
            "prompts": len(ids), "max_prompt_tokens": max_prompt_tokens, "prompt_set": "bench_serving",
            "batch_size": batch_size, "seed": seed, "stop_tokens": "ignored",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rounds": len(accepted), "full_tau": 1.0 + float(np.mean(accepted)),
            "confidence_logits": logits, "accepted": accepted, "request": request}


# ------------------------------------------------------------------------------------------------
# Synthetic pools from eval.json


def eval_group(obj: dict, drafter: str | None, group: str, path: str = "") -> tuple[str, dict]:
    """(drafter label, metrics dict) of one group of an eval.json: "overall", "domain:NAME" or "bench:NAME"."""
    drafters = obj.get("drafters") if isinstance(obj, dict) else None
    if not isinstance(drafters, dict) or not drafters:
        raise UserError(f"{path} is not an eval.json written by python -m dspark_jax.eval (no drafters)")
    label = drafter or next(iter(drafters))
    if label not in drafters:
        raise UserError(f"{path}: no drafter {label!r} (has: {', '.join(drafters)})")
    d = drafters[label]
    if group == "overall":
        m = d.get("overall")
    elif group.startswith("domain:"):
        m = (d.get("domains") or {}).get(group[7:])
    elif group.startswith("bench:"):
        m = (d.get("benchmarks") or {}).get(group[6:])
    else:
        raise UserError(f"bad eval group {group!r}: use overall, domain:NAME or bench:NAME")
    if not isinstance(m, dict):
        raise UserError(f"{path}: drafter {label!r} has no group {group!r}")
    return label, m


def load_json(path: str, what: str = "eval.json") -> dict:
    from dspark_jax.core.files import read_json_object

    return read_json_object(path, what)


load_eval = load_json


def reliability_pool(hist: Sequence[int], curves: Sequence[dict], n: int, seed: int, source: dict) -> RoundPool:
    """Synthetic rounds from an accepted-length histogram [gamma + 1] and per-position reliability
    curves ({mean_predicted, observed, counts} over equal-width bins of a_k vs "first k accepted")."""
    hist = np.asarray(hist, np.float64)
    gamma = len(hist) - 1
    if gamma < 1 or len(curves) < gamma or hist.sum() <= 0:
        raise UserError("the eval group needs an accepted-length histogram and one reliability curve per position")
    rng = np.random.default_rng(seed)
    A = rng.choice(gamma + 1, size=n, p=hist / hist.sum()).astype(np.int32)
    u = rng.random(n)
    a = np.zeros((n, gamma))
    for k in range(gamma):
        cur = curves[k]
        counts = np.asarray(cur["counts"], np.float64)
        bins = len(counts)
        obs = np.nan_to_num(np.asarray(cur["observed"], np.float64))
        mean = np.asarray(cur["mean_predicted"], np.float64)
        centre = (np.arange(bins) + 0.5) / bins
        mean = np.where(np.isfinite(mean) & (counts > 0), mean, centre)
        lo, hi = np.arange(bins) / bins, (np.arange(bins) + 1) / bins
        half = np.minimum(mean - lo, hi - mean)
        for survived in (True, False):
            w = counts * (obs if survived else 1 - obs)
            if w.sum() <= 0:
                w = counts.copy()
            if w.sum() <= 0:
                w = np.ones(bins)
            cdf = np.cumsum(w) / w.sum()
            rows = (A >= k + 1) == survived
            b = np.minimum(np.searchsorted(cdf, u[rows], side="right"), bins - 1)
            start = np.where(b > 0, cdf[np.maximum(b - 1, 0)], 0.0)
            frac = np.clip((u[rows] - start) / np.maximum(cdf[b] - start, 1e-12), 0, 1)
            a[rows, k] = mean[b] + (2 * frac - 1) * half[b]
    a = np.minimum.accumulate(np.clip(a, 0, 1), axis=1)
    return RoundPool(a.astype(np.float32), A, np.zeros(n, np.int32), source)


def rates_pool(rates: Sequence[float], kappa: float, n: int, seed: int, source: dict) -> RoundPool:
    """Synthetic rounds from per-position conditional acceptance rates with Beta(alpha kappa,
    (1 - alpha) kappa) confidences, calibrated by construction (module docstring)."""
    alpha = np.clip(np.asarray(rates, np.float64), 1e-4, 1 - 1e-4)
    if alpha.ndim != 1 or len(alpha) < 1:
        raise UserError("need one conditional acceptance rate per draft position")
    if not kappa > 0:
        raise UserError("the confidence concentration kappa must be > 0")
    rng = np.random.default_rng(seed)
    c = rng.beta(alpha * kappa, (1 - alpha) * kappa, size=(n, len(alpha)))
    ok = rng.random((n, len(alpha))) < c
    A = np.cumprod(ok, axis=1).sum(axis=1).astype(np.int32)
    return RoundPool(np.cumprod(c, axis=1).astype(np.float32), A, np.zeros(n, np.int32),
                     dict(source, kappa=float(kappa)))


def threshold_check(pool: RoundPool, thresholds: Sequence[float]) -> dict:
    """Static-threshold verification replayed on a pool (same rule as eval's threshold sweep)."""
    from dspark_jax.evaluation.calibration import verified_lengths

    tps, vps = [], []
    for h in thresholds:
        lengths = verified_lengths(pool.survival, h)
        tps.append(float(np.mean(np.minimum(pool.accepted, lengths) + 1)))
        vps.append(float(np.mean(lengths)))
    return {"thresholds": list(map(float, thresholds)), "tokens_per_step": tps, "verified_per_step": vps}


def fit_concentration(rates, sweep: dict, seed: int = 0, n: int = 20000) -> float:
    """The kappa (log grid) whose synthetic threshold sweep best matches a measured one
    (squared error of tokens per step and verified tokens per step over the thresholds)."""
    want_t = np.asarray(sweep["tokens_per_step"])
    want_v = np.asarray(sweep["verified_per_step"])
    best, best_err = 1.0, np.inf
    for kappa in np.geomspace(0.05, 50, 31):
        got = threshold_check(rates_pool(rates, kappa, n, seed, {}), sweep["thresholds"])
        err = np.sum((np.asarray(got["tokens_per_step"]) - want_t) ** 2) + np.sum(
            (np.asarray(got["verified_per_step"]) - want_v) ** 2)
        if err < best_err:
            best, best_err = float(kappa), err
    return best


def pool_from_eval(path: str, *, drafter: str | None = None, group: str = "overall", model: str = "reliability",
                   n: int = 20000, seed: int = 0, kappa: float | None = None) -> RoundPool:
    obj = load_eval(path)
    label, m = eval_group(obj, drafter, group, path)
    source = {"kind": f"eval:{model}", "path": path, "drafter": label, "group": group,
              "eval_rounds": m.get("rounds"), "eval_tau": m.get("tau"),
              "temperature": (obj.get("settings") or {}).get("temperature"),
              "max_new_tokens": (obj.get("settings") or {}).get("max_new_tokens")}
    if model == "reliability":
        cal = m.get("calibration") or {}
        curves = cal.get("reliability_sts") or cal.get("reliability_raw")
        if not curves or "accepted_histogram" not in m:
            raise UserError(f"{path}: group {group!r} has no reliability diagrams (a drafter without a confidence "
                            "head?); use --eval-model beta")
        source["reliability"] = "sts" if cal.get("reliability_sts") else "raw"
        return reliability_pool(m["accepted_histogram"], curves, n, seed, source)
    if model == "beta":
        rates = m.get("conditional_acceptance")
        if not rates:
            raise UserError(f"{path}: group {group!r} has no conditional_acceptance")
        rates = [0.0 if r is None or not np.isfinite(r) else r for r in rates]
        if kappa is None:
            sweep = m.get("threshold_sweep")
            if not sweep:
                raise UserError(f"{path}: no threshold sweep to fit the confidence concentration to; pass --kappa")
            kappa = fit_concentration(rates, sweep, seed)
            source["kappa_fitted_to"] = "eval threshold sweep"
        return rates_pool(rates, kappa, n, seed, source)
    raise UserError(f"unknown eval model {model!r} (use reliability or beta)")
