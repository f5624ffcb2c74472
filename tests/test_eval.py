"""`python -m dspark_jax.eval` end to end on a tiny target with tiny random drafters."""

import json
import os

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_main

from dspark_jax import eval as eval_cli
from dspark_jax.evaluation import benchmark
from dspark_jax.data.splits import get_split

PNG = b"\x89PNG\r\n\x1a\n"
STS = [1.5, 0.8, 1.2, 2.0]
BENCHES = {"m1": ["w5 w6 w7 w8", "w9 w1 w30", "w40 w41 w42 w43 w44", "w3"], "m2": ["w60 w61", "w7 w7 w7 w7 w7 w7"],
           "chat": ["w100 w101 w102", "w11 w12", "w13"]}


def read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def save_tiny_drafter(folder, target_folder, sts=None, **overrides):
    """A random DSpark (or, with overrides, DFlash / mismatched) drafter for the tiny target."""
    import jax

    from dspark_jax.checkpoints.hf import load_hf_model
    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.drafters.config import DrafterConfig
    from dspark_jax.drafters.dspark import init_drafter_params

    tcfg, _ = load_hf_model(target_folder)
    fields = {"kind": "dspark", "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "intermediate_size": 64, "block_size": 4, "head": "markov", "markov_rank": 8, "confidence": True,
              "mask_token_id": 0, "target_layer_ids": (0, 1), "target_name": "tiny"}
    dims = {"hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size, "target_vocab_size": tcfg.vocab_size,
            "target_hidden_size": tcfg.hidden_size, "target_num_layers": tcfg.num_layers}
    dcfg = DrafterConfig(**{**fields, **dims, **overrides})
    params = init_drafter_params(dcfg, jax.random.key(len(overrides)), scale=0.5)
    save_drafter(str(folder), dcfg, jax.device_get(params), sts_temperatures=sts)
    return str(folder)


@pytest.fixture(scope="module")
def setup(tiny_target_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    for name, prompts in BENCHES.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    return {
        "root": root,
        "bench": str(root / "m1.jsonl"),  # for the error cases
        **{name: str(root / f"{name}.jsonl") for name in BENCHES},
        "dspark": save_tiny_drafter(root / "dspark" / "drafter", tiny_target_folder, sts=STS),
        "dflash": save_tiny_drafter(root / "dflash", tiny_target_folder, head="none", markov_rank=0,
                                    confidence=False),
        "alien": save_tiny_drafter(root / "alien", tiny_target_folder, target_num_layers=7),
    }


@pytest.fixture(scope="module")
def evaluated(setup, tiny_target_folder):
    """One run: the DSpark drafter twice (as dspark and again), the DFlash drafter as baseline; three
    --bench files (two math, one other); sampling at T = 1."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out = str(setup["root"] / "results")
    argv = ["--target", tiny_target_folder, "--drafters",
            f"{setup['dspark']},dflash={setup['dflash']},again={setup['dspark']}", "--baseline", "dflash",
            "--bench", f"chat={setup['chat']}", "--bench", f"m1={setup['m1']}:math", "--bench", f"m2={setup['m2']}:math",
            "--limit", "3", "--max-new-tokens", "16", "--batch-size", "2",
            "--seed", "3", "--no-progress", "--out", out]
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = eval_cli.main(argv)
    assert code == 0, stderr.getvalue()
    with open(os.path.join(out, "eval.json")) as f:
        return out, json.load(f), stdout.getvalue()


def test_builtin_sets_use_the_eval_split_and_domains(setup):
    settings, _ = eval_cli.parse_args(["--drafters", "x", "--out", "o", "--sets", "chat,gsm8k", "--limit", "5",
                                       "--bench", f"mine={setup['m2']}"])
    benches = benchmark.load_benches(settings)  # domain order: math, code, chat, other
    assert [(b.name, b.domain) for b in benches] == [("gsm8k", "math"), ("arena-hard-v2", "chat"), ("mine", "other")]
    assert benches[0].prompts == get_split("gsm8k", "eval")[:5] and benches[2].prompts == BENCHES["m2"]
    settings = benchmark.EvalSettings(drafters="x", out="o", limit=1)  # what the flags' defaults build
    assert eval_cli.parse_args(["--drafters", "x", "--out", "o", "--limit", "1"])[0] == settings
    assert [b.name for b in benchmark.load_benches(settings)] == ["gsm8k", "math500", "humaneval", "mbpp", "arena-hard-v2"]


def test_report_structure_and_labels(evaluated):
    _, report, _ = evaluated
    assert list(report["drafters"]) == ["dspark", "dflash", "again"]  # "<dir>/drafter" is labelled by <dir>
    assert [(b["name"], b["domain"], b["prompts"]) for b in report["benchmarks"]] == [
        ("m1", "math", 3), ("m2", "math", 2), ("chat", "other", 3)]
    assert report["settings"]["temperature"] == 1.0 and report["settings"]["scheduler"] == "fixed"
    for r in report["drafters"].values():
        assert r["gamma"] == 4 and list(r["benchmarks"]) == ["m1", "m2", "chat"]
        assert list(r["domains"]) == ["math", "other"]
    assert report["comparison"]["baseline"] == "dflash"
    assert report["comparison"]["columns"] == ["bench:m1", "bench:m2", "bench:chat", "domain:math", "domain:other",
                                               "macro"]


def test_numbers_are_consistent(evaluated):
    _, report, _ = evaluated
    for r in report["drafters"].values():
        groups = list(r["benchmarks"].values()) + list(r["domains"].values()) + [r["overall"]]
        for m in groups:
            hist = np.asarray(m["accepted_histogram"])
            assert m["rounds"] > 0 and hist.sum() == m["rounds"]
            assert (hist * np.arange(5)).sum() == m["accepted_tokens"]
            assert m["tau"] == pytest.approx(1 + m["accepted_tokens"] / m["rounds"])
            assert m["verified_tokens"] == 4 * m["rounds"]  # fixed-length verification
            assert m["acceptance_rate"] == pytest.approx(m["accepted_tokens"] / m["verified_tokens"])
            assert m["generated_tokens"] <= 16 * m["prompts"]
            # conditional acceptance from the histogram: rounds accepting >= k over rounds accepting >= k - 1
            at_least = hist[::-1].cumsum()[::-1]
            assert m["conditional_count"] == at_least[:4].tolist()
            want = [at_least[k] / at_least[k - 1] if at_least[k - 1] else None for k in range(1, 5)]
            assert m["conditional_acceptance"] == pytest.approx(want, nan_ok=True)
            if "calibration" in m:  # computed from the raw round arrays, not from the counts above
                assert m["calibration"]["tau_full"] == pytest.approx(m["tau"])
                assert m["threshold_sweep"]["full_tokens_per_step"] == pytest.approx(m["tau"])
        benches = r["benchmarks"]
        for group, names in ((r["domains"]["math"], ["m1", "m2"]), (r["domains"]["other"], ["chat"]),
                             (r["overall"], ["m1", "m2", "chat"])):
            parts = [benches[n] for n in names]
            for key in ("rounds", "prompts", "verified_tokens", "accepted_tokens", "generated_tokens"):
                assert group[key] == sum(m[key] for m in parts)
            # rounds-weighted combination of the benchmarks' values
            assert group["tau"] == pytest.approx(sum(m["rounds"] * m["tau"] for m in parts) / group["rounds"])
        assert r["macro_tau"] == pytest.approx(np.mean([m["tau"] for m in benches.values()]))


def pairwise_auc(scores, labels):
    """ROC-AUC by counting (positive, negative) pairs, ties one half."""
    scores, labels = np.asarray(scores), np.asarray(labels, bool)
    diff = scores[labels][:, None] - scores[~labels][None, :]
    return (np.sum(diff > 0) + 0.5 * np.sum(diff == 0)) / diff.size


def engine_rounds(target_folder, drafter_path, prompts):
    """The protocol eval documents, run on the engine directly (not through eval or calibrate): the
    chat-templated prompts in batches of 2, seed 3 + the batch's first prompt index, every round
    verifying all 4 draft tokens, T = 1, at most 16 new tokens, stopping at EOS. Returns (accepted
    per round, confidence logits per round, generated tokens)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.drafters.checkpoint import load_drafter
    from dspark_jax.engine.speculative import SpecConfig, speculative_generate
    from dspark_jax.models.sampling import SamplingConfig

    target, loaded = load_target(target_folder), load_drafter(drafter_path)
    dparams = jax.tree.map(jnp.asarray, loaded.params)
    cfg = SpecConfig(gamma=4, sampling=SamplingConfig(1.0), policy="fixed",
                     stop_ids=tuple(target.tokenizer.eos_token_ids))
    encoded = [target.tokenizer.chat_prompt_ids(p) for p in prompts]
    accepted, logits, generated = [], [], 0
    for start in range(0, len(encoded), 2):
        result = speculative_generate(target.params, target.config, dparams, loaded.config, encoded[start:start + 2],
                                      max_new_tokens=16, cfg=cfg, seed=3 + start)
        generated += sum(len(ids) for ids in result.token_ids)
        for r in result.rounds:
            accepted.append(r["accepted"][r["active"]])
            logits.append(r["confidence_logits"][r["active"]])
    return np.concatenate(accepted), np.concatenate(logits), generated


def test_every_drafter_reports_its_own_engine_rounds(evaluated, setup, tiny_target_folder):
    """Each label's numbers are those of ITS drafter on the same prompts and seeds, recomputed from the
    engine's rounds in numpy: "again" (the dspark checkpoint under a second label) and dflash too."""
    _, report, _ = evaluated
    limited = {name: prompts[:3] for name, prompts in BENCHES.items()}  # --limit 3
    runs = {path: [engine_rounds(tiny_target_folder, path, limited[name]) for name in ("m1", "m2", "chat")]
            for path in (setup["dspark"], setup["dflash"])}
    for label, path in (("dspark", setup["dspark"]), ("again", setup["dspark"]), ("dflash", setup["dflash"])):
        r = report["drafters"][label]
        everything = runs[path]
        for name, (acc, _, generated) in zip(("m1", "m2", "chat"), everything):
            m = r["benchmarks"][name]
            assert m["prompts"] == len(limited[name]) and m["rounds"] == len(acc), (label, name)
            assert m["accepted_histogram"] == np.bincount(acc, minlength=5).tolist(), (label, name)
            assert m["generated_tokens"] == generated and m["tau"] == pytest.approx(1 + acc.mean()), (label, name)
        if label != "dflash":  # calibration of the prefix survival a_k, raw and with the stored STS temperatures
            acc = np.concatenate([e[0] for e in everything])
            z = np.concatenate([e[1] for e in everything]).astype(np.float64)
            cal = r["overall"]["calibration"]
            for k in range(4):
                event = acc >= k + 1
                if 0 < event.sum() < len(event):
                    raw = np.prod(1 / (1 + np.exp(-z[:, :k + 1])), axis=1)
                    sts = np.prod(1 / (1 + np.exp(-z[:, :k + 1] / np.array(STS[:k + 1]))), axis=1)
                    assert cal["auc_raw"][k] == pytest.approx(pairwise_auc(raw, event), abs=1e-9), (label, k)
                    assert cal["auc_sts"][k] == pytest.approx(pairwise_auc(sts, event), abs=1e-9), (label, k)
    rows = report["comparison"]["rows"]
    for col in report["comparison"]["columns"]:
        assert rows["dflash"][col]["gain"] == 0.0
        assert rows["dspark"][col]["gain"] == pytest.approx(rows["dspark"][col]["tau"] / rows["dflash"][col]["tau"] - 1)


def test_confidence_reports_use_the_stored_temperatures(evaluated):
    _, report, _ = evaluated
    dspark, dflash = report["drafters"]["dspark"], report["drafters"]["dflash"]
    assert dspark["sts_temperatures"] == STS and dflash["sts_temperatures"] is None
    assert "calibration" not in dflash["overall"] and "threshold_sweep" not in dflash["overall"]
    cal, sweep = dspark["overall"]["calibration"], dspark["overall"]["threshold_sweep"]
    assert cal["temperatures"] == STS and cal["temperatures_source"] == "drafter"
    assert len(cal["ece_raw"]) == len(cal["ece_sts"]) == len(cal["auc_sts"]) == 4
    assert sweep["temperatures"] == "sts" and sweep["thresholds"][0] == 0.0
    assert sweep["tokens_per_step"][0] == pytest.approx(dspark["overall"]["tau"])  # h = 0 verifies everything
    assert sweep["verified_per_step"][0] == 4.0
    assert all(a >= b - 1e-12 for a, b in zip(sweep["verified_per_step"], sweep["verified_per_step"][1:]))


def test_markdown_stdout_and_plots(evaluated):
    out, report, stdout = evaluated
    md = read(os.path.join(out, "eval.md"))
    header = "| drafter | gamma | math: m1 | math: m2 | other: chat | macro avg |"
    assert header in md and header in stdout
    taus = {k: report["comparison"]["rows"][k]["macro"]["tau"] for k in ("dspark", "dflash")}
    gain = report["comparison"]["rows"]["dspark"]["macro"]["gain"]
    assert "| dflash | 4 | " in md and f"{taus['dflash']:.2f} |" in md
    assert f"{taus['dspark']:.2f} ({100 * gain:+.1f}%) |" in md
    assert "Confidence head of `dspark`" in md and "Confidence head of `dflash`" not in md
    pngs = ["acceptance.png", "acceptance_math.png", "acceptance_other.png",
            "reliability_dspark.png", "threshold_sweep_dspark.png", "reliability_again.png",
            "threshold_sweep_again.png"]
    assert sorted(f for f in os.listdir(out) if f.endswith(".png")) == sorted(pngs)
    for name in pngs:
        assert read(os.path.join(out, name), "rb")[:8] == PNG
        assert f"({name})" in md
    assert not [f for f in os.listdir(out) if f.endswith(".tmp") or f.startswith(".tmp")]


def test_greedy_run(setup, tiny_target_folder, tmp_path, capsys):
    out = str(tmp_path / "greedy")
    code, _, err = run_main(eval_cli.main, capsys, "--target", tiny_target_folder, "--drafters", setup["dflash"],
                                 "--bench", f"tiny={setup['chat']}", "--limit", "2", "--temperature", "0",
                                 "--max-new-tokens", "8", "--gamma", "2", "--no-progress", "--out", out)
    assert code == 0, err
    report = json.loads(read(os.path.join(out, "eval.json")))
    r = report["drafters"]["dflash"]
    assert report["settings"]["temperature"] == 0.0 and r["gamma"] == 2
    assert [b["name"] for b in report["benchmarks"]] == ["tiny"]  # --bench alone: no built-in sets
    assert r["overall"]["verified_tokens"] == 2 * r["overall"]["rounds"]
    assert report["comparison"]["rows"]["dflash"]["macro"]["gain"] == 0.0


@pytest.mark.parametrize("args, message", [
    (["--drafters", "{missing}"], "no drafter checkpoint at"),
    (["--drafters", "{dspark}", "--sets", "gsm8k,nosuchset"], "unknown prompt set 'nosuchset'"),
    (["--drafters", "{dspark}", "--bench", "{bench}"], "--bench expects NAME=PATH[:DOMAIN]"),
    (["--drafters", "{dspark}", "--bench", "=x.jsonl"], "--bench expects NAME=PATH[:DOMAIN]"),
    (["--drafters", "{dspark}", "--bench", "x={bench}:sports"], "unknown domain 'sports'"),
    (["--drafters", "{dspark}", "--bench", "x={missing}.jsonl"], "no such prompts file"),
    (["--drafters", "{dspark}", "--bench", "gsm8k={bench}", "--sets", "gsm8k"], "benchmark 'gsm8k' is given twice"),
    (["--drafters", "{dspark}", "--limit", "0"], "--limit must be at least 1"),
    (["--drafters", "{alien}"], "drafter was trained for target tiny"),
    (["--drafters", "{dspark}", "--gamma", "9"], "--gamma 9 is larger than the block size 4 of drafter dspark"),
    (["--drafters", "{dspark},{dspark}"], "two drafters are labelled 'dspark'"),
    (["--drafters", "a={dspark}", "--baseline", "b"], "--baseline 'b' is not one of the drafters (a)"),
    (["--drafters", "{dspark}", "--thresholds", "0.5,2"], "--thresholds must be numbers in [0, 1]"),
    (["--drafters", "{dspark}", "--bench", "m1={m1}", "--max-new-tokens", "250"],
     "benchmark m1: prompt of 10 tokens + 250 new tokens exceeds the model's context of 256 tokens"),
])
def test_bad_input_is_one_line(setup, tiny_target_folder, tmp_path, capsys, args, message):
    paths = dict(setup, missing=str(tmp_path / "nothing"))
    out = tmp_path / "out"
    argv = [a.format(**paths) for a in args] + ["--target", tiny_target_folder, "--out", str(out), "--no-progress"]
    assert_one_line_error(eval_cli.main, capsys, message, *argv)
    assert not out.exists()  # nothing written


def test_module_entry_point_exits_non_zero(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dspark_jax.eval", "--drafters", str(tmp_path / "none"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    want = f"error: no drafter checkpoint at {tmp_path / 'none'} (expected drafter.json and drafter.safetensors)"
    assert proc.stderr.strip().splitlines() == [want]
