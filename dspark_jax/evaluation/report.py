"""The eval report: markdown tables (Table 1 layout, per domain, per position, calibration), plots,
and the files of a results folder."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.evaluation.benchmark import Bench


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


def write_report(report: dict, benches: list[Bench], out: str) -> list[str]:
    """OUT/eval.md, OUT/eval.json (written last: its presence means the run finished) and the
    plots; returns the plots' paths. A folder that cannot be written is a UserError (in a
    multi-process run process 0 writes, and every process reports the error)."""
    try:
        files.makedirs(out)
        plots = write_plots(report, out)
        files.atomic_write_text(os.path.join(out, "eval.md"), markdown(report, benches, plots))
        files.atomic_write_text(os.path.join(out, "eval.json"), json.dumps(report, indent=1))  # last: its presence = done
    except OSError as e:
        raise UserError(f"cannot write the results to {out}: {e.strerror or e}") from None
    return plots
