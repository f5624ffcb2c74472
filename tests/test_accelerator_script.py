"""benchmarks/accelerator.py, the one-command device run of issue 17, in its --smoke mode: every part
runs at toy sizes on this CPU and leaves well-formed results, so that the script cannot rot between
the sessions that are lent an accelerator. Timings are not checked (toy sizes on a shared CPU)."""

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "accelerator.py")
PARTS = ("sps", "breakdown", "speedup", "serving", "training")


def run_script(*args, timeout=1800):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on the accelerator machine (conftest asks for four)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, SCRIPT, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerator")
    ok(run_script("--smoke", "--out", out, "--budget-s", 3600))  # a budget no slow machine reaches
    with open(out / "results.json") as f:
        results = json.load(f)
    return out, results, (out / "results.md").read_text()


def items(results, part):
    return [i["result"] for i in results["parts"][part]["items"]]


# The three tests of the smoke run (one ~3-minute run of every benchmark part, the module fixture)
# are in the slow set; the preflight and the time budget stay in the default run.
@pytest.mark.slow
def test_every_part_is_measured(smoke):
    _, results, _ = smoke
    meta = results["meta"]
    assert {"device", "platform", "jax", "date", "command", "sizes", "budget_s", "elapsed_s"} <= set(meta)
    assert meta["smoke"] is True
    assert list(results["parts"]) == list(PARTS)
    for name, part in results["parts"].items():
        statuses = [i["status"] for i in part["items"]]
        assert part["status"] == "done" and statuses and set(statuses) == {"ok"}, (name, part["status"], statuses)

    (sps,) = items(results, "sps")
    assert {"draft_ms", "plain_step_ms", "plain_step_1_row_ms", "sps_table", "rows", "gamma"} <= set(sps)
    assert sps["sps_table"]["format"] == "dspark-sps-table"
    assert [b["bucket"] for b in sps["buckets"]] == sps["sps_table"]["buckets"]
    assert all(b["round_ms"] > 0 and b["sps"] > 0 for b in sps["buckets"])
    assert any(b["verify_donated_ms"] is not None for b in sps["buckets"])

    breakdown, direct = items(results, "breakdown")
    for key in ("backbone_ms", "propose_dflash_ms", "propose_markov_ms", "propose_dspark_ms", "propose_rnn_ms",
                "schedule_dspark_ms", "schedule_dspark_async_ms", "verify_ms", "verify_commit_ms", "round_ms",
                "engine_round_ms", "markov_head_ms", "confidence_ms", "rnn_head_ms", "accept_commit_ms", "host_ms",
                "head_share_dspark", "head_share_rnn"):
        assert isinstance(breakdown[key], float), key
    assert {"round_ms_dspark", "round_ms_dflash", "head_share"} <= set(direct)

    (speedup,) = items(results, "speedup")
    assert {"domain", "batch", "temperature", "speedup", "tau", "plain", "speculative"} <= set(speedup)
    assert speedup["greedy_identical_rows"] == speedup["prompts"]  # greedy speculative decoding is lossless
    (serving,) = items(results, "serving")
    assert {r["scheduler"] for r in serving["rows"]} == set(meta["sizes"]["sv_schedulers"])
    assert all(r["aggregate_tokens_per_s"] > 0 for r in serving["rows"])

    (train,) = items(results, "training")
    assert train["steps_per_s"] > 0 and train["target_tokens_per_s"] > 0 and train["model_tflop_per_step"] > 0
    assert train["mfu"] is None  # no bf16 peak for a CPU
    assert train["target_layers"] < train["full_target_layers"]  # the smoke run cuts layers: the scaled estimate
    assert train["estimated_full_depth_s_per_step"] > train["s_per_step"]


@pytest.mark.slow
def test_markdown_labels_every_table(smoke):
    _, results, md = smoke
    meta = results["meta"]
    label = f"_{meta['device']} ({meta['platform']}), JAX {meta['jax']}, {meta['date']}_"
    sections = re.split(r"^## ", md, flags=re.M)[1:]
    assert [s.splitlines()[0] for s in sections] == [results["parts"][p]["title"] for p in PARTS]
    for section in sections:
        assert label in section, section[:200]
        assert "|---" in section, section[:200]  # at least one table
        assert section.index(label) < section.index("|---")


@pytest.mark.slow
def test_outputs_fit_what_the_device_tool_returns(smoke):
    out, results, md = smoke
    files = sorted(os.listdir(out))
    assert {"results.json", "results.md", "sps.png", "speedup.png", "serving_throughput.png",
            "serving_budget.png"} == set(files)
    assert len(files) + 1 <= 8  # accelerator.sh adds log.txt
    for f in files:
        assert os.path.isfile(out / f) and os.path.getsize(out / f) < 16 * 2**20
        assert re.fullmatch(r"[A-Za-z0-9._-]+", f)
    for part in PARTS:
        for png in results["parts"][part].get("plots", []):
            assert png in files and f"({png})" in md


def test_time_budget_skips_instead_of_overrunning(tmp_path):
    ok(run_script("--smoke", "--out", tmp_path, "--budget-s", 0, timeout=600))
    results = json.loads((tmp_path / "results.json").read_text())
    for part in PARTS:
        p = results["parts"][part]
        assert p["items"] and {i["status"] for i in p["items"]} == {"skipped: time budget"}, part
        assert p["status"] == "nothing measured"
    md = (tmp_path / "results.md").read_text()
    assert md.count("skipped: time budget") >= len(PARTS)
    assert sorted(os.listdir(tmp_path)) == ["results.json", "results.md"]


def test_preflight_says_what_is_missing(tmp_path):
    proc = run_script("--preflight", "--out", tmp_path, timeout=600)
    assert proc.returncode != 0
    assert "preflight: missing a GPU" in proc.stdout
    proc = ok(run_script("--preflight", "--allow-cpu", "--out", tmp_path, timeout=600))
    assert "preflight: OK" in proc.stdout and "missing" not in proc.stdout
