"""eval and calibrate as multi-process JAX programs: 2 processes x 2 CPU devices on this machine
(gloo collectives) give the one-process result.

Each benchmark's batches are shared out whole (batch b on process b % 2, with its one-process
prompts and seed) and their rounds gathered back in batch order, so
* eval writes the eval.json of a one-process run, greedy and sampled (T = 1), with a ragged last
  batch and process 0 decoding more batches than process 1;
* calibrate fits and stores the same STS temperatures and writes the same report;
* process 0 alone prints (process 1's stdout stays empty) and writes the files;
* a UserError on one process only (a file it cannot read, a results folder process 0 cannot
  write) ends every process with it (exit 2, one error line), and bad multi-process flags are one
  error line.
"""

import contextlib
import io
import json
import math
import os

import pytest
from cli_helpers import assert_one_line_error
from multiprocess_helpers import check, describe, run_processes
from test_eval import save_tiny_drafter

from dspark_jax import calibrate
from dspark_jax import eval as eval_cli

STS = [1.5, 0.8, 1.2, 2.0]
# m1: 5 prompts in batches of 2 -> batches at prompts 0, 2, 4 (processes 0, 1, 0; the last one
# ragged); chat: 3 prompts -> batches at 0 (process 0) and 2 (process 1).
BENCHES = {"m1": ["w5 w6 w7 w8", "w9 w1 w30", "w40 w41 w42 w43 w44", "w3", "w60 w61 w62"],
           "chat": ["w100 w101 w102", "w11 w12", "w13"]}
NEW_TOKENS = "8"


@pytest.fixture(scope="module")
def setup(tiny_target_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("multiprocess-eval")
    for name, prompts in BENCHES.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    return {
        "root": root,
        **{name: str(root / f"{name}.jsonl") for name in BENCHES},
        "dspark": save_tiny_drafter(root / "dspark" / "drafter", tiny_target_folder, sts=STS),
        "dflash": save_tiny_drafter(root / "dflash", tiny_target_folder, head="none", markov_rank=0,
                                    confidence=False),
    }


def eval_args(setup, target, out, temperature, drafters=("dspark", "dflash")):
    return ["--target", target, "--drafters", ",".join(f"{d}={setup[d]}" for d in drafters),
            "--bench", f"m1={setup['m1']}:math", "--bench", f"chat={setup['chat']}", "--limit", "5",
            "--batch-size", "2", "--max-new-tokens", NEW_TOKENS, "--temperature", temperature, "--seed", "3",
            "--no-progress", "--out", out]


def run_in_process(main, argv):
    """One process (this one, 4 CPU devices): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def run_two(module, argv, timeout=300):
    """`module` as 2 processes x 2 CPU devices: the results, after asserting that both succeeded
    and that process 1 printed nothing on stdout."""
    results = check(run_processes([module, *argv], num_processes=2, devices_per_process=2, timeout=timeout))
    assert results[1].stdout == "", describe(results)  # process 0 alone prints
    return results


def assert_close(got, want, where="", rel=1e-6):
    """The same JSON value, floats to a relative tolerance (NaN equals NaN)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, sorted(got), sorted(want))
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}", rel)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]", rel)
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)), (where, got, want)
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=rel, abs=1e-9), \
            (where, got, want)
    else:
        assert got == want, (where, got, want)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("temperature", [pytest.param("1", marks=pytest.mark.slow), "0"], ids=["sampled", "greedy"])
def test_eval_two_processes_write_the_one_process_report(setup, tiny_target_folder, tmp_path, temperature):
    # greedy: the DSpark drafter alone (its rounds exercise the calibration numbers), a shorter run
    drafters = ("dspark", "dflash") if temperature == "1" else ("dspark",)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    code, one_stdout, err = run_in_process(eval_cli.main, eval_args(setup, tiny_target_folder, one, temperature,
                                                                    drafters))
    assert code == 0, err
    results = run_two("dspark_jax.eval", eval_args(setup, tiny_target_folder, two, temperature, drafters))
    report, want = read_json(os.path.join(two, "eval.json")), read_json(os.path.join(one, "eval.json"))
    assert report["settings"].pop("processes") == 2  # the one field that says how it was run
    assert_close(report, want)
    overall = report["drafters"]["dspark"]["overall"]
    assert overall["prompts"] == 8 and overall["rounds"] > 0 and "calibration" in overall
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))  # eval.json, eval.md and the same plots
    assert results[0].stdout == one_stdout.replace(one, two)  # the table (and where the files went)


def save_calibration_drafter(folder, target_folder):
    return save_tiny_drafter(folder, target_folder)  # random DSpark drafter with a confidence head


CALIBRATE_ARGS = ["--sets", "gsm8k", "--limit", "4", "--batch-size", "2", "--max-new-tokens", "16", "--seed", "1",
                  "--no-progress"]


def test_calibrate_two_processes_store_the_one_process_temperatures(tiny_target_folder, tmp_path):
    from dspark_jax.drafters.checkpoint import load_drafter

    source = save_calibration_drafter(tmp_path / "source", tiny_target_folder)

    def argv(name):
        return ["--drafter", source, "--target", tiny_target_folder, *CALIBRATE_ARGS,
                "--save-to", str(tmp_path / name / "drafter"), "--out", str(tmp_path / name / "report")]

    code, out, err = run_in_process(calibrate.main, argv("one"))
    assert code == 0, err
    want = json.loads(out.strip().splitlines()[-1])
    results = run_two("dspark_jax.calibrate", argv("two"))
    summary = json.loads(results[0].stdout.strip().splitlines()[-1])
    assert summary["rounds"] == want["rounds"] >= 20  # 2 batches: one on each process
    assert_close({k: v for k, v in summary.items() if k not in ("report", "plot")},
                 {k: v for k, v in want.items() if k not in ("report", "plot")})
    assert summary["report"] == str(tmp_path / "two" / "report" / "report.json")
    one, two = load_drafter(str(tmp_path / "one" / "drafter")), load_drafter(str(tmp_path / "two" / "drafter"))
    assert two.sts_temperatures is not None and len(two.sts_temperatures) == 4
    assert_close(list(two.sts_temperatures), list(one.sts_temperatures))
    assert_close(two.metadata, one.metadata)  # what the temperatures were fitted on
    assert_close(read_json(str(tmp_path / "two" / "report" / "report.json")),
                 read_json(str(tmp_path / "one" / "report" / "report.json")))
    assert sorted(os.listdir(tmp_path / "two" / "report")) == ["reliability.png", "report.json"]
    assert load_drafter(source).sts_temperatures is None  # --save-to leaves the source alone


def test_a_user_error_on_one_process_ends_every_process(setup, tiny_target_folder, tmp_path):
    """Process 1 alone cannot read a benchmark file (or knows no such prompt set): every process
    stops with the error, none is left waiting at a collective."""
    missing = str(tmp_path / "missing.jsonl")

    def eval_argv(i):
        argv = eval_args(setup, tiny_target_folder, str(tmp_path / "out"), "0", ("dflash",))
        return ["dspark_jax.eval", *[f"m1={missing}:math" if i == 1 and a.startswith("m1=") else a for a in argv]]

    source = save_calibration_drafter(tmp_path / "drafter", tiny_target_folder)

    def calibrate_argv(i):
        sets = "nosuchset" if i == 1 else "gsm8k"
        return ["dspark_jax.calibrate", "--drafter", source, "--target", tiny_target_folder,
                *[sets if a == "gsm8k" else a for a in CALIBRATE_ARGS], "--out", str(tmp_path / "report")]

    for argv, message in ((eval_argv, f"no such prompts file: {missing}"), (calibrate_argv, "unknown prompt set")):
        results = run_processes(argv, num_processes=2, devices_per_process=2, timeout=120)
        assert [r.returncode for r in results] == [2, 2], describe(results)
        for i, r in enumerate(results):
            assert "Traceback" not in r.stderr and r.stdout == "", describe(results)
            last = r.stderr.strip().splitlines()[-1]
            assert last.startswith("error: " + ("process 1: " if i == 0 else "")) and message in last, describe(results)
    assert not (tmp_path / "out").exists() and not (tmp_path / "report").exists()  # nothing written


def test_a_results_folder_process_0_cannot_write_ends_every_process(setup, tiny_target_folder, tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    argv = ["dspark_jax.eval", "--target", tiny_target_folder, "--drafters", setup["dflash"], "--bench",
            f"chat={setup['chat']}", "--limit", "2", "--batch-size", "1", "--max-new-tokens", "2", "--no-progress",
            "--out", str(blocked / "out")]
    results = run_processes(argv, num_processes=2, devices_per_process=2, timeout=120)
    assert [r.returncode for r in results] == [2, 2], describe(results)
    for r in results:
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: cannot write the results to {blocked / 'out'}"), describe(results)
        assert "Traceback" not in r.stderr and r.stdout == "", describe(results)


def test_bad_multiprocess_flags_are_one_line_errors(capsys, setup, tmp_path):
    for main, rest in ((eval_cli.main, ["--drafters", setup["dspark"], "--out", str(tmp_path / "o")]),
                       (calibrate.main, ["--drafter", setup["dspark"]])):
        assert_one_line_error(main, capsys, "--process-id must be in 0 .. 1, got 3", *rest, "--num-processes", "2",
                              "--process-id", "3", "--coordinator-address", "127.0.0.1:1")
        assert_one_line_error(main, capsys, "a multi-process run needs --coordinator-address, --process-id too",
                              *rest, "--num-processes", "2")
        assert_one_line_error(main, capsys, "--num-processes must be at least 1, got 0", *rest, "--num-processes",
                              "0")
    assert not (tmp_path / "o").exists()
