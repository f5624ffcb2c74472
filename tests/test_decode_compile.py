"""`decode --compile-for`: the speculative engine's programs compiled by the TPU compiler for a slice
from shapes alone (serving/decode_compile.py), on a tiny target and drafter."""

import importlib.util
import json

import jax
import pytest

from dspark_jax import decode

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason=f"libtpu is not installed: pip install 'jax[tpu]=={jax.__version__}' (the README's test command does)")

GAMMA = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A target folder holding only config.json, and a training config whose drafter section shapes a
    DSpark drafter for it."""
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    (folder / "config.json").write_text(json.dumps(dict(
        model_type="qwen3", vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, head_dim=32, intermediate_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=False)))
    config = folder / "dspark_tiny.yaml"
    config.write_text(json.dumps(dict(
        target=str(folder), drafter=dict(kind="dspark", num_layers=1, block_size=GAMMA, head="markov",
                                         markov_rank=32, confidence=True, mask_token_id=1023,
                                         target_layer_ids=[1, 3]),
        data=dict(train_dir="data/x"))))
    return str(folder), str(config)


def test_the_engine_s_programs_compile_for_a_tpu_slice(tiny, capsys):
    """Every program the engine runs at these settings, compiled for v5e-8's 8 chips with the target and
    the drafter split over them: each fits with its memory, its collectives (tensor parallelism's
    all-reduces), flops and HBM bytes per execution and its roofline time; a verify over more tokens
    costs more flops than one over fewer, and the round (a draft and the widest verify) more than its
    draft."""
    folder, config = tiny
    argv = ["--compile-for", "v5e-8", "--target", folder, "--drafter", config, "--dtype", "bfloat16",
            "--max-batch", "2", "--max-new-tokens", "16", "--compile-prompt-tokens", "20"]
    assert decode.main(argv + ["--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["compiled"]["topology"] == "v5e:2x4" and found["compiled"]["scheduler"] == "dspark-async"
    programs = {p["name"]: p for p in found["programs"]}
    buckets = [1, 2, 4, 2 * (GAMMA + 1)]
    assert list(programs) == (["prefill 2 x 32", "prefill 1 x 32", "plain step", "round", "draft"]
                              + [f"verify {n} tokens" for n in buckets])
    for p in programs.values():
        assert p["fits"] and 0 < p["per_chip_bytes"] < 1e9 and p["bytes_accessed"] > 0 and p["roofline_s"] > 0
        assert p["collectives"].get("all-reduce", 0) >= 1, p["name"]  # the row-split products' partial sums
    verify = [programs[f"verify {n} tokens"]["flops"] for n in buckets]
    assert verify == sorted(verify) and verify[0] < verify[-1]  # the pass costs what was scheduled
    assert programs["round"]["flops"] > max(programs["draft"]["flops"], verify[-1] - verify[0])
    assert programs["plain step"]["dynamic_loops"] >= 1  # a run of plain steps ends at a finished row
    assert decode.main(argv) == 0  # readable
    text = capsys.readouterr().out
    assert "compiled by the TPU compiler for v5e-8 (v5e:2x4: 8 chips" in text and "roofline ms" in text


def test_compile_for_needs_a_drafter_and_says_so(tiny, capsys):
    folder, _ = tiny
    assert decode.main(["--compile-for", "v5e-8", "--target", folder, "--drafter", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --compile-for compiles the speculative engine") and "\n" not in err
