"""Confidence calibration (ECE, ROC-AUC, STS), threshold sweeps, plots and the plot_metrics CLI."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from dspark_jax import plot_metrics
from dspark_jax.evaluation import (
    calibration_report,
    conditional_acceptance,
    expected_calibration_error,
    fit_sts,
    prefix_survival,
    reliability_curve,
    roc_auc,
    survival_events,
    threshold_sweep,
    to_jsonable,
)
from dspark_jax.evaluation import plots
from cli_helpers import assert_one_line_error, run_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def logit(p):
    p = np.asarray(p, dtype=np.float64)
    return np.log(p) - np.log1p(-p)


def simulate_rounds(n, gamma, seed, scale=3.0, noise=0.5):
    """Full-length-verification rounds of an OVER-CONFIDENT head.

    Round n, position k: true conditional acceptance probability sigmoid(u[n, k]); tokens are
    accepted in order until the first rejection; the head reports logits scale * u + noise.
    """
    rng = np.random.default_rng(seed)
    u = np.linspace(1.5, 0.3, gamma)[None, :] + rng.normal(size=(n, gamma))
    survives = rng.random((n, gamma)) < 1.0 / (1.0 + np.exp(-u))
    accepted = np.cumprod(survives, axis=1).sum(axis=1)
    z = scale * u + rng.normal(scale=noise, size=(n, gamma))
    return z, accepted


def assert_png(path):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_SIGNATURE and os.path.getsize(path) > 1000, path
    leftovers = [name for name in os.listdir(os.path.dirname(path)) if name.startswith(".tmp-")]
    assert not leftovers, leftovers


# ------------------------------------------------------------------------------------------------
# survival, events, conditional acceptance


def test_prefix_survival_small():
    z = np.array([[0.0, 0.0], [math.log(3.0), -math.log(3.0)]])
    np.testing.assert_allclose(prefix_survival(z), [[0.5, 0.25], [0.75, 0.1875]], rtol=1e-12)
    # temperatures divide the logits position by position
    z = np.array([[0.0, 2 * math.log(3.0)]])
    np.testing.assert_allclose(prefix_survival(z, [1.0, 2.0]), [[0.5, 0.375]], rtol=1e-12)
    # huge logits: no overflow warnings, saturates cleanly, stays non-increasing
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        a = prefix_survival(np.array([[-1000.0, 1000.0, 5.0]]))
    assert a[0, 0] == 0.0 and np.all(np.diff(a, axis=1) <= 0)
    with pytest.raises(ValueError, match="temperatures"):
        prefix_survival(z, [1.0, 0.0])
    with pytest.raises(ValueError, match="2 temperatures"):
        prefix_survival(z, [1.0])


def test_survival_events_small():
    ev = survival_events([0, 2, 3], 3)
    assert ev.dtype == bool
    np.testing.assert_array_equal(ev, [[0, 0, 0], [1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="0..3"):
        survival_events([4], 3)
    with pytest.raises(ValueError, match="0..3"):
        survival_events([-1], 3)


def test_conditional_acceptance_constructed():
    rates, counts = conditional_acceptance([0, 1, 1, 2, 3, 3], 3)
    np.testing.assert_allclose(rates, [5 / 6, 3 / 5, 2 / 3])
    np.testing.assert_array_equal(counts, [6, 5, 3])
    rates, counts = conditional_acceptance([0, 0], 2)  # nobody reaches position 2
    assert rates[0] == 0.0 and math.isnan(rates[1]) and counts.tolist() == [2, 0]
    report = calibration_report(np.zeros((6, 3)), [0, 1, 1, 2, 3, 3], temperatures=[1, 1, 1])
    np.testing.assert_allclose(report["conditional_acceptance"], [5 / 6, 3 / 5, 2 / 3])
    assert report["conditional_count"] == [6, 5, 3] and report["event_count"] == [5, 3, 2]


# ------------------------------------------------------------------------------------------------
# ECE, reliability, ROC-AUC


def test_ece_perfect_calibration_is_zero():
    probs = [0.25] * 4 + [0.75] * 4 + [0.95] * 20
    events = [1, 0, 0, 0] + [1, 1, 1, 0] + [1] * 19 + [0]
    assert expected_calibration_error(probs, events) == pytest.approx(0.0, abs=1e-12)


def test_ece_hand_computed():
    # bin [0.9, 1]: mean 0.9 vs observed 0.5, weight 1/2; bin [0.1, 0.2): 0.1 vs 0, weight 1/2
    assert expected_calibration_error([0.9, 0.9, 0.1, 0.1], [1, 0, 0, 0]) == pytest.approx(0.25)
    # one bin: |mean p - mean y|
    assert expected_calibration_error([0.2, 0.6], [1, 1], bins=1) == pytest.approx(0.6)
    # 1.0 falls in the last bin together with 0.95
    assert expected_calibration_error([1.0, 0.95], [1, 1]) == pytest.approx(0.025)
    # bins weighted by their counts: 3 rounds at 0.5 (all accepted), 1 at 0.05 (rejected)
    assert expected_calibration_error([0.5, 0.5, 0.5, 0.05], [1, 1, 1, 0]) == pytest.approx(0.75 * 0.5 + 0.25 * 0.05)
    assert math.isnan(expected_calibration_error([], []))
    with pytest.raises(ValueError, match="probabilities"):
        expected_calibration_error([1.2], [1])


def test_reliability_curve_bins():
    curve = reliability_curve([0.05, 0.15, 0.15, 0.95, 1.0], [0, 1, 0, 1, 1], bins=10)
    mean_p, observed, counts = curve
    assert counts.tolist() == [1, 2, 0, 0, 0, 0, 0, 0, 0, 2]
    np.testing.assert_allclose(mean_p[[0, 1, 9]], [0.05, 0.15, 0.975])
    np.testing.assert_allclose(observed[[0, 1, 9]], [0.0, 0.5, 1.0])
    assert np.all(np.isnan(observed[2:9])) and np.all(np.isnan(mean_p[2:9]))
    # ECE is the count-weighted gap of the same bins
    probs, events = np.random.default_rng(0).random(500), np.random.default_rng(1).random(500) < 0.4
    c = reliability_curve(probs, events, bins=7)
    ok = c.counts > 0
    gap = np.sum(c.counts[ok] * np.abs(c.mean_predicted[ok] - c.observed[ok])) / 500
    assert expected_calibration_error(probs, events, bins=7) == pytest.approx(gap)


def test_roc_auc_known_values():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert roc_auc([0.5, 0.5], [0, 1]) == 0.5  # a tie counts one half
    # pos {2, 3} vs neg {1, 2}: 1 + 0.5 + 1 + 1 of 4 pairs
    assert roc_auc([1, 2, 2, 3], [0, 1, 0, 1]) == pytest.approx(0.875)
    assert roc_auc([3, 3, 3], [0, 1, 1]) == 0.5
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1])) and math.isnan(roc_auc([0.1, 0.2], [0, 0]))


def pairwise_auc(scores, labels):
    """ROC-AUC by counting (positive, negative) pairs, ties one half (the reference for roc_auc)."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
    diff = scores[labels][:, None] - scores[~labels][None, :]
    return (np.sum(diff > 0) + 0.5 * np.sum(diff == 0)) / diff.size


def test_roc_auc_matches_pairwise_count_with_many_ties():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, size=300).astype(float)
    labels = rng.random(300) < 0.3 + 0.1 * scores
    assert roc_auc(scores, labels) == pytest.approx(pairwise_auc(scores, labels), abs=1e-12)


# ------------------------------------------------------------------------------------------------
# STS


def test_sts_fixes_an_overconfident_head():
    gamma = 5
    z_fit, acc_fit = simulate_rounds(8000, gamma, seed=0)
    z_test, acc_test = simulate_rounds(8000, gamma, seed=1)
    temps = fit_sts(z_fit, acc_fit)
    assert temps.shape == (gamma,) and np.all((temps > 2.0) & (temps < 4.5)), temps  # undoes the x3
    report = calibration_report(z_test, acc_test, temperatures=temps)  # held-out evaluation
    before, after = np.array(report["ece_raw"]), np.array(report["ece_sts"])
    assert before.mean() > 0.08, before
    assert after.mean() < before.mean() / 2 and after.mean() < 0.03, (before, after)
    assert np.all(after < before) and after.max() < 0.04, (before, after)
    assert report["temperatures_source"] == "given" and report["temperatures"] == temps.tolist()
    # calibration in the large: mean predicted a_k close to the observed survival rate after STS
    np.testing.assert_allclose(report["mean_survival_sts"], report["event_rate"], atol=0.03)


def test_sts_is_order_preserving():
    rng = np.random.default_rng(7)
    z = rng.normal(scale=2.0, size=400)
    labels = rng.random(400) < 1 / (1 + np.exp(-z))
    base = roc_auc(z, labels)
    for t in (0.5, 1.0, 3.0, 20.0):
        c = 1 / (1 + np.exp(-z / t))
        assert roc_auc(c, labels) == pytest.approx(base, abs=1e-12)
        np.testing.assert_array_equal(np.argsort(c, kind="stable"), np.argsort(z, kind="stable"))
    # in a report, against AUCs counted pair by pair in numpy: a_k raw and after STS, and c_k among
    # the rounds that reached k; a_1 = c_1 keeps its AUC under any temperature, and so does c_k
    z2, acc2 = simulate_rounds(2000, 3, seed=4)
    temps = np.array([3.0, 0.7, 5.0])
    r = calibration_report(z2, acc2, temperatures=temps)
    sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    for k in range(3):
        event = acc2 >= k + 1
        raw, sts = np.prod(sigmoid(z2[:, :k + 1]), 1), np.prod(sigmoid(z2[:, :k + 1] / temps[:k + 1]), 1)
        assert r["auc_raw"][k] == pytest.approx(pairwise_auc(raw, event), abs=1e-12)
        assert r["auc_sts"][k] == pytest.approx(pairwise_auc(sts, event), abs=1e-12)
        reached = acc2 >= k
        conditional = pairwise_auc(z2[reached, k], event[reached])
        assert r["auc_conditional"][k] == pytest.approx(conditional, abs=1e-12)
        assert pairwise_auc(sigmoid(z2[reached, k] / temps[k]), event[reached]) == pytest.approx(conditional, abs=1e-12)
    assert r["auc_sts"][0] == pytest.approx(r["auc_raw"][0], abs=1e-12)
    assert abs(r["auc_sts"][2] - r["auc_raw"][2]) > 1e-4  # a product of several factors can reorder


def test_earlier_temperatures_can_change_the_auc_of_a_k():
    # A: c = (.5, .73) -> a_2 = .37, only token 1 accepted; B: c = (.73, .43) -> a_2 = .31, both
    # accepted. Sharpening position 1 (T_1 = 0.2) makes c_1(B) ~ 1 and lifts B above A.
    z = np.array([[0.0, 1.0], [1.0, -0.3], [-3.0, -3.0]])
    accepted = np.array([1, 2, 0])
    r = calibration_report(z, accepted, temperatures=[0.2, 1.0])
    assert r["auc_raw"][0] == r["auc_sts"][0] == 1.0
    assert r["auc_raw"][1] == 0.5 and r["auc_sts"][1] == 1.0


def test_fit_sts_on_calibrated_head_stays_near_one_and_handles_inputs():
    z, acc = simulate_rounds(6000, 3, seed=5, scale=1.0, noise=0.0)  # already calibrated
    temps = fit_sts(z, acc)
    assert np.all(np.abs(np.log(temps)) < np.log(1.35)), temps
    custom = fit_sts(z, acc, grid=[0.5, 1.0, 2.0], refine=False)
    assert set(custom.tolist()) <= {0.5, 1.0, 2.0} and custom[0] == 1.0
    with pytest.raises(ValueError, match="rounds"):
        fit_sts(z, acc[:-1])
    with pytest.raises(ValueError, match="grid"):
        fit_sts(z, acc, grid=[0.0, 1.0])


def test_calibration_report_fits_in_sample_and_is_jsonable():
    z, acc = simulate_rounds(1500, 3, seed=2)
    r = calibration_report(z, acc, bins=8)
    assert r["temperatures_source"] == "fitted_in_sample" and r["num_rounds"] == 1500 and r["gamma"] == 3
    for key in ("ece_raw", "ece_sts", "auc_raw", "auc_sts", "auc_conditional", "conditional_acceptance",
                "event_rate", "mean_survival_raw", "mean_survival_sts", "reliability_raw", "reliability_sts"):
        assert len(r[key]) == 3, key
    assert len(r["reliability_sts"][0]["counts"]) == 8 and sum(r["reliability_sts"][0]["counts"]) == 1500
    assert r["tau_full"] == pytest.approx(acc.mean() + 1)
    text = json.dumps(to_jsonable(r), allow_nan=False)  # empty bins (NaN) become null
    assert json.loads(text)["gamma"] == 3


# ------------------------------------------------------------------------------------------------
# threshold sweep


def test_threshold_sweep_exact_tiny_example():
    # round 1: c = (.9, .8, .5) -> a = (.9, .72, .36), accepted 2; round 2: c = .5 -> a = (.5, .25, .125), accepted 3
    z = logit([[0.9, 0.8, 0.5], [0.5, 0.5, 0.5]])
    s = threshold_sweep(z, [2, 3], [0.0, 0.3, 0.6, 0.95])
    # verified l: h=0 -> (3, 3); .3 -> (3, 1); .6 -> (2, 0); .95 -> (0, 0); accepted = min(acc, l)
    np.testing.assert_allclose(s["verified_per_step"], [3.0, 2.0, 1.0, 0.0])
    np.testing.assert_allclose(s["tokens_per_step"], [3.5, 2.5, 2.0, 1.0])
    np.testing.assert_allclose(s["acceptance_rate"][:3], [5 / 6, 3 / 4, 1.0])
    assert math.isnan(s["acceptance_rate"][3])
    np.testing.assert_allclose(s["tokens_per_verified"], [3.5 / 4, 2.5 / 3, 1.0, 1.0])
    assert s["full_tokens_per_step"] == 3.5 and s["full_acceptance_rate"] == pytest.approx(5 / 6)
    # temperatures apply: T = 1e-3 on position 1 makes c_1 = 1 for round 1 and keeps 0.5 for round 2
    s = threshold_sweep(z, [2, 3], [0.85], temperatures=[1e-3, 1.0, 1.0])
    assert s["verified_per_step"] == [0.5]  # round 1 verifies 1 token (a_2 = .8 < .85), round 2 none


def test_threshold_sweep_monotonic_trends():
    z, acc = simulate_rounds(6000, 5, seed=6)
    temps = fit_sts(z, acc)
    s = threshold_sweep(z, acc, np.linspace(0.0, 0.8, 9), temperatures=temps)
    verified, tokens, rate = (np.array(s[k]) for k in ("verified_per_step", "tokens_per_step", "acceptance_rate"))
    assert verified[0] == 5.0 and tokens[0] == pytest.approx(acc.mean() + 1)  # h = 0 is full length
    assert np.all(np.diff(verified) < 0) and np.all(np.diff(tokens) <= 0)
    assert np.all(np.diff(rate) > 0), rate
    assert rate[0] < 0.5 < 0.85 < rate[-1], rate  # wide span, like the paper's 45.7% -> 95.7%


# ------------------------------------------------------------------------------------------------
# plots


def test_plots_write_png_files(tmp_path):
    z, acc = simulate_rounds(3000, 5, seed=8)
    temps = fit_sts(z, acc)
    report = calibration_report(z, acc, temperatures=temps)
    assert_png(plots.reliability_diagram(report, str(tmp_path / "rel" / "reliability.png"), "test drafter"))
    assert_png(plots.reliability_diagram((z[:, :2], acc.clip(0, 2)), str(tmp_path / "rel2.png"), "from arrays"))
    curves = {"DSpark": report["conditional_acceptance"], "DFlash": [0.8, 0.7, 0.6, 0.55, float("nan")]}
    assert_png(plots.acceptance_curves(curves, str(tmp_path / "acc.png"), "Conditional acceptance", "rate"))
    sweep = threshold_sweep(z, acc, np.linspace(0, 0.95, 20), temperatures=temps)
    path = plots.threshold_sweep_plot(sweep, str(tmp_path / "sweep.png"))
    assert_png(path)
    plots.threshold_sweep_plot(sweep, path)  # overwriting in place works
    assert_png(path)


def write_metrics(path, steps=20, gamma=4, conf=True, extra=""):
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i, step in enumerate(range(10, 10 * steps + 1, 10)):
            loss_ce, loss_tv = 3.0 / (1 + 0.1 * i), 1.2 / (1 + 0.05 * i)
            rec = {"step": step, "loss_ce": loss_ce, "loss_tv": loss_tv, "loss": 0.1 * loss_ce + 0.9 * loss_tv,
                   "accuracy_per_position": np.linspace(0.7, 0.3, gamma).tolist(),
                   "acceptance_per_position": np.linspace(0.8, 0.4, gamma).tolist(),
                   "expected_tau": 1.5 + 0.05 * i, "grad_norm": float(1 + rng.random()),
                   "blocks_per_s": float(10 + rng.random()), "rows": 8}
            if conf:
                rec["loss_conf"] = 0.7 / (1 + 0.02 * i)
            f.write(json.dumps(rec) + "\n")
        f.write(extra)


def test_training_curves(tmp_path):
    log = tmp_path / "metrics.jsonl"
    write_metrics(log, extra='{"step": 200, "eval_expected_tau": 2.1, "eval_loss": 1.0}\n')
    paths = plots.training_curves(str(log), str(tmp_path / "out"))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["blocks_per_s.png", "expected_tau.png", "grad_norm.png", "loss.png", "per_position.png"]
    for p in paths:
        assert_png(p)
    # a DFlash-style log without loss_conf / grad_norm still plots what it has
    write_metrics(log, conf=False)
    assert len(plots.training_curves(str(log), str(tmp_path / "out2"))) == 5


# ------------------------------------------------------------------------------------------------
# CLI


def run_cli(capsys, *argv):
    return run_main(plot_metrics.main, capsys, *argv)


def assert_fails(capsys, message, *argv):
    assert_one_line_error(plot_metrics.main, capsys, message, *argv)


def test_cli_writes_plots(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_metrics(run / "metrics.jsonl", steps=6)
    code, out, err = run_cli(capsys, str(run))
    assert code == 0, err
    paths = out.strip().splitlines()
    assert len(paths) == 5 and all(os.path.dirname(p) == str(run / "plots") for p in paths)
    for p in paths:
        assert_png(p)
    code, out, _ = run_cli(capsys, str(run / "metrics.jsonl"), "--out", str(tmp_path / "elsewhere"))
    assert code == 0 and all(p.startswith(str(tmp_path / "elsewhere")) for p in out.split())


def test_cli_compares_runs(capsys, tmp_path):
    """Several runs: per-run curves in DIR/<name>/, the last held-out per-position acceptance of
    each as one PNG and a Markdown table (eval_ preferred over the training value)."""
    a, b = tmp_path / "dspark", tmp_path / "dflash"
    a.mkdir()
    b.mkdir()
    write_metrics(a / "metrics.jsonl", steps=3, extra=json.dumps(
        {"step": 40, "eval_acceptance_per_position": [0.9, 0.8, 0.7, 0.6]}) + "\n")
    write_metrics(b / "metrics.jsonl", steps=3)
    code, out, err = run_cli(capsys, str(a), str(b), "--out", str(tmp_path / "cmp"))
    assert code == 0, err
    assert_png(str(tmp_path / "cmp" / "teacher_forced_acceptance.png"))
    assert (tmp_path / "cmp" / "dspark" / "loss.png").exists() and (tmp_path / "cmp" / "dflash" / "loss.png").exists()
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0] == "| run | k=1 | k=2 | k=3 | k=4 |"
    assert rows[1] == "| dspark (eval_acceptance_per_position, step 40) | 0.900 | 0.800 | 0.700 | 0.600 |"
    assert rows[2] == "| dflash (acceptance_per_position, step 30) | 0.800 | 0.667 | 0.533 | 0.400 |"
    assert_fails(capsys, "--out is required when comparing several runs", str(a), str(b))


def test_cli_block_size_sweep(capsys, tmp_path):
    """Runs of several block sizes: held-out expected tau against gamma, one line per drafter family
    (read from each run's drafter.json), as a PNG and a table."""
    for name, head, gamma, tau in (("dspark_g4", "markov", 4, 1.6), ("dspark_g8", "markov", 8, 1.9),
                                   ("dflash_g4", "none", 4, 1.5), ("dflash_g8", "none", 8, 1.6)):
        run = tmp_path / name
        (run / "drafter").mkdir(parents=True)
        (run / "drafter" / "drafter.json").write_text(json.dumps({"config": {"kind": "dspark", "head": head}}))
        write_metrics(run / "metrics.jsonl", steps=3, gamma=gamma, extra=json.dumps(
            {"step": 40, "eval_expected_tau": tau, "eval_acceptance_per_position": [0.5] * gamma}) + "\n")
    code, out, err = run_cli(capsys, *(str(tmp_path / n) for n in ("dspark_g4", "dspark_g8", "dflash_g4", "dflash_g8")),
                             "--out", str(tmp_path / "sweep"))
    assert code == 0, err
    assert_png(str(tmp_path / "sweep" / "expected_tau_by_block_size.png"))
    assert "| DSpark (markov) | 1.600 | 1.900 |" in out and "| DFlash | 1.500 | 1.600 |" in out, out
    assert "| drafter | gamma=4 | gamma=8 |" in out


def test_cli_skips_half_written_last_line(capsys, tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", steps=3, extra='{"step": 40, "loss": 1.')
    code, out, err = run_cli(capsys, str(tmp_path))
    assert code == 0, err


def test_cli_errors(capsys, tmp_path):
    assert_fails(capsys, "no such run folder", str(tmp_path / "nope"))
    assert_fails(capsys, "no metrics.jsonl in", str(tmp_path))
    log = tmp_path / "metrics.jsonl"
    log.write_text("")
    assert_fails(capsys, "is empty", str(tmp_path))
    log.write_text("\n\n")
    assert_fails(capsys, "is empty", str(tmp_path))
    log.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n{"step": 3, "loss": 1.0}\n')
    assert_fails(capsys, "metrics.jsonl:2: not valid JSON", str(tmp_path))
    log.write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n')
    assert_fails(capsys, 'metrics.jsonl:2: expected a JSON object with a numeric "step"', str(tmp_path))
    log.write_text('{"step": 1, "rows": "x"}\n')
    assert_fails(capsys, "no plottable metrics", str(tmp_path))
    write_metrics(log, steps=2)
    (tmp_path / "afile").write_text("x")
    assert_fails(capsys, "exists and is not a folder", str(tmp_path), "--out", str(tmp_path / "afile"))


def test_cli_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.plot_metrics", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: no such run folder: {tmp_path / 'missing'}"
