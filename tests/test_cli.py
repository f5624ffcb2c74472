"""`python -m dspark_jax.decode`: JSON output, and one clear line + exit 2 for every bad input."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dspark_jax import decode
from cli_helpers import assert_one_line_error, run_main


def run(capsys, *argv):
    return run_main(decode.main, capsys, *argv)


def assert_fails(capsys, message, *argv):
    assert_one_line_error(decode.main, capsys, message, *argv)


def json_records(out):
    """The per-prompt objects of `decode --json` output (the last line is the summary)."""
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert list(lines[-1]) == ["summary"]
    return lines[:-1]


def test_json_output_on_tiny_target(capsys, tiny_target_folder):
    code, out, _ = run(capsys, "--target", tiny_target_folder, "--prompt", "w5 w6 w7", "--prompt", "w9",
                       "--max-new-tokens", "6", "--json")
    assert code == 0
    records = json_records(out)
    assert [r["prompt"] for r in records] == ["w5 w6 w7", "w9"] and [r["index"] for r in records] == [0, 1]
    # chat template applied: <|im_start|> user(unk) w5 w6 w7 <|im_end|> <|im_start|> assistant(unk)
    assert records[0]["prompt_token_ids"] == [1, 0, 8, 9, 10, 2, 1, 0]
    assert records[1]["prompt_token_ids"] == [1, 0, 12, 2, 1, 0]
    for r in records:
        assert r["num_tokens"] == len(r["token_ids"]) and 1 <= r["num_tokens"] <= 6
        assert r["request_wall_s"] > 0 and r["request_tokens_per_s"] > 0 and isinstance(r["text"], str)
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["requests"] == summary["decoded"] == 2 and summary["aggregate_tokens_per_s"] > 0
    assert summary["generated_tokens"] == sum(r["num_tokens"] for r in records)


def test_prompts_file(capsys, tiny_target_folder, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["w1 w2", "ignored second turn"]}) + "\n\n" + json.dumps({"turns": ["w3"]}) + "\n")
    code, out, _ = run(capsys, "--target", tiny_target_folder, "--prompts-file", str(f), "--max-new-tokens", "3",
                       "--json", "--raw")
    assert code == 0
    records = json_records(out)
    assert [r["prompt_token_ids"] for r in records] == [[4, 5], [6]]


def test_unknown_target_lists_known(capsys):
    from dspark_jax.checkpoints.registry import KNOWN_TARGETS

    assert_fails(capsys, f"unknown target 'nope': use one of {', '.join(sorted(KNOWN_TARGETS))}", "--target", "nope",
                 "--prompt", "hi")


def test_empty_prompt(capsys, tiny_target_folder):
    assert_fails(capsys, "prompt 2 is empty", "--target", tiny_target_folder, "--prompt", "w1", "--prompt", "  ")


def test_no_prompt(capsys):
    assert_fails(capsys, "give at least one --prompt", "--max-new-tokens", "4")


def test_missing_checkpoint_file(capsys, tmp_path):
    assert_fails(capsys, "missing.gguf", "--target", str(tmp_path / "missing.gguf"), "--prompt", "hi")
    assert_fails(capsys, "missing file", "--target", str(tmp_path), "--prompt", "hi")  # no config.json


def test_folder_without_weights(capsys, tiny_target_folder, tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(tiny_target_folder, folder)
    (folder / "model.safetensors").unlink()
    assert_fails(capsys, "no *.safetensors weights", "--target", str(folder), "--prompt", "w1")


def test_corrupt_safetensors(capsys, tiny_target_folder, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_target_folder, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_fails(capsys, "corrupt safetensors file", "--target", str(folder), "--prompt", "w1")


def test_corrupt_gguf(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    code, _, err = run(capsys, "--target", str(bad), "--prompt", "hi")
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err


def test_unsupported_architecture(capsys, tiny_target_folder, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_target_folder, folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert_fails(capsys, "unsupported architecture ['GPT2LMHeadModel']", "--target", str(folder), "--prompt", "w1")


def test_prompt_longer_than_context(capsys, tiny_target_folder):
    long_prompt = " ".join(["w3"] * 300)
    assert_fails(capsys, "exceeds the model's context of 256 tokens", "--target", tiny_target_folder,
                 "--prompt", long_prompt)


def test_bad_numbers(capsys):
    assert_fails(capsys, "--max-new-tokens must be at least 1", "--prompt", "x", "--max-new-tokens", "0")
    assert_fails(capsys, "0 < --top-p <= 1", "--prompt", "x", "--top-p", "0")


def test_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "dspark_jax.decode", "--target", "nope", "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    from dspark_jax.checkpoints.registry import KNOWN_TARGETS

    assert proc.stderr.strip().splitlines() == [
        f"error: unknown target 'nope': use one of {', '.join(sorted(KNOWN_TARGETS))}, a Hugging Face checkpoint "
        "folder or a .gguf file"]


@pytest.fixture(scope="module")
def tiny_drafter(tiny_target_folder, tmp_path_factory):
    import jax

    from dspark_jax.checkpoints.hf import load_hf_model
    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.drafters.config import DrafterConfig
    from dspark_jax.drafters.dspark import init_drafter_params

    tcfg, _ = load_hf_model(tiny_target_folder)
    dcfg = DrafterConfig(kind="dspark", num_layers=1, hidden_size=tcfg.hidden_size, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=64, vocab_size=tcfg.vocab_size, block_size=4, head="markov",
                         markov_rank=8, confidence=True, mask_token_id=0, target_layer_ids=(0, 1), target_name="tiny",
                         target_vocab_size=tcfg.vocab_size, target_hidden_size=tcfg.hidden_size,
                         target_num_layers=tcfg.num_layers)
    path = str(tmp_path_factory.mktemp("drafter") / "d")
    save_drafter(path, dcfg, jax.device_get(init_drafter_params(dcfg, jax.random.key(0), scale=0.5)))
    return path


def test_speculative_json_matches_plain_greedy(capsys, tiny_target_folder, tiny_drafter):
    args = ["--target", tiny_target_folder, "--prompt", "w5 w6 w7", "--prompt", "w9 w1", "--max-new-tokens", "12",
            "--json"]
    code, out, _ = run(capsys, *args)
    plain = json_records(out)
    code2, out2, err2 = run(capsys, *args, "--drafter", tiny_drafter, "--gamma", "3", "--scheduler", "fixed",
                            "--compare-ar")
    assert code == 0 and code2 == 0, err2
    spec = json_records(out2)
    assert json.loads(out2.strip().splitlines()[-1])["summary"]["speedup"] > 0  # --compare-ar: for the whole run
    assert len(plain) == len(spec) == 2
    for a, b in zip(plain, spec):
        assert a["token_ids"] == b["token_ids"]
        assert 1.0 <= b["acceptance_length"] <= 4.0 and b["rounds"] >= 1
        assert b["verified_tokens"] == 3 * b["rounds"]  # fixed scheduler: every round verifies gamma
        assert len(b["position_reached"]) == 3 and b["position_reached"][0] == b["rounds"]
        assert all(x <= y for x, y in zip(b["position_accepted"], b["position_reached"]))


def test_speculative_bad_input(capsys, tiny_target_folder, tiny_drafter):
    assert_fails(capsys, "--gamma 9 must be between 1 and the drafter's block size 4", "--target", tiny_target_folder,
                 "--prompt", "w1", "--drafter", tiny_drafter, "--gamma", "9")
    assert_fails(capsys, "no drafter checkpoint at", "--target", tiny_target_folder, "--prompt", "w1",
                 "--drafter", tiny_drafter + "-missing")
    assert_fails(capsys, "drafter was trained for target tiny", "--prompt", "w1", "--drafter", tiny_drafter)


@pytest.mark.parametrize("scheduler", ["dspark", "dspark-async", "mtp1"])
def test_confidence_schedulers_from_the_cli(capsys, tiny_target_folder, tiny_drafter, tmp_path, scheduler):
    """The dspark schedulers profile an SPS table (saved, then reused) and stay lossless."""
    table = tmp_path / "sps.json"
    base = ["--target", tiny_target_folder, "--prompt", "w5 w6 w7", "--prompt", "w9 w1", "--max-new-tokens", "10",
            "--json", "--batch-size", "2"]
    code, out, _ = run(capsys, *base)
    plain = [r["token_ids"] for r in json_records(out)]
    args = base + ["--drafter", tiny_drafter, "--scheduler", scheduler, "--sps-table", str(table), "--profile-sps"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert [r["token_ids"] for r in json_records(out)] == plain
    if scheduler.startswith("dspark"):
        saved = json.loads(table.read_text())
        assert saved["buckets"] == [1, 2, 4, 8, 10]
        code, out, err = run(capsys, *args[:-1])  # reuses the saved table
        assert code == 0, err


def test_auto_scheduler():
    from dspark_jax.engine.decode_settings import auto_scheduler
    from dspark_jax.drafters.config import DrafterConfig

    shape = dict(kind="dspark", num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                 intermediate_size=16, vocab_size=32)
    head = DrafterConfig(**shape, markov_rank=4, confidence=True)
    assert auto_scheduler(head, 1) == "dspark" and auto_scheduler(head, 8) == "dspark-async"
    assert auto_scheduler(DrafterConfig(**shape, head="none", confidence=False), 4) == "fixed"
