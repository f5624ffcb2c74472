"""PNG plots for calibration, acceptance, threshold sweeps and training logs (matplotlib, Agg).

Figures are built with `matplotlib.figure.Figure` on an Agg canvas, never through pyplot: nothing
touches the global backend or pyplot's figure registry, so nothing can leak or pop up a window,
and each figure is freed when the function returns. Every PNG is rendered in memory and written
atomically (`core.files`: local or gs://), so a reader never sees a half-written image.

    reliability_diagram(report_or_arrays, path, title=...) -> path
    acceptance_curves(curves, path, title=..., ylabel=...) -> path
    threshold_sweep_plot(sweep, path, title=...) -> path
    read_metrics(metrics_jsonl_path) -> list[dict]      (UserError for missing/empty/corrupt logs)
    training_curves(metrics_jsonl_path, out_dir) -> list[paths]
"""

from __future__ import annotations

import io
import math
import os
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dspark_jax.core import files
from dspark_jax.core.files import read_jsonl
from dspark_jax.core.errors import UserError
from dspark_jax.evaluation import calibration

DPI = 120
LOSS_KEYS = ("loss", "loss_ce", "loss_tv", "loss_conf")
LOSS_TITLES = {"loss": "total loss", "loss_ce": "cross-entropy term (L_ce)", "loss_tv": "total-variation term (L_tv)",
               "loss_conf": "confidence term (L_conf)"}
# (key, file stem, y label, title) of the single-metric training curves.
SCALAR_CURVES = (
    ("expected_tau", "expected_tau", "expected tau (tokens / round)", "Expected acceptance length (teacher forcing)"),
    ("grad_norm", "grad_norm", "global gradient norm", "Gradient norm"),
    ("blocks_per_s", "blocks_per_s", "blocks / s", "Training throughput"),
)
EVAL_PREFIXES = ("eval_", "heldout_")


# ------------------------------------------------------------------------------------------------
# helpers


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str) -> str:
    """Write fig as PNG to path atomically (`files.atomic_write_bytes`; a gs:// URL works too)."""
    path = os.fspath(path)
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=DPI)
        files.make_parent(path)
        files.atomic_write_bytes(path, png.getvalue())
    finally:
        fig.clear()
    return path


def _grid_shape(n: int, max_cols: int = 4) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


def _pct(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.1f}%"


# ------------------------------------------------------------------------------------------------
# calibration


def reliability_diagram(report_or_arrays, path: str, title: str = "Reliability of prefix survival a_k",
                        min_count: int = 20) -> str:
    """One panel per draft position: observed vs predicted a_k, raw and after STS, and the diagonal.

    `report_or_arrays` is a calibration_report() dict, or (confidence_logits, accepted) /
    (confidence_logits, accepted, temperatures) from which that report is computed (temperatures
    fitted in-sample when absent). The legend of each panel gives the ECE of both curves. Bins with
    fewer than `min_count` rounds are drawn as hollow markers off the line (their observed rate is
    noise); gray bars show how the rounds spread over the bins (after STS), tallest bar = 0.25.
    """
    if isinstance(report_or_arrays, Mapping):
        report = report_or_arrays
    elif isinstance(report_or_arrays, (tuple, list)) and len(report_or_arrays) in (2, 3):
        report = calibration.calibration_report(*report_or_arrays)
    else:
        raise TypeError("reliability_diagram expects a calibration_report dict or "
                        "(confidence_logits, accepted[, temperatures])")
    gamma = int(report["gamma"])
    temps = report.get("temperatures")
    has_sts = "reliability_sts" in report
    rows, cols = _grid_shape(gamma)
    fig = _new_figure(3.3 * cols, 3.3 * rows + 0.5)
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    for k in range(gamma):
        ax = axes[k // cols][k % cols]
        hist_curve = report["reliability_sts" if has_sts else "reliability_raw"][k]
        counts = np.asarray(hist_curve["counts"], dtype=float)
        if counts.sum() > 0:
            edges = np.linspace(0, 1, counts.size + 1)
            ax.bar(edges[:-1], 0.25 * counts / counts.max(), width=np.diff(edges), align="edge", color="0.85",
                   edgecolor="0.7", lw=0.5, zorder=0,
                   label="rounds per bin" + (" (STS)" if has_sts else "") + ", relative")
        ax.plot([0, 1], [0, 1], ls="--", color="0.45", lw=1, label="perfect calibration")
        series = [("reliability_raw", "ece_raw", "raw", "tab:red", "o")]
        if has_sts:
            t_label = f"STS, T={temps[k]:.2f}" if temps is not None else "STS"
            series.append(("reliability_sts", "ece_sts", t_label, "tab:blue", "s"))
        for curve_key, ece_key, label, color, marker in series:
            curve = report[curve_key][k]
            x = np.asarray(curve["mean_predicted"], dtype=float)
            y = np.asarray(curve["observed"], dtype=float)
            n = np.asarray(curve["counts"])
            dense, sparse = n >= min_count, (n > 0) & (n < min_count)
            ax.plot(x[dense], y[dense], marker=marker, ms=4, lw=1.5, color=color,
                    label=f"{label} (ECE {_pct(report[ece_key][k])})")
            ax.plot(x[sparse], y[sparse], ls="none", marker=marker, ms=4, mfc="none", color=color, alpha=0.7)
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_aspect("equal")
        ax.grid(alpha=0.3)
        ax.set_title(f"position k={k + 1}", fontsize=10)
        ax.legend(loc="upper left", fontsize=7, framealpha=0.85)
        if k % cols == 0:
            ax.set_ylabel("observed P(first k accepted)")
        if k + cols >= gamma:  # nothing below this panel
            ax.set_xlabel("predicted a_k")
            ax.tick_params(labelbottom=True)
    for k in range(gamma, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    sub = f"{report.get('num_rounds', '?')} rounds, {report.get('bins', '?')} equal-width bins"
    if report.get("temperatures_source") == "fitted_in_sample":
        sub += ", STS fitted in-sample"
    sub += f"; hollow markers: bins with < {min_count} rounds"
    fig.suptitle(f"{title}\n{sub}", fontsize=12)
    return _save(fig, path)


def _line_chart(lines: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str, xlabel: str, ylabel: str,
                title: str) -> str:
    """One line with markers per name through its (x, y) points; x ticks at every x; y in [0, 1]
    when all values are probabilities."""
    fig = _new_figure(6.4, 4.2)
    ax = fig.add_subplot()
    for name, (x, y) in lines.items():
        ax.plot(x, y, marker="o", ms=5, lw=1.8, label=str(name))
    ax.set_xticks(sorted({int(v) for x, _ in lines.values() for v in x}))
    finite = np.concatenate([y[np.isfinite(y)] for _, y in lines.values()])
    if finite.size and finite.min() >= 0 and finite.max() <= 1:
        ax.set_ylim(0, 1.02)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def acceptance_curves(curves: Mapping[str, Sequence[float]], path: str,
                      title: str = "Position-wise conditional acceptance",
                      ylabel: str = "P(token k accepted | 1..k-1 accepted)") -> str:
    """One line per drafter: value at draft position k = 1..len(values)."""
    if not curves:
        raise ValueError("acceptance_curves needs at least one curve")
    lines = {}
    for name, values in curves.items():
        v = np.asarray(values, dtype=float).reshape(-1)
        lines[name] = (np.arange(1, v.size + 1), v)
    return _line_chart(lines, path, "draft position k", ylabel, title)


def tau_by_block_size(families: Mapping[str, Sequence[tuple[int, float]]], path: str,
                      title: str = "Held-out expected tau vs block size",
                      ylabel: str = "teacher-forced expected tau (bonus included)") -> str:
    """One line per drafter family through its (gamma, tau) points: the block-size sweep."""
    if not families:
        raise ValueError("tau_by_block_size needs at least one family")
    lines = {name: tuple(np.asarray(sorted(points), dtype=float).T) for name, points in families.items()}
    return _line_chart(lines, path, "block size gamma (draft tokens per round)", ylabel, title)


def threshold_sweep_plot(sweep: Mapping, path: str, title: str = "Static confidence-threshold sweep") -> str:
    """Left: tokens per step and verified draft tokens per step vs threshold. Right: acceptance rate."""
    h = np.asarray(sweep["thresholds"], dtype=float)
    order = np.argsort(h)
    h = h[order]
    get = lambda key: np.asarray(sweep[key], dtype=float)[order]  # noqa: E731
    fig = _new_figure(11, 4.2)
    left, right = fig.subplots(1, 2)
    left.plot(h, get("tokens_per_step"), marker="o", ms=4, lw=1.8, color="tab:blue",
              label="tokens per step (accepted + bonus)")
    left.plot(h, get("verified_per_step"), marker="s", ms=4, lw=1.8, color="tab:orange",
              label="verified draft tokens per step")
    if "full_tokens_per_step" in sweep:
        left.axhline(sweep["full_tokens_per_step"], ls="--", color="tab:blue", alpha=0.5, lw=1,
                     label=f"full-length tau ({sweep['full_tokens_per_step']:.2f})")
    left.set_xlabel("threshold h on a_k")
    left.set_ylabel("tokens per round")
    left.set_title("Tokens per step and verify budget")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(h, 100 * get("acceptance_rate"), marker="o", ms=4, lw=1.8, color="tab:green")
    right.set_xlabel("threshold h on a_k")
    right.set_ylabel("acceptance rate of verified drafts (%)")
    right.set_ylim(0, 102)
    right.set_title("Acceptance rate")
    right.grid(alpha=0.3)
    gamma = sweep.get("gamma")
    fig.suptitle(title + (f" (gamma={gamma}, {sweep.get('num_rounds')} rounds)" if gamma else ""), fontsize=12)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------------
# training logs


def read_metrics(metrics_jsonl_path: str) -> list[dict]:
    """The records of a trainer metrics.jsonl, in file order.

    Raises UserError (one line) for a missing, unreadable, empty or corrupt file. A final line
    without a newline that does not parse is a record still being written by a live run: skipped.
    """
    path = os.fspath(metrics_jsonl_path)
    records = []
    for number, row in read_jsonl(path, "metrics log", allow_partial_last=True):
        step = row.get("step") if isinstance(row, dict) else None
        if not _is_number(step):
            raise UserError(f'{path}:{number}: expected a JSON object with a numeric "step"')
        records.append(row)
    if not records:
        raise UserError(f"metrics log {path} is empty: no steps logged yet")
    return records


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in records if _is_number(r.get(key))]
    if not pts:
        return np.array([]), np.array([])
    s, v = np.asarray(pts, dtype=float).T
    return s, v


def _plot_with_eval(ax, records, key: str, color: str = "tab:blue") -> bool:
    """Plot key (and eval_key / heldout_key when logged) vs step; True if anything was drawn."""
    drawn = False
    s, v = _series(records, key)
    if s.size:
        ax.plot(s, v, lw=1.6, color=color, marker="o" if s.size <= 30 else None, ms=3, label="train")
        drawn = True
    for prefix, c in zip(EVAL_PREFIXES, ("tab:orange", "tab:green")):
        s, v = _series(records, prefix + key)
        if s.size:
            ax.plot(s, v, lw=1.6, color=c, marker="o", ms=4, label=prefix.rstrip("_"))
            drawn = True
    if drawn and sum(1 for line in ax.get_lines()) > 1:
        ax.legend(fontsize=8)
    return drawn


def _per_position_values(record: dict, key: str):
    v = record.get(key)
    if isinstance(v, list) and v and all(_is_number(x) for x in v):
        return np.asarray(v, dtype=float)
    return None


def final_per_position(records: Sequence[dict], key: str):
    """(values, logged key, step) of the last record holding the held-out eval_<key>, else the
    training <key>; None if neither was logged."""
    for k in ("eval_" + key, key):
        for r in reversed(records):
            v = _per_position_values(r, k)
            if v is not None:
                return v, k, int(r["step"])
    return None


def training_curves(metrics_jsonl_path: str, out_dir: str) -> list[str]:
    """PNG curves of a training run's metrics.jsonl in out_dir; returns the paths written.

    loss.png (one panel per logged term of loss / loss_ce / loss_tv / loss_conf), expected_tau.png,
    grad_norm.png, blocks_per_s.png (each only when logged; eval_/heldout_ variants of a metric are
    drawn on the same axes) and per_position.png: accuracy and acceptance per draft position from
    the last record that has them.
    """
    records = read_metrics(metrics_jsonl_path)
    last_step = int(max(r["step"] for r in records))
    paths = []

    losses = [k for k in LOSS_KEYS if any(_is_number(r.get(p + k)) for r in records for p in ("",) + EVAL_PREFIXES)]
    if losses:
        rows, cols = _grid_shape(len(losses), max_cols=2)
        fig = _new_figure(5.2 * cols, 3.4 * rows + 0.3)
        axes = fig.subplots(rows, cols, squeeze=False)
        for i, key in enumerate(losses):
            ax = axes[i // cols][i % cols]
            _plot_with_eval(ax, records, key)
            ax.set_title(LOSS_TITLES[key], fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        for i in range(len(losses), rows * cols):
            axes[i // cols][i % cols].set_visible(False)
        fig.suptitle(f"Training losses (last step {last_step})", fontsize=12)
        paths.append(_save(fig, os.path.join(out_dir, "loss.png")))

    for key, stem, ylabel, title in SCALAR_CURVES:
        fig = _new_figure(6.4, 4.0)
        ax = fig.add_subplot()
        if not _plot_with_eval(ax, records, key):
            fig.clear()
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        paths.append(_save(fig, os.path.join(out_dir, f"{stem}.png")))

    per_pos = {}
    for label, key in (("top-1 accuracy", "accuracy_per_position"),
                       ("acceptance alpha_k = 1 - TV", "acceptance_per_position")):
        for r in reversed(records):
            v = _per_position_values(r, key)
            if v is not None:
                per_pos[label] = (v, int(r["step"]))
                break
    if per_pos:
        fig = _new_figure(6.4, 4.2)
        ax = fig.add_subplot()
        gamma = max(v.size for v, _ in per_pos.values())
        width = 0.8 / len(per_pos)
        for i, (label, (v, step)) in enumerate(per_pos.items()):
            x = np.arange(1, v.size + 1) + (i - (len(per_pos) - 1) / 2) * width
            ax.bar(x, v, width=width, label=f"{label} (step {step})")
        ax.set_xticks(np.arange(1, gamma + 1))
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("rate (teacher forcing)")
        ax.set_title("Per-position accuracy and acceptance (latest)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper right")
        paths.append(_save(fig, os.path.join(out_dir, "per_position.png")))
    return paths
