"""Evaluating drafters (`python -m dspark_jax.eval`): benchmarks, per-group metrics of full-length
rounds, the comparison with a baseline (the paper's Table 1) and the whole run.

In a multi-process run every process evaluates with the same settings: the batches of each
benchmark are shared out between the processes and their rounds gathered back in batch order
(`rounds.collect_rounds`), so every process computes the report of a one-process run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import numpy as np

from dspark_jax.checkpoints.known_targets import DEFAULT_TARGET
from dspark_jax.core.config_checks import setting, validate
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather
from dspark_jax.evaluation.rounds import collect_rounds, pool_rounds

DEFAULT_SETS = "gsm8k,math500,humaneval,mbpp,arena-hard-v2"
OTHER = "other"
DEFAULT_THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 .. 0.95


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What `python -m dspark_jax.eval` evaluates and how (each field's doc is its flag's help)."""

    drafters: str = setting(doc="comma-separated drafter folders, each optionally labelled NAME=DIR")
    out: str = setting(doc="results folder (eval.json, eval.md, *.png)")
    baseline: str | None = setting(None, doc="drafter the relative gains refer to (default: the first)")
    target: str = setting(DEFAULT_TARGET, doc="known name, Hugging Face folder or .gguf file")
    sets: str = setting("default", doc=f"prompt sets, domains or 'all' (EVAL split); default {DEFAULT_SETS}, or none "
                                       "when --bench is given; 'none' for none")
    bench: tuple[str, ...] = setting((), metavar="NAME=PATH[:DOMAIN]",
                                     doc='extra benchmark: a {"turns": [...]} JSONL file (all of it; domain math, code, '
                                         f"chat or {OTHER}, default {OTHER}); repeatable")
    limit: int = setting(20, ge=1, doc="prompts per benchmark (the first N)")
    gamma: int | None = setting(None, ge=1, doc="draft tokens per round (default: each drafter's block)")
    max_new_tokens: int = setting(256, ge=2, doc="tokens to generate per prompt at most")
    temperature: float = setting(1.0, ge=0, doc="sampling temperature (0 = greedy)")
    batch_size: int = setting(8, ge=1, doc="prompts decoded together")
    seed: int = setting(0, ge=0, lt=2**32, doc="random seed of the sampling")
    dtype: str = setting("float32", choices=("float32", "bfloat16"),
                         doc="weights' dtype; bfloat16 keeps fp32 activations on a CPU and is much faster for verify "
                             "passes and batches on CPUs with AMX or AVX512-BF16 (docs/results.md section 9)")
    thresholds: tuple[float, ...] = setting(DEFAULT_THRESHOLDS, ge=0, le=1,
                                            doc="prefix-survival thresholds of the static-threshold sweep")
    bins: int = setting(10, ge=1, doc="equal-width bins for ECE and reliability diagrams")
    progress: bool = setting(True, flag="--no-progress", doc="no progress bars")

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass
class Bench:
    name: str
    domain: str
    source: str  # where the prompts come from
    prompts: list[str]


def parse_drafters(spec: str) -> dict[str, str]:
    """'a,lbl=b' -> {label: folder}; the default label is the folder name (its parent's for '.../drafter')."""
    drafters: dict[str, str] = {}
    for part in (s.strip() for s in spec.split(",")):
        if not part:
            continue
        label, sep, path = part.partition("=")
        if not sep:
            path = part
            folder = os.path.normpath(path)
            label = os.path.basename(folder)
            if label == "drafter" and os.path.basename(os.path.dirname(folder)):
                label = os.path.basename(os.path.dirname(folder))
        label, path = label.strip(), path.strip()
        if not label or not path:
            raise UserError(f"--drafters expects DIR or NAME=DIR, got {part!r}")
        if label in drafters:
            raise UserError(f"two drafters are labelled {label!r}: name them, e.g. --drafters a={path},b=...")
        drafters[label] = path
    if not drafters:
        raise UserError("--drafters names no drafter folder")
    return drafters


def parse_bench(spec: str) -> tuple[str, str, str]:
    """'NAME=PATH[:DOMAIN]' -> (name, path, domain)."""
    from dspark_jax.data.splits import DOMAINS

    name, sep, rest = spec.partition("=")
    name, rest = name.strip(), rest.strip()
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name) or not rest:
        raise UserError(f"--bench expects NAME=PATH[:DOMAIN] (NAME of letters, digits, '_.+-'), got {spec!r}")
    domains = (*DOMAINS, OTHER)
    path, domain = rest, OTHER
    head, colon, tail = rest.rpartition(":")
    if colon and not os.path.exists(rest):
        if tail not in domains:
            raise UserError(f"--bench {spec!r}: unknown domain {tail!r} (use one of: {', '.join(domains)})")
        path, domain = head, tail
    return name, path, domain


def load_benches(settings: EvalSettings) -> list[Bench]:
    """The benchmarks in domain order (math, code, chat, other), each cut to --limit prompts."""
    from dspark_jax.data.prompt_files import read_prompts_file
    from dspark_jax.data.splits import (
        DOMAINS,
        PROMPTS_DIR,
        domain_of,
        get_split,
        parse_sets,
    )

    sets = settings.sets if settings.sets != "default" else ("none" if settings.bench else DEFAULT_SETS)
    benches = [] if sets.strip() == "none" else [
        Bench(name, domain_of(name), os.path.join(PROMPTS_DIR, f"{name}.jsonl") + " (eval split)",
              get_split(name, "eval")[: settings.limit]) for name in parse_sets(sets)]
    for spec in settings.bench:
        name, path, domain = parse_bench(spec)
        benches.append(Bench(name, domain, path, read_prompts_file(path)[: settings.limit]))
    if not benches:
        raise UserError("no benchmarks: give --sets and/or --bench NAME=PATH")
    names = [b.name for b in benches]
    for name in names:
        if names.count(name) > 1:
            raise UserError(f"benchmark {name!r} is given twice")
    for b in benches:
        if not b.prompts:
            raise UserError(f"benchmark {b.name} has no prompts")
    order = [*DOMAINS, OTHER]
    return sorted(benches, key=lambda b: order.index(b.domain))


def drafter_gamma(settings: EvalSettings, label: str, dcfg) -> int:
    gamma = settings.gamma or dcfg.block_size
    if dcfg.kind == "dspark" and gamma > dcfg.block_size:
        raise UserError(f"--gamma {gamma} is larger than the block size {dcfg.block_size} of drafter {label}")
    return gamma


def check_prompts(target, benches: list[Bench], max_new_tokens: int) -> None:
    """Every templated prompt fits the target's context with its new tokens (before any decoding)."""
    from dspark_jax.engine.generate import check_context

    for b in benches:
        try:
            check_context(target.config, [len(target.tokenizer.chat_prompt_ids(p)) for p in b.prompts],
                          max_new_tokens)
        except UserError as e:
            raise UserError(f"benchmark {b.name}: {e}") from None


def round_metrics(rounds, prompts: int, gamma: int, confidence: bool, temperatures, thresholds, bins: int) -> dict:
    """Every number of one group of full-length rounds (a benchmark, a domain or everything)."""
    from dspark_jax.evaluation.calibration import (
        calibration_report,
        conditional_acceptance,
        threshold_sweep,
    )

    acc = rounds.accepted
    n, verified, accepted = len(acc), int(rounds.num_draft.sum()), int(acc.sum())
    rates, reached = conditional_acceptance(acc, gamma)
    out = {
        "prompts": prompts,
        "rounds": n,
        "generated_tokens": int(rounds.generated_tokens),
        "verified_tokens": verified,
        "accepted_tokens": accepted,
        "tau": 1.0 + accepted / n if n else float("nan"),
        "acceptance_rate": accepted / verified if verified else float("nan"),
        "accepted_histogram": np.bincount(acc, minlength=gamma + 1).tolist(),
        "conditional_acceptance": rates.tolist(),
        "conditional_count": reached.tolist(),
    }
    if confidence and n:
        temps = np.ones(gamma) if temperatures is None else temperatures
        report = calibration_report(rounds.confidence_logits, acc, temps, bins=bins)
        if temperatures is None:  # nothing stored: report the raw head only
            report = {k: v for k, v in report.items() if not k.endswith("_sts")}
            report.update(temperatures=None, temperatures_source="none")
        else:
            report["temperatures_source"] = "drafter"
        out["calibration"] = report
        out["threshold_sweep"] = dict(threshold_sweep(rounds.confidence_logits, acc, thresholds, temperatures),
                                      temperatures="sts" if temperatures is not None else "raw")
    return out


def calibrated_with(loaded, temperature: float) -> dict | None:
    """The `calibrate` settings of the STS temperatures a run at `temperature` uses."""
    at = loaded.calibrated_at(temperature)
    if at is None:
        return loaded.metadata.get("calibration")
    return (loaded.metadata.get("calibrations") or {}).get(f"{at:g}")


def evaluate_drafter(settings: EvalSettings, target, label: str, path: str, loaded, gamma: int,
                     benches: list[Bench]) -> dict:
    dcfg = loaded.config
    temps = None
    calibrated = loaded.sts_for(settings.temperature)
    if dcfg.confidence and calibrated is not None and len(calibrated) >= gamma:
        temps = np.asarray(calibrated[:gamma], dtype=np.float64)
    per_bench = {}
    for b in benches:
        if settings.progress and gather.is_primary():
            print(f"[{label}] {b.name}: {len(b.prompts)} prompts", file=sys.stderr, flush=True)
        per_bench[b.name] = collect_rounds(target, loaded, b.prompts, max_new_tokens=settings.max_new_tokens,
                                           temperature=settings.temperature, batch_size=settings.batch_size,
                                           seed=settings.seed, progress=settings.progress, gamma=gamma)

    def metrics(names: list[str]) -> dict:
        prompts = sum(len(b.prompts) for b in benches if b.name in names)
        return round_metrics(pool_rounds([per_bench[n] for n in names]), prompts, gamma, dcfg.confidence, temps,
                             settings.thresholds, settings.bins)

    domains = {}
    for b in benches:
        domains.setdefault(b.domain, []).append(b.name)
    bench_metrics = {b.name: metrics([b.name]) for b in benches}
    return {
        "path": path, "kind": dcfg.kind, "head": dcfg.head, "confidence": dcfg.confidence,
        "block_size": dcfg.block_size, "gamma": gamma,
        "sts_temperatures": None if temps is None else temps.tolist(),
        "calibrated_with": calibrated_with(loaded, settings.temperature),  # what `calibrate` fitted them on
        "benchmarks": bench_metrics,
        "domains": {d: metrics(names) for d, names in domains.items()},
        "overall": metrics([b.name for b in benches]),
        "macro_tau": float(np.mean([m["tau"] for m in bench_metrics.values()])),
    }


def comparison(results: dict, baseline: str, benches: list[Bench]) -> dict:
    """Table 1: per drafter and column (benchmarks, domains, macro average) tau and gain over the baseline.

    gain = tau / baseline tau - 1; the macro average is the unweighted mean of the benchmarks' tau
    (its gain is that of the mean), a domain's tau pools its benchmarks' rounds.
    """
    def cells(r):
        out = {f"bench:{b.name}": r["benchmarks"][b.name]["tau"] for b in benches}
        out.update({f"domain:{d}": m["tau"] for d, m in r["domains"].items()})
        out["macro"] = r["macro_tau"]
        return out

    base = cells(results[baseline])
    rows = {}
    for label, r in results.items():
        rows[label] = {col: {"tau": tau, "gain": tau / base[col] - 1.0 if base[col] else float("nan")}
                       for col, tau in cells(r).items()}
    return {"baseline": baseline, "columns": list(base), "rows": rows}


def evaluate(settings: EvalSettings) -> tuple[dict, list[Bench]]:
    """The whole evaluation `python -m dspark_jax.eval` runs: every drafter on
    every benchmark, checked before the target loads. Returns the report (JSON-able) and the benchmarks.

    Several processes each call this with the same settings and all get the same report; a
    UserError on any process (settings, files, the target) is raised on every one."""
    from dspark_jax.evaluation.calibration import to_jsonable

    drafter_paths, baseline, benches, loaded, gammas, target = gather.everywhere(lambda: prepare(settings))
    results = {label: evaluate_drafter(settings, target, label, drafter_paths[label], d, gammas[label], benches)
               for label, d in loaded.items()}
    chosen = {"target": target.name, "scheduler": "fixed", "temperature": settings.temperature,
              "max_new_tokens": settings.max_new_tokens, "limit": settings.limit, "batch_size": settings.batch_size,
              "seed": settings.seed, "dtype": settings.dtype, "gamma": settings.gamma, "bins": settings.bins,
              "thresholds": list(settings.thresholds)}
    if gather.process_count() > 1:  # the numbers are those of one process: this is how they were made
        chosen["processes"] = gather.process_count()
    report = {
        "settings": chosen,
        "benchmarks": [{"name": b.name, "domain": b.domain, "source": b.source, "prompts": len(b.prompts)}
                       for b in benches],
        "drafters": results,
        "comparison": comparison(results, baseline, benches),
    }
    return to_jsonable(report), benches


def prepare(settings: EvalSettings):
    """Everything before decoding, checked before the target loads: (drafter paths by label, the
    baseline's label, the benchmarks, the loaded drafters, their gamma, the target)."""
    drafter_paths = parse_drafters(settings.drafters)
    baseline = settings.baseline or next(iter(drafter_paths))
    if baseline not in drafter_paths:
        raise UserError(f"--baseline {baseline!r} is not one of the drafters ({', '.join(drafter_paths)})")
    benches = load_benches(settings)

    from dspark_jax.checkpoints import registry
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config

    configs = {label: read_drafter_config(path) for label, path in drafter_paths.items()}  # their JSON only
    gammas = {label: drafter_gamma(settings, label, dcfg) for label, dcfg in configs.items()}
    loaded = {label: load_drafter(path) for label, path in drafter_paths.items()}  # fail fast, before the target
    target = registry.load_target(settings.target, dtype=settings.dtype)
    for d in loaded.values():
        d.config.check_target(target.config, target.name)
    check_prompts(target, benches, settings.max_new_tokens)
    if len(set(gammas.values())) > 1 and settings.progress and gather.is_primary():
        print(f"note: the drafters verify different gamma ({gammas}); pass --gamma for a like-for-like comparison",
              file=sys.stderr)
    return drafter_paths, baseline, benches, loaded, gammas, target
