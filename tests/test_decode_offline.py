"""`python -m dspark_jax.decode` as an offline job: continuous batching (plain and speculative) is
token for token static batching and plain greedy decoding, results come in input order, --output
appends as requests finish and resumes after a kill, --limit / --offset, the prompt formats."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import assert_one_line_error, run_main
from test_cli import tiny_drafter  # noqa: F401  (a fixture)

from dspark_jax import decode
from dspark_jax.engine import offline
from dspark_jax.core.errors import UserError
from dspark_jax.engine.decode_settings import DecodeSettings

WORDS = [f"w{i}" for i in range(3, 120)]


def words(n: int, start: int) -> str:
    return " ".join(WORDS[(start + 7 * k) % len(WORDS)] for k in range(n))


# Ragged prompts in every format, 1 to 55 words, one conversation with a system turn; with 10 new
# tokens the two longest need a 128-position KV cache, the others fit in 64.
LINES = [
    {"prompt": words(12, 0)},
    {"turns": [words(3, 5), "a second turn is not used"]},
    {"messages": [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": words(7, 9)}]},
    {"prompt": words(1, 11)},
    {"prompt": words(55, 13)},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6"}]}]},
    {"turns": [words(52, 17)]},
    {"prompt": words(5, 19)},
    {"prompt": words(9, 23)},
]
BASE = ["--max-new-tokens", "10", "--json"]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_lines(tmp_path_factory.mktemp("offline") / "prompts.jsonl", LINES)


def decode_json(capsys, *argv):
    """(records, summary) of a successful `decode --json` run."""
    code, out, err = run_main(decode.main, capsys, *argv)
    assert code == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert "summary" in lines[-1] and all("summary" not in r for r in lines[:-1])
    return lines[:-1], lines[-1]["summary"]


def tokens_by_index(records):
    return {r["index"]: r["token_ids"] for r in records}


def without_timings(record):
    return {k: v for k, v in record.items() if k not in offline.TIMING_FIELDS}


def read_results(path):
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert lines[0]["format"] == offline.RESULTS_FORMAT
    return lines[0], lines[1:]


@pytest.fixture(scope="module")
def reference(tiny_target_folder, prompts_file):
    """Plain greedy decoding (`generate`) of every prompt on its own: the output to match."""

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.data.prompt_files import read_prompt_records
    from dspark_jax.engine.generate import generate

    target = load_target(tiny_target_folder)
    requests = [offline.Request(i, r, offline.prompt_sha256(r)) for i, r in enumerate(read_prompt_records(prompts_file))]
    offline.tokenize(DecodeSettings(max_new_tokens=10), target, requests)
    return {r.index: generate(target.params, target.config, [r.ids], max_new_tokens=10,
                              stop_ids=target.tokenizer.eos_token_ids).token_ids[0] for r in requests}


def test_continuous_plain_equals_static_and_single_prompt_greedy(capsys, tiny_target_folder, prompts_file, reference):
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none"]
    continuous, summary = decode_json(capsys, *args, "--max-batch", "3")
    static, static_summary = decode_json(capsys, *args, "--max-batch", "3", "--batching", "static")
    assert [r["index"] for r in continuous] == list(range(len(LINES)))  # input order on stdout
    assert tokens_by_index(continuous) == tokens_by_index(static) == reference
    for r in continuous:
        assert r["num_tokens"] == len(r["token_ids"]) and r["max_batch"] == 3
        assert r["request_wall_s"] > 0 and r["request_tokens_per_s"] > 0
        assert "tokens_per_s" not in r and "wall_s" not in r  # per-request rates only, named as such
    assert summary["decoded"] == summary["requests"] == len(LINES) and summary["skipped"] == 0
    assert summary["generated_tokens"] == sum(r["num_tokens"] for r in continuous)
    assert summary["aggregate_tokens_per_s"] > 0 and summary["batching"] == "continuous"
    assert static_summary["batching"] == "static"
    # --batch-size is the old name of --max-batch
    alias, _ = decode_json(capsys, *args, "--batch-size", "2")
    assert tokens_by_index(alias) == reference and alias[0]["max_batch"] == 2
    assert_one_line_error(decode.main, capsys, "--batch-size is the old name of --max-batch", *args,
                          "--batch-size", "2", "--max-batch", "3")


@pytest.mark.parametrize("scheduler", ["fixed", "dspark-async"])
def test_continuous_speculative_is_lossless(capsys, tiny_target_folder, tiny_drafter, prompts_file, reference,  # noqa: F811
                                            tmp_path, scheduler):
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", tiny_drafter,
            "--scheduler", scheduler, "--gamma", "3", "--max-batch", "3", "--sps-table", str(tmp_path / "sps.json"),
            "--profile-sps"]
    records, summary = decode_json(capsys, *args)
    assert [r["index"] for r in records] == list(range(len(LINES)))
    assert tokens_by_index(records) == reference
    for r in records:
        assert 1.0 <= r["acceptance_length"] <= 4.0 and r["rounds"] >= 1
        assert all(a <= b for a, b in zip(r["position_accepted"], r["position_reached"]))
        if scheduler == "fixed":
            assert r["verified_tokens"] == 3 * r["rounds"] and r["position_reached"][0] == r["rounds"]
    assert summary["scheduler"] == scheduler and summary["rounds"] == sum(r["rounds"] for r in records)
    assert 1.0 <= summary["mean_acceptance_length"] <= 4.0
    if scheduler == "fixed":  # static speculative batches and the plain comparison in the summary
        static, static_summary = decode_json(capsys, *args[:-1], "--batching", "static", "--compare-ar")
        assert tokens_by_index(static) == reference
        assert [without_timings(r) for r in static] == [without_timings(r) for r in records]
        assert static_summary["speedup"] > 0 and static_summary["ar_aggregate_tokens_per_s"] > 0


def test_length_groups(capsys, tiny_target_folder, prompts_file, reference, monkeypatch):
    """Prompts are grouped by KV-cache length (shortest first); stdout stays in input order."""
    lengths = [3, 60, 5, 61, 2, 200, 4]
    cache = lambda n: 64 if n < 50 else (128 if n < 100 else 256)  # noqa: E731
    assert offline.cache_groups(lengths, cache, slots=1) == [list(range(7))]  # < 8 per slot: merged
    monkeypatch.setattr(offline, "MIN_GROUP_PER_SLOT", 1)
    assert offline.cache_groups(lengths, cache, slots=2) == [[0, 2, 4, 6], [1, 3, 5]]  # the small last joins
    assert offline.cache_groups(lengths, cache, slots=1) == [[0, 2, 4, 6], [1, 3], [5]]

    import dspark_jax.engine.generate as generate_module

    served = []
    real_serve = generate_module.serve

    def spy(params, cfg, prompts, **kw):
        served.append(len(prompts))
        return real_serve(params, cfg, prompts, **kw)

    monkeypatch.setattr(generate_module, "serve", spy)
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none",
            "--max-batch", "2"]
    records, _ = decode_json(capsys, *args)
    assert served == [7, 2]  # the 64-position group, then the two long prompts
    assert [r["index"] for r in records] == list(range(len(LINES))) and tokens_by_index(records) == reference
    served.clear()
    decode_json(capsys, *args, "--no-length-groups")
    assert served == [len(LINES)]


def test_plain_serve_with_stops_equals_generate(tiny_target_folder):
    """Rows finish at different steps (a frequent token as the stop) and are refilled at once."""
    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.engine.generate import generate, serve

    target = load_target(tiny_target_folder)
    prompts = [target.tokenizer.chat_prompt_ids(x.get("prompt") or words(4, 3)) for x in LINES]
    first = generate(target.params, target.config, prompts[:1], max_new_tokens=12).token_ids[0]
    stop = [first[2]]
    want = [generate(target.params, target.config, [p], max_new_tokens=12, stop_ids=stop).token_ids[0]
            for p in prompts]
    assert len({len(w) for w in want}) > 1, "the stop token should end rows at different steps"
    seen = []
    got = serve(target.params, target.config, prompts, slots=3, max_new_tokens=12, stop_ids=stop,
                on_finish=lambda i, ids, stats: seen.append((i, ids)))
    assert got.token_ids == want and sorted(seen) == sorted(enumerate(want))


def test_output_resumes_after_a_torn_write(capsys, tiny_target_folder, prompts_file, tmp_path):
    """A kill mid-write leaves a torn last line: the rerun drops it and decodes only what is missing;
    the file ends with every prompt exactly once, the records those of an uninterrupted run."""
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none",
            "--max-batch", "2"]
    whole = tmp_path / "whole.jsonl"
    records, _ = decode_json(capsys, *args, "--output", str(whole))
    header, written = read_results(whole)
    assert sorted(r["index"] for r in written) == list(range(len(LINES)))
    assert [without_timings(r) for r in sorted(written, key=lambda r: r["index"])] == [
        without_timings(r) for r in records]
    assert header["settings"]["max_new_tokens"] == 10 and header["settings"]["drafter"] == "none"

    cut = tmp_path / "cut.jsonl"
    data = whole.read_bytes()
    lines = data.split(b"\n")
    keep = b"\n".join(lines[:4]) + b"\n" + lines[4][: len(lines[4]) // 2]  # header, 3 records, half a record
    cut.write_bytes(keep)
    resumed, summary = decode_json(capsys, *args, "--output", str(cut))
    assert summary["skipped"] == 3 and summary["decoded"] == len(LINES) - 3
    assert [r["index"] for r in resumed] == list(range(len(LINES)))  # stdout: the whole selection, in order
    _, again = read_results(cut)
    assert sorted(r["index"] for r in again) == list(range(len(LINES)))
    by_index = {r["index"]: without_timings(r) for r in written}
    assert {r["index"]: without_timings(r) for r in again} == by_index
    # Nothing left to do: nothing decoded, nothing appended.
    before = cut.read_bytes()
    _, summary = decode_json(capsys, *args, "--output", str(cut))
    assert summary["decoded"] == 0 and summary["skipped"] == len(LINES) and cut.read_bytes() == before
    code, out, _ = run_main(decode.main, capsys, *[a for a in args if a != "--json"], "--output", str(cut))
    assert code == 0 and "already in" in out

    # A header cut short is an empty file: a fresh start.
    cut.write_bytes(data[:30])
    decode_json(capsys, *args, "--output", str(cut), "--limit", "2")
    assert sorted(r["index"] for r in read_results(cut)[1]) == [0, 1]


def test_output_with_other_settings_or_prompts_is_an_error(capsys, tiny_target_folder, prompts_file, tmp_path):
    out = tmp_path / "out.jsonl"
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none",
            "--output", str(out), "--limit", "3"]
    decode_json(capsys, *args)
    before = out.read_bytes()
    assert_one_line_error(decode.main, capsys, "holds results of other settings (temperature 0.0 there, 0.5 now)",
                          *args, "--temperature", "0.5")
    assert_one_line_error(decode.main, capsys, "max_new_tokens 10 there, 11 now", *args, "--max-new-tokens", "11")
    changed = write_lines(tmp_path / "changed.jsonl", [LINES[0], {"prompt": "w9 w9"}] + LINES[2:])
    assert_one_line_error(decode.main, capsys, "out.jsonl:3: the result for prompt 1 was made from another prompt",
                          *[changed if a == prompts_file else a for a in args])
    assert out.read_bytes() == before
    other = tmp_path / "other.jsonl"
    other.write_text('{"some": "file"}\n')
    assert_one_line_error(decode.main, capsys, "not a results file", *args[:-4], "--output", str(other))
    assert_one_line_error(decode.main, capsys, "no such folder", *args[:-4], "--output",
                          str(tmp_path / "nope" / "x.jsonl"))
    # Execution choices are not settings: another --max-batch or --batching resumes the same file.
    records, summary = decode_json(capsys, *args[:-2], "--max-batch", "2", "--batching", "static")
    assert summary["skipped"] == 3 and summary["decoded"] == len(LINES) - 3


def test_limit_and_offset(capsys, tiny_target_folder, prompts_file, reference, tmp_path):
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE, "--drafter", "none"]
    records, summary = decode_json(capsys, *args, "--offset", "2", "--limit", "3")
    assert [r["index"] for r in records] == [2, 3, 4] and summary["requests"] == 3
    assert tokens_by_index(records) == {i: reference[i] for i in (2, 3, 4)}
    records, _ = decode_json(capsys, *args, "--offset", "7", "--limit", "10")
    assert [r["index"] for r in records] == [7, 8]
    # Windows of one file share one --output: indices are positions in the whole input.
    out = str(tmp_path / "w.jsonl")
    decode_json(capsys, *args, "--offset", "4", "--limit", "2", "--output", out)
    _, summary = decode_json(capsys, *args, "--limit", "6", "--output", out)
    assert summary["skipped"] == 2 and summary["decoded"] == 4
    assert sorted(r["index"] for r in read_results(out)[1]) == list(range(6))
    assert_one_line_error(decode.main, capsys, "--offset 9 skips all 9 prompts", *args, "--offset", "9")
    assert_one_line_error(decode.main, capsys, "--limit must be at least 1", *args, "--limit", "0")


def test_prompt_formats(capsys, tiny_target_folder, prompts_file, tmp_path):
    records, _ = decode_json(capsys, "--target", tiny_target_folder, "--prompts-file", prompts_file, *BASE,
                             "--drafter", "none", "--limit", "6")
    # <|im_start|> role(unk) content <|im_end|> per message, then <|im_start|> assistant(unk)
    assert records[2]["messages"] == LINES[2]["messages"] and "prompt" not in records[2]
    assert records[2]["prompt_token_ids"] == [1, 0, 4, 5, 2, 1, 0] + records[2]["prompt_token_ids"][7:]
    assert records[2]["prompt_token_ids"][-3:] == [2, 1, 0]
    assert records[5]["messages"] == [{"role": "user", "content": "w5 w6"}]  # text parts joined
    assert records[5]["prompt_token_ids"] == [1, 0, 8, 9, 2, 1, 0]
    assert records[1]["prompt"] == LINES[1]["turns"][0]  # turns: the first one
    assert records[0]["prompt"] == LINES[0]["prompt"]
    assert len({r["prompt_sha256"] for r in records}) == 6

    bad = tmp_path / "bad.jsonl"
    cases = [
        ('{"messages": "w1"}', "bad.jsonl:3: \"messages\" must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', "bad.jsonl:3: message 1 must be"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "bad.jsonl:3: message 1 must be"),
        ('{"prompt": "w1", "messages": []}', "bad.jsonl:3: more than one of prompt / messages / turns"),
        ('{"text": "w1"}', "bad.jsonl:3: no prompt; expected one of"),
        ('["w1"]', "bad.jsonl:3: no prompt"),
        ('{"prompt": ["w1"]}', 'bad.jsonl:3: "prompt" must be a string'),
        ('{"prompt": "w1"', "bad.jsonl:3: not valid JSON"),
        ('{"prompt": "   "}', "bad.jsonl:3: the prompt is empty"),
    ]
    for line, message in cases:
        bad.write_text('{"prompt": "w1"}\n\n' + line + "\n")
        assert_one_line_error(decode.main, capsys, message, "--target", tiny_target_folder, "--prompts-file",
                              str(bad), "--drafter", "none")
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
    assert_one_line_error(decode.main, capsys, 'bad.jsonl:1: a conversation ("messages") needs the chat template',
                          "--target", tiny_target_folder, "--prompts-file", str(bad), "--raw")
    # Message text that is not UTF-8 decodes with replacement, like every other prompt.
    bad.write_bytes(b'{"messages": [{"role": "user", "content": "w7 \xff w8"}]}\n')
    records, _ = decode_json(capsys, "--target", tiny_target_folder, "--prompts-file", str(bad), *BASE,
                             "--drafter", "none")
    assert records[0]["messages"][0]["content"] == "w7 \ufffd w8"
    # A prompt longer than the context names its line.
    bad.write_text(json.dumps({"prompt": "w1"}) + "\n" + json.dumps({"prompt": " ".join(["w3"] * 300)}) + "\n")
    assert_one_line_error(decode.main, capsys, "bad.jsonl:2: prompt of 305 tokens + 128 new tokens exceeds", "--target", tiny_target_folder,
                          "--prompts-file", str(bad), "--drafter", "none")


def test_killed_run_resumes(capsys, tiny_target_folder, tmp_path):
    """SIGKILL a real `decode --output` process mid-run, rerun: every prompt exactly once, and the
    records of an uninterrupted run."""
    many = write_lines(tmp_path / "many.jsonl", [{"prompt": words(1 + i % 9, i)} for i in range(150)])
    out = tmp_path / "out.jsonl"
    args = ["--target", tiny_target_folder, "--prompts-file", many, "--max-new-tokens", "24", "--drafter", "none",
            "--max-batch", "2", "--json"]
    proc = subprocess.Popen([sys.executable, "-m", "dspark_jax.decode", *args, "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 4:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=60)
    killed = proc.returncode == -signal.SIGKILL
    assert killed or proc.returncode == 0, proc.stderr.read().decode()
    _, before = read_results(out)
    assert len({r["index"] for r in before}) == len(before) >= 3
    _, summary = decode_json(capsys, *args, "--output", str(out))
    assert summary["skipped"] == len(before) and summary["decoded"] == 150 - len(before)
    _, after = read_results(out)
    assert sorted(r["index"] for r in after) == list(range(150))
    whole = tmp_path / "whole.jsonl"
    decode_json(capsys, *args, "--output", str(whole))
    assert {r["index"]: without_timings(r) for r in after} == {
        r["index"]: without_timings(r) for r in read_results(whole)[1]}
    if not killed:
        pytest.skip("the run finished before it could be killed (the resume was still checked)")
    assert os.path.getsize(out) > 0


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_requests_use_the_calibration_of_their_temperature(capsys, tiny_target_folder, tiny_drafter, prompts_file,  # noqa: F811
                                                           tmp_path, monkeypatch, batching):
    """A drafter calibrated greedy and at T = 1 decodes each request with the nearer calibration."""
    import jax

    from dspark_jax.drafters.checkpoint import load_drafter, save_drafter
    from dspark_jax.engine import speculative

    loaded = load_drafter(tiny_drafter)
    greedy, sampled = (0.5, 0.6, 0.7, 0.8), (1.5, 1.4, 1.3, 1.2)
    path = str(tmp_path / "calibrated")
    save_drafter(path, loaded.config, jax.device_get(loaded.params), sts_temperatures=sampled,
                 sts_by_temperature={0.0: greedy, 1.0: sampled})
    seen = []
    for name in ("speculative_generate", "speculative_serve"):
        real = getattr(speculative, name)

        def spy(*a, _real=real, **kw):
            seen.append(tuple(kw["temperatures"]))
            return _real(*a, **kw)

        monkeypatch.setattr(speculative, name, spy)
    args = ["--target", tiny_target_folder, "--prompts-file", prompts_file, "--limit", "2", *BASE,
            "--drafter", path, "--gamma", "3", "--scheduler", "fixed", "--batching", batching]
    for temperature, expected in (("0", greedy), ("0.8", sampled)):
        seen.clear()
        decode_json(capsys, *args, "--temperature", temperature)
        assert seen and set(seen) == {expected}


def test_the_flags_build_the_decode_settings():
    """Every flag sets its DecodeSettings field (type, default, choices from the field): no flags give
    the defaults; flags give the value the library takes (the old --batch-size is --max-batch)."""
    settings, processes = decode.parse_args([])
    assert settings == DecodeSettings() and not processes.distributed
    settings, _ = decode.parse_args(["--prompt", "a", "--prompt", "b", "--batch-size", "3", "--no-length-groups",
                                     "--plain-steps", "off", "--no-compare-ar", "--top-p", "0.5", "--raw"])
    assert settings == DecodeSettings(prompt=("a", "b"), max_batch=3, length_groups=False, plain_steps="off",
                                      compare_ar=False, top_p=0.5, raw=True)
    with pytest.raises(UserError, match="--top-p"):
        decode.parse_args(["--top-p", "0"])
    with pytest.raises(UserError, match="old name of --max-batch"):
        decode.parse_args(["--max-batch", "2", "--batch-size", "3"])
