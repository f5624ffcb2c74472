"""Evaluate and compare drafters by speculative decoding with fixed-length verification (DESIGN.md 5).

    python -m dspark_jax.eval --drafters dspark=runs/dspark/drafter,dflash=runs/dflash/drafter --out runs/eval

Every round verifies all gamma draft tokens (scheduler "fixed"), so the numbers measure draft
quality, not a verification policy. Prompts are the EVAL split of the benchmark sets (never
training prompts) plus any `--bench NAME=PATH[:DOMAIN]` JSONL file, chat-templated; every drafter
sees the same prompts with the same seeds. Per drafter, benchmark, domain and overall: tau (mean
accepted + 1 per round, bonus included), position-wise conditional acceptance, verified and
accepted draft tokens; with a confidence head also per-position calibration (ECE, ROC-AUC; raw and
after the drafter's stored STS temperatures) and the static-threshold sweep. Writes
OUT/eval.json (every number), OUT/eval.md (tables) and PNG plots, and prints the comparison table
(the paper's Table 1 layout: tau and relative gain over the baseline drafter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import numpy as np

from dspark_jax.core.cli import POSITIVE_INT, ArgumentParser, flag, run_cli, setting_flag
from dspark_jax.core.errors import UserError

DEFAULT_SETS = "gsm8k,math500,humaneval,mbpp,arena-hard-v2"
OTHER = "other"
DEFAULT_THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 .. 0.95


@dataclasses.dataclass
class Bench:
    name: str
    domain: str
    source: str  # where the prompts come from
    prompts: list[str]


# ------------------------------------------------------------------------------------------------
# arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from dspark_jax.checkpoints.registry import DEFAULT_TARGET
    from dspark_jax.engine.speculative import SpecConfig
    from dspark_jax.engine.sampling import SamplingConfig

    p = ArgumentParser(prog="python -m dspark_jax.eval", description=__doc__.split("\n")[0])
    p.add_argument("--drafters", required=True,
                   help="comma-separated drafter folders, each optionally labelled NAME=DIR")
    p.add_argument("--baseline", default=None, help="drafter the relative gains refer to (default: the first)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="known name, Hugging Face folder or .gguf file")
    p.add_argument("--sets", default=None,
                   help=f"prompt sets, domains or 'all' (EVAL split); default {DEFAULT_SETS}, "
                        "or none when --bench is given; 'none' for none")
    p.add_argument("--bench", action="append", default=[], metavar="NAME=PATH[:DOMAIN]",
                   help='extra benchmark: a {"turns": [...]} JSONL file (all of it; domain math, code, chat '
                        f"or {OTHER}, default {OTHER}); repeatable")
    p.add_argument("--limit", type=POSITIVE_INT, default=20, help="prompts per benchmark (the first N)")
    p.add_argument("--gamma", type=setting_flag(SpecConfig, "gamma"), default=None,
                   help="draft tokens per round (default: each drafter's block)")
    p.add_argument("--max-new-tokens", type=flag(int, ge=2), default=256)
    p.add_argument("--temperature", type=setting_flag(SamplingConfig, "temperature"), default=1.0,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=8)
    p.add_argument("--seed", type=flag(int, ge=0, lt=2**32), default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--thresholds", default=",".join(map(str, DEFAULT_THRESHOLDS)),
                   help="prefix-survival thresholds of the static-threshold sweep")
    p.add_argument("--bins", type=POSITIVE_INT, default=10, help="equal-width bins for ECE and reliability diagrams")
    p.add_argument("--out", required=True, help="results folder (eval.json, eval.md, *.png)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        args.thresholds = [float(h) for h in args.thresholds.split(",") if h.strip()]
    except ValueError:
        raise UserError(f"--thresholds must be comma-separated numbers, got {args.thresholds!r}") from None
    if not args.thresholds or not all(0 <= h <= 1 for h in args.thresholds):
        raise UserError("--thresholds must be numbers in [0, 1]")
    return args


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


def load_benches(args) -> list[Bench]:
    """The benchmarks in domain order (math, code, chat, other), each cut to --limit prompts."""
    from dspark_jax.data.prompt_files import read_prompts_file
    from dspark_jax.data.splits import (
        DOMAINS,
        PROMPTS_DIR,
        domain_of,
        get_split,
        parse_sets,
    )

    sets = args.sets if args.sets is not None else ("none" if args.bench else DEFAULT_SETS)
    benches = [] if sets.strip() == "none" else [
        Bench(name, domain_of(name), os.path.join(PROMPTS_DIR, f"{name}.jsonl") + " (eval split)",
              get_split(name, "eval")[: args.limit]) for name in parse_sets(sets)]
    for spec in args.bench:
        name, path, domain = parse_bench(spec)
        benches.append(Bench(name, domain, path, read_prompts_file(path)[: args.limit]))
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


def drafter_gamma(args, label: str, dcfg) -> int:
    gamma = args.gamma or dcfg.block_size
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


# ------------------------------------------------------------------------------------------------
# metrics


def pool(parts):
    """One Rounds record of several (rounds concatenated, generated tokens summed)."""
    from dspark_jax.calibrate import Rounds

    return Rounds(np.concatenate([r.confidence_logits for r in parts]), np.concatenate([r.accepted for r in parts]),
                  np.concatenate([r.num_draft for r in parts]), sum(r.generated_tokens for r in parts))


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


def evaluate_drafter(args, target, label: str, path: str, loaded, gamma: int, benches: list[Bench]) -> dict:
    from dspark_jax.calibrate import collect_rounds

    dcfg = loaded.config
    temps = None
    if dcfg.confidence and loaded.sts_temperatures is not None and len(loaded.sts_temperatures) >= gamma:
        temps = np.asarray(loaded.sts_temperatures[:gamma], dtype=np.float64)
    per_bench = {}
    for b in benches:
        if not args.no_progress:
            print(f"[{label}] {b.name}: {len(b.prompts)} prompts", file=sys.stderr, flush=True)
        per_bench[b.name] = collect_rounds(target, loaded, b.prompts, max_new_tokens=args.max_new_tokens,
                                           temperature=args.temperature, batch_size=args.batch_size,
                                           seed=args.seed, progress=not args.no_progress, gamma=gamma)

    def metrics(names: list[str]) -> dict:
        prompts = sum(len(b.prompts) for b in benches if b.name in names)
        return round_metrics(pool([per_bench[n] for n in names]), prompts, gamma, dcfg.confidence, temps,
                             args.thresholds, args.bins)

    domains = {}
    for b in benches:
        domains.setdefault(b.domain, []).append(b.name)
    bench_metrics = {b.name: metrics([b.name]) for b in benches}
    return {
        "path": path, "kind": dcfg.kind, "head": dcfg.head, "confidence": dcfg.confidence,
        "block_size": dcfg.block_size, "gamma": gamma,
        "sts_temperatures": None if temps is None else temps.tolist(),
        "calibrated_with": loaded.metadata.get("calibration"),  # what `calibrate` fitted them on
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


# ------------------------------------------------------------------------------------------------
# reports


def _num(x, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or not np.isfinite(x) else fmt.format(x)


def _pct(x) -> str:
    return _num(None if x is None else 100 * x, "{:.1f}%")


def _gain(x) -> str:
    return _num(None if x is None else 100 * x, "{:+.1f}%")


def _table(header: list[str], rows: list[list[str]], align_left: int = 1) -> list[str]:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < align_left else "---:" for i in range(len(header))) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def table1(report: dict, benches: list[Bench]) -> list[str]:
    comp = report["comparison"]
    header = ["drafter", "gamma"] + [f"{b.domain}: {b.name}" for b in benches] + ["macro avg"]
    rows = []
    for label, cells in comp["rows"].items():
        row = [label, str(report["drafters"][label]["gamma"])]
        for col in [f"bench:{b.name}" for b in benches] + ["macro"]:
            c = cells[col]
            row.append(_num(c["tau"]) + ("" if label == comp["baseline"] else f" ({_gain(c['gain'])})"))
        rows.append(row)
    return _table(header, rows)


def markdown(report: dict, benches: list[Bench], plots: list[str]) -> str:
    s, drafters, baseline = report["settings"], report["drafters"], report["comparison"]["baseline"]
    lines = ["# Drafter evaluation", "",
             (f"Target `{s['target']}`, fixed-length verification (every draft token verified), temperature "
              f"{s['temperature']}, up to {s['max_new_tokens']} new tokens, seed {s['seed']}, at most "
              f"{s['limit']} prompts per benchmark. tau = accepted draft tokens + 1 (bonus) per round."), "",
             f"## tau per benchmark (gain over `{baseline}` in parentheses)", ""]
    lines += table1(report, benches)
    lines += ["", "Macro avg: unweighted mean over benchmarks. Prompts per benchmark: "
              + ", ".join(f"{b.name} {len(b.prompts)}" for b in benches) + ".", "",
              "## Per domain (rounds pooled)", ""]
    rows = []
    for label, r in drafters.items():
        for group, m in list(r["domains"].items()) + [("all", r["overall"])]:
            gain = report["comparison"]["rows"][label].get(f"domain:{group}", {}).get("gain")
            rows.append([label, group, str(m["prompts"]), str(m["rounds"]), _num(m["tau"]),
                         "" if group == "all" or label == baseline else _gain(gain), str(m["verified_tokens"]), str(m["accepted_tokens"]),
                         _pct(m["acceptance_rate"])])
    lines += _table(["drafter", "domain", "prompts", "rounds", "tau", "gain", "verified", "accepted",
                     "acceptance rate"], rows, align_left=2)
    gamma = max(r["gamma"] for r in drafters.values())
    lines += ["", "## Position-wise conditional acceptance", "",
              "P(draft token k accepted | tokens 1..k-1 accepted), with the number of rounds that reached k.", ""]
    rows = []
    for label, r in drafters.items():
        for group, m in list(r["domains"].items()) + [("all", r["overall"])]:
            cells = [f"{_num(v)} ({c})" for v, c in zip(m["conditional_acceptance"], m["conditional_count"])]
            rows.append([label, group] + cells + [""] * (gamma - len(cells)))
    lines += _table(["drafter", "domain"] + [f"k={k}" for k in range(1, gamma + 1)], rows, align_left=2)
    for label, r in drafters.items():
        cal = r["overall"].get("calibration")
        if cal is None:
            continue
        sts = "ece_sts" in cal
        lines += ["", f"## Confidence head of `{label}` (all benchmarks, {cal['num_rounds']} rounds)", "",
                  "Prefix survival a_k against \"first k draft tokens accepted\"; "
                  + ("STS = the temperatures stored in the drafter." if sts else "no STS temperatures stored."), ""]
        rows = []
        for k in range(cal["gamma"]):
            row = [str(k + 1), _pct(cal["event_rate"][k]), _pct(cal["ece_raw"][k]), _num(cal["auc_raw"][k], "{:.3f}")]
            if sts:
                row += [_pct(cal["ece_sts"][k]), _num(cal["auc_sts"][k], "{:.3f}"), _num(cal["temperatures"][k])]
            rows.append(row)
        lines += _table(["k", "event rate", "ECE raw", "AUC raw"] + (["ECE STS", "AUC STS", "T_k"] if sts else []),
                        rows)
        sweep = r["overall"]["threshold_sweep"]
        lines += ["", (f"Static-threshold sweep ({sweep['temperatures']} a_k; full length: tau "
                       f"{_num(sweep['full_tokens_per_step'])}):"), ""]
        rows = [[_num(h), _num(t), _num(v), _pct(a)] for h, t, v, a in zip(
            sweep["thresholds"], sweep["tokens_per_step"], sweep["verified_per_step"], sweep["acceptance_rate"])]
        lines += _table(["threshold", "tokens/step", "verified/step", "acceptance rate"], rows, align_left=0)
    lines += ["", "## Plots", ""] + [f"- [{os.path.basename(p)}]({os.path.basename(p)})" for p in plots]
    return "\n".join(lines) + "\n"


def _stem(label: str) -> str:
    """A drafter label as a file-name part."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", label)


def write_plots(report: dict, out: str) -> list[str]:
    from dspark_jax.evaluation.plots import (
        acceptance_curves,
        reliability_diagram,
        threshold_sweep_plot,
    )

    drafters = report["drafters"]
    paths = [acceptance_curves({k: r["overall"]["conditional_acceptance"] for k, r in drafters.items()},
                               os.path.join(out, "acceptance.png"),
                               title="Position-wise conditional acceptance (all benchmarks)")]
    for domain in next(iter(drafters.values()))["domains"]:
        paths.append(acceptance_curves({k: r["domains"][domain]["conditional_acceptance"] for k, r in drafters.items()},
                                       os.path.join(out, f"acceptance_{domain}.png"),
                                       title=f"Position-wise conditional acceptance ({domain})"))
    for label, r in drafters.items():
        if "calibration" not in r["overall"]:
            continue
        paths.append(reliability_diagram(r["overall"]["calibration"], os.path.join(out, f"reliability_{_stem(label)}.png"),
                                         title=f"Reliability of prefix survival a_k: {label}"))
        paths.append(threshold_sweep_plot(r["overall"]["threshold_sweep"],
                                          os.path.join(out, f"threshold_sweep_{_stem(label)}.png"),
                                          title=f"Static confidence-threshold sweep: {label}"))
    return paths


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# entry point


@run_cli
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    drafter_paths = parse_drafters(args.drafters)
    baseline = args.baseline or next(iter(drafter_paths))
    if baseline not in drafter_paths:
        raise UserError(f"--baseline {baseline!r} is not one of the drafters ({', '.join(drafter_paths)})")
    benches = load_benches(args)

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config
    from dspark_jax.evaluation.calibration import to_jsonable

    configs = {label: read_drafter_config(path) for label, path in drafter_paths.items()}  # their JSON only
    gammas = {label: drafter_gamma(args, label, dcfg) for label, dcfg in configs.items()}
    loaded = {label: load_drafter(path) for label, path in drafter_paths.items()}  # fail fast, before the target
    target = load_target(args.target, dtype=args.dtype)
    for d in loaded.values():
        d.config.check_target(target.config, target.name)
    check_prompts(target, benches, args.max_new_tokens)
    if len(set(gammas.values())) > 1 and not args.no_progress:
        print(f"note: the drafters verify different gamma ({gammas}); pass --gamma for a like-for-like comparison",
              file=sys.stderr)

    results = {label: evaluate_drafter(args, target, label, drafter_paths[label], d, gammas[label], benches)
               for label, d in loaded.items()}
    report = {
        "settings": {"target": target.name, "scheduler": "fixed", "temperature": args.temperature,
                     "max_new_tokens": args.max_new_tokens, "limit": args.limit, "batch_size": args.batch_size,
                     "seed": args.seed, "dtype": args.dtype, "gamma": args.gamma, "bins": args.bins,
                     "thresholds": args.thresholds},
        "benchmarks": [{"name": b.name, "domain": b.domain, "source": b.source, "prompts": len(b.prompts)}
                       for b in benches],
        "drafters": results,
        "comparison": comparison(results, baseline, benches),
    }
    report = to_jsonable(report)
    os.makedirs(args.out, exist_ok=True)
    plots = write_plots(report, args.out)
    _write_text(os.path.join(args.out, "eval.md"), markdown(report, benches, plots))
    _write_text(os.path.join(args.out, "eval.json"), json.dumps(report, indent=1))  # last: its presence = done
    print("\n".join(table1(report, benches)))
    print(f"\nwrote {os.path.join(args.out, 'eval.json')}, {os.path.join(args.out, 'eval.md')} "
          f"and {len(plots)} plots", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
