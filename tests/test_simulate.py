"""The serving simulator (python -m dspark_jax.simulate): real schedulers, hardware curves, outputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dspark_jax.engine import scheduler as S
from dspark_jax.engine.sps import SPSTable, save_sps_table
from dspark_jax.serving import hardware as H
from dspark_jax.serving import rounds as RD
from dspark_jax.serving import simulator as SIM
from dspark_jax.serving import validation as V

RATES = [0.8, 0.7, 0.6, 0.5]


def rates_pool(n=4000, seed=0, rates=RATES, kappa=1.0):
    return RD.rates_pool(rates, kappa, n, seed, {"kind": "test"})


def linear_curve(gamma, base=0.01, per_token=1e-4):
    """A roofline-free curve: round = base + per_token x padded tokens (token buckets as the engine's)."""

    class Linear(H.HardwareCurve):
        kind = "linear"

        def round_seconds(self, tokens, concurrency):
            return base + per_token * np.asarray(tokens, np.float64)

    return Linear(gamma)


TINY = H.TargetShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                     head_dim=4, vocab_size=32, tie_word_embeddings=True)
TOY_CHIP = H.Accelerator("toy", hbm_bytes_per_s=1000.0, peak_flops=10000.0, hbm_bytes=1e9, source="test")


def records(n_requests=3, rounds_per_request=6, gamma=4, seed=0, max_new_tokens=64):
    rng = np.random.default_rng(seed)
    n = n_requests * rounds_per_request
    return {"format": RD.FORMAT, "version": RD.VERSION, "gamma": gamma, "sts_temperatures": [1.0] * gamma,
            "drafter": "test", "target": "test", "temperature": 0.0, "max_new_tokens": max_new_tokens,
            "confidence_logits": rng.normal(0.5, 2.0, (n, gamma)).round(4).tolist(),
            "accepted": rng.integers(0, gamma + 1, n).tolist(),
            "request": np.repeat(np.arange(n_requests), rounds_per_request).tolist()}


# ------------------------------------------------------------------------------------------------
# the real scheduler


def test_iid_lengths_are_the_schedulers_own():
    pool = rates_pool()
    gamma, C = pool.gamma, 3
    curve = linear_curve(gamma)
    cfg = SIM.SimConfig(sampling="iid", rounds=6, warmup=0, threshold=0.3, seed=1)
    traces = SIM.run_concurrency(pool, curve, C, cfg)
    idx = SIM.draw_rounds(pool, C, 1, 6, cfg, np.random.default_rng([cfg.seed, C]))
    a = pool.survival[idx[0]]
    buckets, values = curve.sps_table(C).arrays()
    state = S.init_async_state(C)
    for t in range(6):
        want = {"fixed": S.schedule_fixed(np.ones(C, bool), gamma), "mtp1": S.schedule_mtp1(np.ones(C, bool), gamma),
                "threshold": S.schedule_threshold(a[t], 0.3), "dspark": S.schedule_dspark(a[t], None, buckets, values)}
        want["dspark-async"], state = S.schedule_dspark_async(state, a[t], None, buckets, values)
        for p, lengths in want.items():
            np.testing.assert_array_equal(traces[p].lengths[0, t], np.asarray(lengths), err_msg=f"{p} round {t}")


@pytest.mark.parametrize("sampling", ["iid", "replay"])
def test_a_mutated_scheduler_changes_the_simulation(monkeypatch, sampling):
    pool = RD.pool_from_records(records()) if sampling == "replay" else rates_pool()
    curve = linear_curve(pool.gamma)
    cfg = SIM.SimConfig(policies=("threshold", "dspark-async"), sampling=sampling, rounds=8, warmup=0)
    before = SIM.run_concurrency(pool, curve, 2, cfg)
    monkeypatch.setattr(S, "schedule_threshold", lambda a, h, active=None: np.zeros(a.shape[0], np.int32))
    monkeypatch.setattr(S, "admit_top_k", lambda a, active, K: np.full(a.shape[0], a.shape[1], np.int32))
    after = SIM.run_concurrency(pool, curve, 2, cfg)
    assert before["threshold"].lengths.any() and not after["threshold"].lengths.any()
    assert (after["dspark-async"].lengths == pool.gamma).all()
    assert not np.array_equal(before["dspark-async"].lengths, after["dspark-async"].lengths)


def test_deterministic_with_a_seed():
    pool = rates_pool()
    curve = linear_curve(pool.gamma)
    run = lambda seed: SIM.simulate(pool, curve, [1, 4], SIM.SimConfig(slot_rounds=256, seed=seed))  # noqa: E731
    assert run(3) == run(3)
    assert run(3) != run(4)


# ------------------------------------------------------------------------------------------------
# statistics


def test_fixed_and_mtp1_tau_match_the_acceptance_statistics():
    pool = rates_pool(n=20000, seed=2)
    cfg = SIM.SimConfig(policies=("fixed", "mtp1"), slot_rounds=8192, warmup=0, seed=5)
    rows = {r["policy"]: r for r in SIM.simulate(pool, linear_curve(pool.gamma), [8], cfg)}
    expect_fixed = 1 + np.sum(np.cumprod(RATES))  # 1 + sum_k prod_{i<=k} alpha_i
    sd = np.std(np.minimum(pool.accepted, 4) + 1) / np.sqrt(8192)
    assert abs(rows["fixed"]["tau"] - expect_fixed) < 4 * sd + 0.02
    assert abs(rows["mtp1"]["tau"] - (1 + RATES[0])) < 0.03
    # the pool itself: calibrated, and its conditional acceptance is the rates
    surv = pool.accepted[:, None] >= np.arange(1, 5)
    assert np.allclose(surv.mean(0), pool.survival.mean(0), atol=0.02)
    assert np.allclose(surv.mean(0), np.cumprod(RATES), atol=0.02)


def test_reliability_pool_keeps_the_histogram_and_calibration():
    ev = RD.load_eval("docs/results/shipped/eval_t0/eval.json")
    _, m = RD.eval_group(ev, None, "overall")
    pool = RD.pool_from_eval("docs/results/shipped/eval_t0/eval.json", n=20000, seed=0)
    hist = np.asarray(m["accepted_histogram"], float)
    assert np.allclose(np.bincount(pool.accepted, minlength=len(hist)) / len(pool.accepted), hist / hist.sum(),
                       atol=0.01)
    assert np.all(np.diff(pool.survival, axis=1) <= 1e-7)
    # per position: the same mean survival and event rate as eval measured (its miscalibration included)
    events = pool.accepted[:, None] >= np.arange(1, pool.gamma + 1)
    cal = m["calibration"]
    assert np.allclose(pool.survival.mean(0), cal["mean_survival_sts"], atol=0.01)
    assert np.allclose(events.mean(0), cal["event_rate"], atol=0.01)
    sweep = m["threshold_sweep"]
    got = RD.threshold_check(pool, sweep["thresholds"])
    assert np.allclose(got["tokens_per_step"], sweep["tokens_per_step"], atol=0.05)


def test_shifted_round():
    a = np.array([[0.8, 0.4, 0.2]], np.float32)
    A = np.array([2])
    same, A0 = SIM.shifted_round(np, a, A, np.array([0]))
    np.testing.assert_allclose(same, a, rtol=1e-6)
    assert A0[0] == 2
    shifted, A1 = SIM.shifted_round(np, a, A, np.array([1]))
    np.testing.assert_allclose(shifted[0], [0.5, 0.25, 0.125], rtol=1e-5)  # a2/a1, a3/a1, then x (a3/a2)
    assert A1[0] == 1


# ------------------------------------------------------------------------------------------------
# hardware


def test_roofline_against_a_hand_computation():
    roof = H.Roofline(TOY_CHIP, TINY, H.DrafterShape(num_layers=1, markov_rank=2, taps=2), gamma=3, kv_len=10,
                      verify_overhead_s=0.1, draft_overhead_s=0.2)
    assert TINY.matmul_params == 1408  # 2 x (192 attention + 384 MLP) + 256 LM head
    # 5 tokens: bytes 2816 weights + 3 x 10 x 32 KV + 5 x 32 new KV = 3936 -> 3.936 s; FLOPs 17280 -> 1.728 s
    np.testing.assert_allclose(roof.verify_pass(5, 3)["seconds"], 3.936 + 0.1)
    # 50 tokens: bytes 5376 -> 5.376 s; FLOPs 2 x 50 x 1408 + 4 x 50 x 2 x 2 x 4 x 10 = 172800 -> 17.28 s
    np.testing.assert_allclose(roof.verify_pass(50, 3)["seconds"], 17.28 + 0.1)
    # draft, C = 3: bytes (576 + 128 + 256) x 2 + 3 x 2 x 32 x 2 + 3 x 10 x 16 = 2784 -> 2.784 s; FLOPs 24480
    d = roof.draft_pass(3)
    assert d["bytes"] == 2784 and d["flops"] == 24480
    np.testing.assert_allclose(d["seconds"], 2.784 + 0.2)
    np.testing.assert_allclose(roof.round_seconds(5, 3), 4.036 + 2.984)
    # compute-bound crossover: 3936 + 32 (n - 5) bytes = n x 3456 / 10 FLOPs-seconds ... solved
    n = H.crossover_tokens(roof, 3)
    np.testing.assert_allclose((2816 + 960 + 32 * n) / 1000, n * (2 * 1408 + 4 * 2 * 2 * 4 * 10) / 10000)


def test_named_accelerators_and_targets():
    roof = H.roofline_by_name("h200", "qwen3-8b")
    assert roof.accelerator.hbm_bytes_per_s == 4.8e12 and roof.accelerator.peak_flops == 989e12
    assert H.ACCELERATORS["tpu-v5p"].peak_flops == 459e12 and H.ACCELERATORS["tpu-v6e"].hbm_bytes_per_s == 1.64e12
    t = roof.target
    assert 7.5e9 < t.matmul_params < 7.7e9 and t.kv_elements_per_token() * 2 == 147456
    # one pass at batch 1 is weight-bound: ~15.1 GB / 4.8 TB/s
    np.testing.assert_allclose(roof.verify_pass(1, 1)["seconds"] - roof.verify_overhead_s, 3.18e-3, rtol=0.02)
    assert not roof.fits(4096) and roof.fits(1)


def test_throughput_sanity():
    pool = rates_pool()
    curve = H.RooflineCurve(H.roofline_by_name("h200", "qwen3-8b", gamma=pool.gamma, kv_len=512))
    rows = SIM.simulate(pool, curve, [1, 8, 64, 256], SIM.SimConfig(policies=("fixed", "mtp1"), slot_rounds=512))
    for p in ("fixed", "mtp1"):
        mine = [r for r in rows if r["policy"] == p]
        agg = [r["aggregate_tokens_per_s"] for r in mine]
        per_user = [r["per_user_tokens_per_s"] for r in mine]
        assert agg == sorted(agg) and per_user == sorted(per_user, reverse=True)
        assert all(r["round_ms"] > 0 for r in mine)
    fast = H.RooflineCurve(H.roofline_by_name("h200", "qwen3-8b", gamma=pool.gamma, kv_len=512,
                                              bandwidth_efficiency=1.0, flops_efficiency=1.0, chips=2))
    more = SIM.simulate(pool, fast, [64], SIM.SimConfig(policies=("fixed",), slot_rounds=512))
    assert more[0]["aggregate_tokens_per_s"] > rows[4]["aggregate_tokens_per_s"]  # twice the chips is faster


def test_sps_table_mode_matches_roofline_mode(tmp_path):
    pool = rates_pool()
    roof = H.RooflineCurve(H.roofline_by_name("tpu-v5p", "qwen3-4b", gamma=pool.gamma))
    paths = []
    for c in (1, 4):
        path = str(tmp_path / f"sps_b{c}.json")
        save_sps_table(path, roof.sps_table(c))
        paths.append(path)
    tables = H.SPSTableCurve.from_files(paths, pool.gamma)
    assert tables.concurrencies == (1, 4)
    cfg = SIM.SimConfig(slot_rounds=256)
    a, b = SIM.simulate(pool, roof, [1, 4], cfg), SIM.simulate(pool, tables, [1, 4], cfg)
    for x, y in zip(a, b):
        assert x["tau"] == y["tau"] and x["verify_budget"] == y["verify_budget"]
        np.testing.assert_allclose(x["aggregate_tokens_per_s"], y["aggregate_tokens_per_s"], rtol=1e-5)
    with pytest.raises(Exception, match="no data for concurrency 2"):
        SIM.simulate(pool, tables, [2], cfg)


def test_bucket_specs():
    assert H.bucket_sizes(16) == (1, 2, 4, 8, 16)
    assert H.bucket_sizes(40, "step:16") == (1, 2, 4, 8, 16, 32, 40)
    assert H.bucket_sizes(5, "step:1") == (1, 2, 3, 4, 5)


# ------------------------------------------------------------------------------------------------
# validation against bench_serving


def fake_bench(pool_obj, gamma, concurrency, steady_rounds, round_s):
    """A bench_serving JSON whose fixed cells are what the records say (first rounds, equal weights)."""
    acc = np.asarray(pool_obj["accepted"])
    req = np.asarray(pool_obj["request"])
    rows = []
    for c in concurrency:
        tau = float(np.mean([np.mean(acc[req == i][:steady_rounds] + 1) for i in range(c)]))
        for s, secs in (("fixed", round_s[1]), ("mtp1", round_s[0]), ("dspark-async", round_s[0])):
            rows.append({"scheduler": s, "concurrency": c, "aggregate_tokens_per_s": tau * c / secs if s == "fixed"
                         else 1.5 * c / secs, "tau": tau if s == "fixed" else 1.5, "verify_budget": 7.0 if s == "fixed"
                         else 1.0, "verify_tokens_per_round": c * (gamma + 1.0) if s == "fixed" else 2.0 * c,
                         "steady_rounds": steady_rounds, "steady_s": secs * steady_rounds})
    return {"command": "test", "date": "now", "machine": {}, "settings": {"gamma": gamma, "threshold": 0.5,
                                                                          "temperature": 0.0, "max_new_tokens": 64},
            "rows": rows}


def test_validation_replays_the_fixed_cells_exactly():
    rec = records(n_requests=2, rounds_per_request=6)
    pool = RD.pool_from_records(rec)
    bench = fake_bench(rec, 4, [1, 2], 4, (0.02, 0.03))
    curve = H.MeasuredRoundCurve.from_bench(bench)
    assert curve.anchor_cells(2) == {"fixed", "mtp1"}
    np.testing.assert_allclose(curve.round_seconds([4, 10], 2), [0.02, 0.03])  # mtp1 2C, fixed C(gamma+1)
    res = V.validate(bench, pool, episodes=3)
    fixed = [c for c in res["cells"] if c["scheduler"] == "fixed"]
    for c in fixed:
        assert c["model"] == "replay" and c["time_anchor"]
        np.testing.assert_allclose(c["simulated_tau"], c["measured_tau"])
        np.testing.assert_allclose(c["simulated_aggregate_tokens_per_s"], c["measured_aggregate_tokens_per_s"])
    assert res["summary"]["all"]["cells"] == 6


# ------------------------------------------------------------------------------------------------
# the command line


def test_cli_run_writes_results(tmp_path, capsys):
    from dspark_jax.simulate import main

    out = str(tmp_path / "sim.md")
    assert main(["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--concurrency", "1,2",
                 "--slot-rounds", "64", "--accelerator", "tpu-v6e", "--target", "qwen3-4b", "--out", out,
                 "--quiet"]) == 0
    got = json.load(open(str(tmp_path / "sim.json")))
    assert {r["policy"] for r in got["rows"]} == set(SIM.POLICIES) and got["settings"]["concurrency"] == [1, 2]
    assert got["hardware"]["accelerator"]["name"].startswith("Google TPU v6e")
    for suffix in ("_throughput.png", "_budget.png"):
        assert os.path.getsize(str(tmp_path / f"sim{suffix}")) > 1000
    assert "dspark_jax/engine/scheduler.py" in open(out).read()
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.parametrize("argv", [
    ["--rounds-file", "/nonexistent/rounds.json"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--concurrency", "0"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--policies", "fixed,bogus"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--accelerator", "abacus"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--buckets", "step:x"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--eval-group", "domain:poetry"],
    ["--concurrency", "1"],
    ["validate", "--bench", "/nonexistent.json", "--eval-stats", "docs/results/shipped/eval_t0/eval.json"],
    ["record", "--out", "x.json", "--prompts", "0"],
    ["validate", "--bench", "x.json", "--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--episodes", "1"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--seed", "-1"],
    ["--eval-stats", "docs/results/shipped/eval_t0/eval.json", "--pool-size", "99"],
])
def test_cli_bad_input_is_one_error_line(argv, capsys):
    from dspark_jax.simulate import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_the_flags_build_the_settings_values():
    """Every flag sets the field of its name, with the field's default; comma lists become tuples."""
    from dspark_jax.serving.settings import (CurveSettings, RecordSettings, RunSettings, StatsSettings,
                                             ValidateSettings)
    from dspark_jax.simulate import parse_args

    assert parse_args([]) == ("run", RunSettings())
    assert parse_args(["validate", "--bench", "b.json"]) == ("validate", ValidateSettings(bench="b.json"))
    assert parse_args(["record", "--out", "r.json"]) == ("record", RecordSettings(out="r.json"))
    cmd, s = parse_args(["--acceptance-rates", "0.8,0.6", "--kappa", "3", "--concurrency", "1,4", "--policies",
                         "fixed, dspark", "--sps-table", "a.json", "--sps-table", "b.json", "--chips", "2", "--quiet"])
    assert s == RunSettings(stats=StatsSettings(acceptance_rates=(0.8, 0.6), kappa=3.0), concurrency=(1, 4),
                            policies=("fixed", "dspark"), curve=CurveSettings(sps_table=("a.json", "b.json"), chips=2),
                            quiet=True)
    _, v = parse_args(["validate", "--bench", "b.json", "--rounds-file", "r.json", "--sps-table", "t.json",
                       "--timing-noise", "0.2", "--seed", "5"])
    assert v == ValidateSettings(bench="b.json", stats=StatsSettings(rounds_file="r.json"), sps_table=("t.json",),
                                 timing_noise=0.2, seed=5)


def test_settings_check_themselves():
    from dspark_jax.core.config_checks import ConfigError
    from dspark_jax.serving.settings import DEFAULT_POLICIES, CurveSettings, RunSettings, StatsSettings

    assert DEFAULT_POLICIES == SIM.POLICIES  # written out: the settings import no jax
    with pytest.raises(ConfigError, match="pool_size must be at least 100"):
        StatsSettings(pool_size=10)
    with pytest.raises(ConfigError, match="every element of acceptance_rates"):
        StatsSettings(acceptance_rates=(0.5, 1.5))
    with pytest.raises(ConfigError, match="curve.chips must be at least 1"):
        RunSettings(curve={"chips": 0})
    assert RunSettings(concurrency=[1, 2]).concurrency == (1, 2)
    assert RunSettings(curve={"chips": 2}).curve == CurveSettings(chips=2)


def test_corrupt_inputs(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(Exception, match="not a dspark-round-records"):
        RD.load_pool(str(bad))
    table = SPSTable((1, 2, 4, 9), (1.0, 1.0, 1.0, 1.0))
    save_sps_table(str(tmp_path / "t.json"), table)
    with pytest.raises(Exception, match="not a multiple of gamma"):
        H.SPSTableCurve.from_files([str(tmp_path / "t.json")], 7)


@pytest.mark.slow
def test_record_real_rounds(tmp_path):
    """`simulate record` on the shipped drafter: 2 prompts, a few tokens (loads the real target)."""
    from dspark_jax.simulate import main

    out = str(tmp_path / "rounds.json")
    assert main(["record", "--prompts", "2", "--max-new-tokens", "12", "--batch-size", "2", "--out", out]) == 0
    pool = RD.load_pool(out)
    assert set(pool.requests) <= {0, 1} and pool.gamma >= 1 and pool.request_tokens == 12
    assert pool.position.min() == 1 and np.all(pool.survival <= 1)
