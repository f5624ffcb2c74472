"""Results files of the serving simulator: JSON, Markdown and PNG (atomic writes)."""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from typing import Any, Sequence

from dspark_jax.core import files
from dspark_jax.engine.sps import machine
from dspark_jax.serving.rounds import write_json
from dspark_jax.serving.simulator import gains_over, pareto_front


def meta(argv: Sequence[str] | None) -> dict[str, Any]:
    args = list(sys.argv[1:] if argv is None else argv)
    return {"command": "python -m dspark_jax.simulate " + " ".join(shlex.quote(a) for a in args),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine()}


def header(m: dict) -> str:
    mc = m["machine"]
    return (f"Command: `{m['command']}`  \nDate: {m['date']}  \n"
            f"Machine (where the simulation ran): {mc['cpu']}, {mc['cores']} cores, JAX {mc['jax']} "
            f"({mc['jax_backend']})\n\n")


def write_text(path: str, text: str) -> None:
    files.make_parent(path)
    files.atomic_write_text(path, text)


def out_paths(out: str, *suffixes: str) -> tuple[str, str, list[str]]:
    """--out DIR/name.md -> (DIR/name.md, DIR/name.json, [DIR/name<suffix>.png ...])."""
    base = os.path.splitext(files.absolute(out))[0]
    return base + ".md", base + ".json", [f"{base}{s}.png" for s in suffixes]


# ------------------------------------------------------------------------------------------------
# plots


def plot_throughput(rows: Sequence[dict], policies: Sequence[str], path: str, title: str) -> str:
    from dspark_jax.evaluation.plots import _new_figure, _save

    fig = _new_figure(7.5, 5.5)
    ax = fig.subplots()
    for p in policies:
        mine = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["concurrency"])
        if not mine:
            continue
        line, = ax.plot([r["per_user_tokens_per_s"] for r in mine], [r["aggregate_tokens_per_s"] for r in mine],
                        marker="o", mfc="none", lw=1, label=p)
        front = pareto_front(mine)
        ax.plot([r["per_user_tokens_per_s"] for r in front], [r["aggregate_tokens_per_s"] for r in front],
                ls="none", marker="o", color=line.get_color())
        for r in mine:
            ax.annotate(str(r["concurrency"]), (r["per_user_tokens_per_s"], r["aggregate_tokens_per_s"]),
                        textcoords="offset points", xytext=(3, 3), fontsize=6, color=line.get_color())
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="per-user tokens/s", ylabel="aggregate tokens/s", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="filled: Pareto front of the policy; labels: C", fontsize=8, title_fontsize=7)
    return _save(fig, path)


def plot_budget(rows: Sequence[dict], policies: Sequence[str], gamma: int, path: str, title: str) -> str:
    from dspark_jax.evaluation.plots import _new_figure, _save

    fig = _new_figure(7, 4.5)
    ax = fig.subplots()
    cs = sorted({r["concurrency"] for r in rows})
    for p in policies:
        mine = sorted((r for r in rows if r["policy"] == p), key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in mine], [r["verify_budget"] for r in mine], marker="o", label=p)
    ax.axhline(gamma, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.minorticks_off()
    ax.set(xlabel="concurrency (request slots)", ylabel="draft tokens verified per request per round",
           title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------
# the simulation report


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def hardware_lines(hw: dict) -> list[str]:
    if hw["kind"] == "roofline":
        a, t, d = hw["accelerator"], hw["target"], hw["drafter"]
        return [
            f"Hardware: **roofline** of {hw['chips']} x {a['name']} ({a['hbm_bytes_per_s'] / 1e12:.3g} TB/s HBM, "
            f"{a['peak_flops'] / 1e12:.0f} TFLOP/s dense bf16, {a['hbm_bytes'] / 1e9:.0f} GB; source: {a['source']}) "
            f"serving {t['name']} ({t['num_layers']} layers, d {t['hidden_size']}, MLP {t['intermediate_size']}, "
            f"{t['num_heads']}/{t['num_kv_heads']} heads x {t['head_dim']}, vocab {t['vocab_size']}; "
            f"{hw['target_matmul_params'] / 1e9:.2f}B matmul parameters; source: {t['source']}) in "
            f"{8 * hw['weight_bytes']}-bit weights and KV cache ({hw['target_kv_bytes_per_token'] / 1024:.0f} KiB of "
            f"KV per token), a DSpark drafter of {d['num_layers']} target-shaped layers, Markov rank "
            f"{d['markov_rank']}, {d['taps']} taps ({hw['drafter_own_params'] / 1e9:.2f}B own parameters, shares the "
            f"target's embedding and LM head), mean context {hw['kv_len']} tokens per request, token buckets "
            f"`{hw['buckets']}`.",
            "",
            f"Per pass: time = max(bytes / ({hw['bandwidth_efficiency']:g} x bandwidth), FLOPs / "
            f"({hw['flops_efficiency']:g} x peak)) + overhead ({1e3 * hw['verify_overhead_s']:g} ms per verify pass, "
            f"{1e3 * hw['draft_overhead_s']:g} ms per draft pass: assumptions, not measurements). Verify bytes = "
            "matmul weights + every request's KV cache + new K/V; verify FLOPs = 2 x tokens x matmul parameters + "
            "4 x tokens x layers x heads x head_dim x context. The draft pass (C x gamma block tokens through the "
            "drafter's layers, the LM head and the Markov head; context update for C x (gamma + 1) tokens) is paid "
            "every round. The dspark schedulers plan with SPS(b) = 1 / round time at every bucket b (a perfectly "
            "profiled table).",
        ]
    if hw["kind"] == "sps-table":
        lines = ["Hardware: **measured SPS tables** (round time = 1 / SPS of the padded bucket; the table `decode` "
                 "profiles times the drafter pass + the verify pass):", ""]
        for c, t in hw["tables"].items():
            lines.append(f"* C = {c}: `{t['path']}` ({t['device']}, {t['model']}, profiled {t['created']})")
        return lines
    lines = [f"Hardware: **round times measured by bench_serving** (`{hw['source']}`): steady seconds per round "
             "of the cells whose verify size is known, linear in the padded verify tokens between them:", ""]
    for c, pts in hw["points"].items():
        lines.append(f"* C = {c}: " + ", ".join(f"{p['tokens']:.0f} tokens {1e3 * p['round_s']:.1f} ms ({p['cell']})"
                                                for p in pts))
    return lines


def stats_lines(src: dict, pool_rounds: int, requests: int, full_tau: float) -> list[str]:
    kind = src.get("kind", "")
    if kind == "records":
        return [f"Drafter statistics: **{pool_rounds} recorded rounds** of {requests} requests (`{src.get('path')}`: "
                f"drafter `{src.get('drafter')}` on {src.get('target')}, T = {src.get('temperature')}, "
                f"{src.get('max_new_tokens')} new tokens, full-length verification, tau {full_tau:.2f}), replayed "
                "(a slot inside a recorded round drafts its remainder; refilled at the end of a request)."]
    if kind == "eval:reliability":
        return [f"Drafter statistics: **synthetic rounds from eval.json** (`{src.get('path')}`, drafter "
                f"`{src.get('drafter')}`, group {src.get('group')}, {src.get('eval_rounds')} eval rounds, tau "
                f"{src.get('eval_tau'):.2f}): accepted length from the histogram, survival from the {src.get('reliability')} "
                f"reliability diagrams with a comonotone copula (docs/decoding.md, Serving simulator); {pool_rounds} "
                f"rounds drawn i.i.d., tau {full_tau:.2f}."]
    if kind == "what-if:rates":
        rates = ", ".join(f"{r:g}" for r in src.get("rates", []))
        return [f"Drafter statistics: **what-if, not measured**: conditional acceptance rates {rates} per position, "
                f"Beta confidences with concentration kappa = {src.get('kappa')} (calibrated by construction); "
                f"{pool_rounds} synthetic rounds drawn i.i.d., tau {full_tau:.2f}."]
    return [f"Drafter statistics: **synthetic rounds from eval.json's conditional acceptance rates** (`{src.get('path')}`, "
            f"drafter `{src.get('drafter')}`, group {src.get('group')}), Beta confidences with concentration kappa = "
            f"{src.get('kappa')}; {pool_rounds} rounds drawn i.i.d., tau {full_tau:.2f}."]


def simulation_markdown(m: dict, result: dict, pngs: Sequence[str]) -> str:
    rows, policies = result["rows"], result["settings"]["policies"]
    s = result["settings"]
    roofline = result["hardware"]["kind"] == "roofline"
    md = [header(m).rstrip("\n"), ""]
    md += hardware_lines(result["hardware"]) + [""]
    md += stats_lines(result["stats"], result["pool"]["rounds"], result["pool"]["requests"], result["pool"]["full_tau"])
    md += ["", f"Simulation: gamma {s['gamma']}, threshold {s['threshold']}, {s['warmup']} warm-up rounds, then "
               f"~{s['slot_rounds']} slot-rounds per concurrency ({s['min_rounds']}-{s['max_rounds']} rounds), "
               + ("a slot refilled with a random recorded request when its request is done"
                  if s.get("sampling") == "replay" else
                  f"a slot refilled with a new request every {s['request_rounds']} rounds")
               + f", seed {s['seed']}. Every policy is the "
               "engine's scheduler function (`dspark_jax/engine/scheduler.py`). A simulation, not a measurement: "
               "read it for shapes and ratios, not absolute numbers.", ""]
    head = "| policy | C | aggregate tok/s | per-user tok/s | tau | verify budget | verify tokens / round | padded | round ms |"
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if roofline:
        head += " draft ms | HBM GB |"
        sep += "---:|---:|"
    md += [head, sep]
    for r in rows:
        line = (f"| {r['policy']} | {r['concurrency']} | {r['aggregate_tokens_per_s']:.1f} ± {r['aggregate_se']:.1f} | "
                f"{r['per_user_tokens_per_s']:.2f} | {r['tau']:.2f} | {r['verify_budget']:.2f} | "
                f"{r['verify_tokens_per_round']:.1f} | {r['padded_tokens_per_round']:.0f} | {r['round_ms']:.2f} |")
        if roofline:
            line += f" {r['draft_ms']:.2f} | {r['hbm_gb_needed']:.0f}{'' if r['fits_hbm'] else ' (does not fit)'} |"
        md.append(line)
    cs = sorted({r["concurrency"] for r in rows})
    md += ["", "Aggregate tokens/s by concurrency (± = standard error of the simulation's sampling):", "",
           "| C | " + " | ".join(policies) + " |", "|---:|" + "---:|" * len(policies)]
    for c in cs:
        got = {r["policy"]: r for r in rows if r["concurrency"] == c}
        best = max(got[p]["aggregate_tokens_per_s"] for p in policies)
        md.append(f"| {c} | " + " | ".join(
            (f"**{got[p]['aggregate_tokens_per_s']:.0f}**" if got[p]["aggregate_tokens_per_s"] == best
             else f"{got[p]['aggregate_tokens_per_s']:.0f}") for p in policies) + " |")
    if result.get("gains"):
        others = [p for p in policies if p != "mtp1"]
        md += ["", "Against MTP-1, Pareto front against Pareto front (the paper's comparison): each policy's aggregate "
               "throughput at MTP-1's per-user speed / its per-user speed at MTP-1's aggregate throughput, at the "
               "concurrencies on MTP-1's front (log-log interpolation between simulated concurrencies; - = outside "
               "the policy's front):",
               "", "| MTP-1 at C | per-user tok/s | aggregate tok/s | " + " | ".join(others) + " |",
               "|---:|---:|---:|" + "---:|" * len(others)]
        by = {(g["policy"], g["baseline_concurrency"]): g for g in result["gains"]}
        for c in cs:
            g0 = by.get((others[0], c)) if others else None
            if g0 is None:
                continue
            cells = [f"{_pct(by[(p, c)]['throughput_gain_at_matched_speed'])} / "
                     f"{_pct(by[(p, c)]['speed_gain_at_matched_throughput'])}" for p in others]
            md.append(f"| {c} | {g0['per_user_tokens_per_s']:.1f} | {g0['aggregate_tokens_per_s']:.0f} | "
                      + " | ".join(cells) + " |")
    md += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs], ""]
    return "\n".join(md)


def write_simulation(out: str, argv, result: dict) -> list[str]:
    md_path, json_path, pngs = out_paths(out, "_throughput", "_budget")
    m = meta(argv)
    result = dict(result, gains=gains_over(result["rows"]) if "mtp1" in result["settings"]["policies"] else [])
    policies = result["settings"]["policies"]
    label = result.get("label", "")
    plot_throughput(result["rows"], policies, pngs[0], f"Simulated throughput vs per-user speed{label}")
    plot_budget(result["rows"], policies, result["settings"]["gamma"], pngs[1],
                f"Simulated verify budget vs concurrency (dashed: gamma){label}")
    write_json(json_path, {**m, **result})
    write_text(md_path, simulation_markdown(m, result, pngs))
    return [md_path, json_path, *pngs]
