"""`python -m dspark_jax.calibrate` end to end on a tiny target and drafter."""

import json
import os

import jax

from dspark_jax import calibrate
from dspark_jax.checkpoints.hf import load_hf_model
from dspark_jax.drafters.checkpoint import load_drafter, save_drafter
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.drafters.dspark import init_drafter_params


def confident_drafter(tiny_target_folder, path: str, **metadata) -> str:
    """A random tiny DSpark drafter with a confidence head, saved at `path`."""
    tcfg, _ = load_hf_model(tiny_target_folder)
    dcfg = DrafterConfig(kind="dspark", num_layers=1, hidden_size=tcfg.hidden_size, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=64, vocab_size=tcfg.vocab_size, block_size=4,
                         head="markov", markov_rank=8, confidence=True, mask_token_id=0, target_layer_ids=(0, 1),
                         target_name="tiny", target_vocab_size=tcfg.vocab_size, target_hidden_size=tcfg.hidden_size,
                         target_num_layers=tcfg.num_layers)
    save_drafter(path, dcfg, jax.device_get(init_drafter_params(dcfg, jax.random.key(0), scale=0.5)), metadata=metadata)
    return path


def test_calibrate_stores_temperatures_and_writes_report(tiny_target_folder, tmp_path, capsys):
    path = confident_drafter(tiny_target_folder, str(tmp_path / "drafter"), recipe="random")
    code = calibrate.main(["--drafter", path, "--target", tiny_target_folder, "--sets", "gsm8k", "--limit", "6",
                           "--max-new-tokens", "24", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    loaded = load_drafter(path)
    assert loaded.sts_temperatures is not None and len(loaded.sts_temperatures) == 4
    assert list(loaded.sts_temperatures) == summary["temperatures"]
    assert loaded.metadata["recipe"] == "random" and loaded.metadata["calibration"]["rounds"] == summary["rounds"]
    report = json.load(open(os.path.join(path, "calibration", "report.json")))
    assert len(report["held_out_report"]["ece_raw"]) == 4
    assert open(os.path.join(path, "calibration", "reliability.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # --save-to writes a bf16 calibrated copy (how the shipped drafter is made) and leaves the source alone.
    shipped = str(tmp_path / "shipped")
    code = calibrate.main(["--drafter", path, "--target", tiny_target_folder, "--sets", "gsm8k", "--limit", "6",
                           "--max-new-tokens", "24", "--no-progress", "--save-to", shipped,
                           "--storage-dtype", "bfloat16", "--out", str(tmp_path / "report")])
    assert code == 0, capsys.readouterr().err
    copy = load_drafter(shipped)
    assert copy.storage_dtype == "bfloat16" and load_drafter(path).storage_dtype == "float32"
    assert copy.sts_temperatures == loaded.sts_temperatures  # same prompts and seed -> same rounds, same fit
    assert os.path.getsize(os.path.join(shipped, "drafter.safetensors")) < 0.6 * os.path.getsize(
        os.path.join(path, "drafter.safetensors"))


def test_calibrate_rejects_a_drafter_without_confidence(tiny_target_folder, tmp_path, capsys):
    tcfg, _ = load_hf_model(tiny_target_folder)
    dcfg = DrafterConfig(kind="dspark", num_layers=1, hidden_size=tcfg.hidden_size, num_heads=4, num_kv_heads=2,
                         head_dim=16, intermediate_size=64, vocab_size=tcfg.vocab_size, block_size=4, head="none",
                         confidence=False, mask_token_id=0, target_layer_ids=(0, 1), target_vocab_size=tcfg.vocab_size,
                         target_hidden_size=tcfg.hidden_size, target_num_layers=tcfg.num_layers)
    save_drafter(str(tmp_path / "d"), dcfg, jax.device_get(init_drafter_params(dcfg, jax.random.key(0))))
    assert calibrate.main(["--drafter", str(tmp_path / "d"), "--target", tiny_target_folder]) == 2
    assert "no confidence head" in capsys.readouterr().err


def test_calibrations_at_two_decoding_temperatures_are_kept_apart(tiny_target_folder, tmp_path, capsys):
    """Greedy and T = 1 rounds accept differently: each calibration is stored under its decoding
    temperature, a request uses the nearest, and recalibrating one temperature leaves the other."""
    path = confident_drafter(tiny_target_folder, str(tmp_path / "drafter"))
    fits = {}
    for temperature in ("0", "1", "0"):
        code = calibrate.main(["--drafter", path, "--target", tiny_target_folder, "--sets", "gsm8k", "--limit", "6",
                               "--max-new-tokens", "24", "--no-progress", "--temperature", temperature])
        out, err = capsys.readouterr()
        assert code == 0, err
        fits[float(temperature)] = tuple(json.loads(out.strip().splitlines()[-1])["temperatures"])
    loaded = load_drafter(path)
    assert set(loaded.sts_by_temperature) == {0.0, 1.0}
    assert loaded.sts_by_temperature == fits and fits[0.0] != fits[1.0]
    assert loaded.sts_for(0.0) == fits[0.0] and loaded.sts_for(1.0) == fits[1.0]
    assert loaded.sts_for(0.7) == fits[1.0] and loaded.sts_for(0.3) == fits[0.0]
    assert loaded.sts_temperatures == fits[0.0]  # the latest fit, for readers of one list
    assert set(loaded.metadata["calibrations"]) == {"0", "1"}
    assert loaded.metadata["calibrations"]["1"]["temperature"] == 1.0
