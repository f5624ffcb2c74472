"""decode and datagen as multi-process JAX programs: 2 processes x 2 CPU devices on this machine
(gloo collectives) give exactly the one-process result.

* decode, data layout (the default): each process decodes its own share of the prompts, process 0
  prints every record in input order and the summary; --output is written by process 0 alone,
  once per prompt, and a resumed 2-process run decodes only what is missing.
* decode, tensor layout: the target's weights split over all 4 devices, the same greedy tokens.
* datagen: the shards byte for byte and the manifest of a one-process run, and resumable.
"""

import json
import os
import shutil

import pytest
from cli_helpers import assert_one_line_error
from multiprocess_helpers import check, describe, run_processes
from test_cli import tiny_drafter  # noqa: F401  (a fixture)
from test_decode_offline import words

from dspark_jax import datagen as datagen_cli
from dspark_jax import decode
from dspark_jax.data import shards
from dspark_jax.engine import offline

# Six ragged prompts in the three formats (two cache-length groups are not needed: few tokens).
LINES = [
    {"prompt": words(12, 0)},
    {"turns": [words(3, 5), "a second turn is not used"]},
    {"messages": [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": words(7, 9)}]},
    {"prompt": words(1, 11)},
    {"prompt": words(20, 13)},
    {"prompt": words(5, 19)},
]
NEW_TOKENS = "6"
SLOTS = ("max_batch",)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("multiprocess") / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return str(path)


def decode_args(target, prompts_file, *extra):
    return ["--target", target, "--prompts-file", prompts_file, "--max-new-tokens", NEW_TOKENS, "--drafter", "none",
            *extra]


def json_lines(text: str) -> tuple[list[dict], dict]:
    lines = [json.loads(line) for line in text.strip().splitlines()]
    assert lines and "summary" in lines[-1] and all("summary" not in r for r in lines[:-1]), text[-2000:]
    return lines[:-1], lines[-1]["summary"]


def without_timings(records, also=()):
    return [{k: v for k, v in r.items() if k not in offline.TIMING_FIELDS + also} for r in records]


@pytest.fixture(scope="module")
def reference(tiny_target_folder, prompts_file):
    """The one-process `decode --json` run (greedy): (records, summary)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = decode.main(decode_args(tiny_target_folder, prompts_file, "--json"))
    assert code == 0, err.getvalue()
    return json_lines(out.getvalue())


def run_decode(*argv, timeout=240):
    """`decode` as 2 processes x 2 CPU devices: (process 0's stdout, results), after asserting
    that both succeeded and that process 1 printed nothing on stdout."""
    results = check(run_processes(["dspark_jax.decode", *argv], num_processes=2, devices_per_process=2,
                                  timeout=timeout))
    assert results[1].stdout == "", describe(results)  # process 0 alone prints
    return results[0].stdout, results


def assert_same_summary(summary, one, layout, decoded, skipped=0):
    assert summary["processes"] == 2 and summary["layout"] == layout
    assert summary["decoded"] == decoded and summary["skipped"] == skipped and summary["requests"] == len(LINES)
    if not skipped:
        assert summary["generated_tokens"] == one["generated_tokens"]
    # aggregate tokens/s: every process's tokens over the slowest process's wall time
    assert len(summary["process_wall_s"]) == 2 and summary["wall_s"] == max(summary["process_wall_s"])
    assert all(w > 0 for w in summary["process_wall_s"])  # both processes decoded
    assert summary["aggregate_tokens_per_s"] == pytest.approx(summary["generated_tokens"] / summary["wall_s"], rel=1e-2)
    same = ("batching", "max_batch", "target", "drafter")
    assert {k: summary[k] for k in same} == {k: one[k] for k in same}


def test_bad_multiprocess_flags_are_one_line_errors(capsys, tiny_target_folder):
    for main in (decode.main, datagen_cli.main):
        rest = ["--prompt", "w5 w6"] if main is decode.main else ["--sets", "gsm8k", "--out", "unused"]
        assert_one_line_error(main, capsys, "--process-id must be in 0 .. 1, got 3", *rest, "--num-processes", "2",
                              "--process-id", "3", "--coordinator-address", "127.0.0.1:1")
        assert_one_line_error(main, capsys, "a multi-process run needs --coordinator-address, --process-id too",
                              *rest, "--num-processes", "2")
    assert_one_line_error(decode.main, capsys, "--layout: invalid choice: 'pipeline'", "--prompt", "w5",
                          "--layout", "pipeline")


def test_data_layout_prints_the_one_process_result(tiny_target_folder, prompts_file, reference):
    one_records, one_summary = reference
    out, _ = run_decode(*decode_args(tiny_target_folder, prompts_file, "--json"))
    records, summary = json_lines(out)
    assert [r["index"] for r in records] == list(range(len(LINES)))  # complete, disjoint, in input order
    assert without_timings(records) == without_timings(one_records)
    assert_same_summary(summary, one_summary, "data", decoded=len(LINES))


def test_tensor_layout_prints_the_one_process_result(tiny_target_folder, prompts_file, reference):
    one_records, one_summary = reference
    out, _ = run_decode(*decode_args(tiny_target_folder, prompts_file, "--json", "--layout", "tensor"))
    records, summary = json_lines(out)
    assert without_timings(records) == without_timings(one_records)
    assert_same_summary(summary, one_summary, "tensor", decoded=len(LINES))
    assert summary["mesh"] == {"data": 1, "fsdp": 1, "tensor": 4}  # the weights split over both processes' devices


def read_results(path):
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert lines[0]["format"] == offline.RESULTS_FORMAT
    return lines[1:]


def test_output_is_written_once_by_process_0_and_resumes(tiny_target_folder, prompts_file, reference, tmp_path):
    one_records, one_summary = reference
    output = str(tmp_path / "results.jsonl")
    args = decode_args(tiny_target_folder, prompts_file, "--output", output)
    out, _ = run_decode(*args, "--limit", "4")  # "interrupted" after 4 prompts, 2 per process
    assert "4 requests" in out and "2 processes, data layout" in out
    written = read_results(output)
    assert sorted(r["index"] for r in written) == [0, 1, 2, 3]  # each exactly once
    # (the request slots are an execution choice: 4 here, 6 for all six prompts)
    assert without_timings(sorted(written, key=lambda r: r["index"]), SLOTS) == without_timings(one_records[:4], SLOTS)

    out, _ = run_decode(*args, "--json")  # resumed: the 2 missing prompts, one per process
    records, summary = json_lines(out)
    assert without_timings(records, SLOTS) == without_timings(one_records, SLOTS)  # 4 from the file, 2 new
    assert_same_summary(summary, one_summary, "data", decoded=2, skipped=4)
    written = read_results(output)
    assert sorted(r["index"] for r in written) == list(range(len(LINES)))
    assert without_timings(sorted(written, key=lambda r: r["index"]), SLOTS) == without_timings(one_records, SLOTS)


def datagen_args(target, out):
    return ["--target", target, "--sets", "mbpp,humaneval", "--split", "eval", "--limit", "2", "--max-new-tokens",
            "4", "--max-prompt-tokens", "200", "--batch-size", "2", "--shard-size", "2", "--out", out, "--quiet"]


def folder_bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))
            if name.startswith("shard-")}


def manifest_content(folder):
    return {k: v for k, v in shards.read_manifest(folder).items() if k != "created"}


def test_datagen_two_processes_make_the_one_process_dataset(tiny_target_folder, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert datagen_cli.main(datagen_args(tiny_target_folder, one)) == 0
    assert len(folder_bytes(one)) == 2  # shard 0 by process 0, shard 1 by process 1
    check(run_processes(["dspark_jax.datagen", *datagen_args(tiny_target_folder, two)], timeout=240))
    assert folder_bytes(two) == folder_bytes(one)  # byte for byte
    assert manifest_content(two) == manifest_content(one) and manifest_content(two)["complete"]

    # an interrupted one-process run resumes with 2 processes: only the missing shards are made
    part = str(tmp_path / "part")
    shutil.copytree(one, part)
    for name in ("shard-00001.npz",):
        os.remove(os.path.join(part, name))
    kept = os.stat(os.path.join(part, "shard-00000.npz")).st_mtime_ns
    check(run_processes(["dspark_jax.datagen", *datagen_args(tiny_target_folder, part)], timeout=240))
    assert os.stat(os.path.join(part, "shard-00000.npz")).st_mtime_ns == kept  # not redone
    assert folder_bytes(part) == folder_bytes(one) and manifest_content(part) == manifest_content(one)


@pytest.mark.slow
def test_tensor_layout_speculative_plans_with_one_sps_table(tiny_target_folder, tiny_drafter, prompts_file,  # noqa: F811
                                                            reference, tmp_path):
    """Speculative decoding under the tensor layout: the dspark-async scheduler's SPS table is
    profiled by every process together and process 0's is used by all (one plan everywhere)."""
    one_records, _ = reference
    table = str(tmp_path / "sps.json")
    args = decode_args(tiny_target_folder, prompts_file, "--json", "--layout", "tensor")
    args[args.index("--drafter") + 1] = tiny_drafter
    out, _ = run_decode(*args, "--scheduler", "dspark-async", "--gamma", "3", "--sps-table", table, "--profile-sps",
                        timeout=500)
    records, summary = json_lines(out)
    assert [r["token_ids"] for r in records] == [r["token_ids"] for r in one_records]  # lossless
    assert summary["scheduler"] == "dspark-async" and os.path.exists(table)
    out, _ = run_decode(*args, "--scheduler", "dspark-async", "--gamma", "3", "--sps-table", table, timeout=500)
    assert [r["token_ids"] for r in json_lines(out)[0]] == [r["token_ids"] for r in one_records]  # table read

