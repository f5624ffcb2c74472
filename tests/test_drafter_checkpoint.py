"""Our drafter checkpoint folder: round trip, target check, corrupt/mismatched files, atomic writes."""

import json
import os

import jax
import numpy as np
import pytest

from dspark_jax.drafters.checkpoint import load_drafter, save_drafter
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.drafters.dspark import init_drafter_params
from dspark_jax.core.errors import UserError
from dspark_jax.models.config import ModelConfig

TARGET = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=8, intermediate_size=48, max_position_embeddings=128, qk_norm=True)
DCFG = DrafterConfig(kind="dspark", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=48, vocab_size=64, block_size=4, head="markov", markov_rank=4,
                     target_layer_ids=(0, 2), mask_token_id=63, target_name="tiny", target_vocab_size=64,
                     target_hidden_size=32, target_num_layers=4)


def test_round_trip_with_temperatures(tmp_path):
    params = jax.device_get(init_drafter_params(DCFG, jax.random.key(0)))
    path = str(tmp_path / "d")
    save_drafter(path, DCFG, params, sts_temperatures=[1.5, 1.2, 1.0, 0.9], metadata={"recipe": "test"})
    loaded = load_drafter(path, TARGET, "tiny")
    assert loaded.config == DCFG and loaded.sts_temperatures == (1.5, 1.2, 1.0, 0.9)
    assert loaded.metadata == {"recipe": "test"}
    for (pa, a), (pb, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                                jax.tree_util.tree_leaves_with_path(loaded.params)):
        assert pa == pb and np.array_equal(np.asarray(a), b)
    save_drafter(path, DCFG, params, dtype="bfloat16")  # overwrite in place, compact storage
    assert os.path.getsize(os.path.join(path, "drafter.safetensors")) < sum(np.asarray(a).nbytes for a in jax.tree.leaves(params)) * 0.6
    assert [f for f in os.listdir(path) if f.startswith(".")] == []  # no temporary leftovers
    assert os.stat(os.path.join(path, "drafter.safetensors")).st_mode & 0o044 == 0o044  # readable by others


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transposed_arrays_round_trip(tmp_path, dtype):
    """Arrays in Fortran order (a transpose, as loaders of [out, in] weights make) come back as they
    were, not as their memory read in C order."""
    params = jax.tree.map(np.asarray, jax.device_get(init_drafter_params(DCFG, jax.random.key(1))))
    params["fc"] = np.asfortranarray(params["fc"])
    assert not params["fc"].flags.c_contiguous
    save_drafter(str(tmp_path / "d"), DCFG, params, dtype=dtype)
    loaded = load_drafter(str(tmp_path / "d"), TARGET, "tiny")
    want = params["fc"] if dtype == "float32" else params["fc"].astype(jax.numpy.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(loaded.params["fc"], np.float32), want)


def test_wrong_target_is_a_clear_error(tmp_path):
    save_drafter(str(tmp_path / "d"), DCFG, jax.device_get(init_drafter_params(DCFG, jax.random.key(0))))
    with pytest.raises(UserError, match="drafter was trained for target tiny"):
        load_drafter(str(tmp_path / "d"), TARGET.replace(vocab_size=65))


def test_missing_corrupt_and_mismatched(tmp_path):
    with pytest.raises(UserError, match="no drafter checkpoint"):
        load_drafter(str(tmp_path / "nothing"))
    path = tmp_path / "d"
    save_drafter(str(path), DCFG, jax.device_get(init_drafter_params(DCFG, jax.random.key(0))))
    meta = json.loads((path / "drafter.json").read_text())
    meta["config"]["markov_rank"] = 5
    (path / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="do not match its config"):
        load_drafter(str(path))
    (path / "drafter.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="corrupt drafter weights"):
        load_drafter(str(path))
    (path / "drafter.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt drafter metadata"):
        load_drafter(str(path))


def test_calibrations_per_decoding_temperature(tmp_path):
    params = jax.device_get(init_drafter_params(DCFG, jax.random.key(0)))
    path = str(tmp_path / "d")
    greedy, sampled = (0.8, 0.9, 1.0, 1.1), (1.5, 1.2, 1.0, 0.9)
    save_drafter(path, DCFG, params, sts_temperatures=sampled, sts_by_temperature={0.0: greedy, 1.0: sampled})
    loaded = load_drafter(path)
    assert loaded.sts_by_temperature == {0.0: greedy, 1.0: sampled}
    assert [loaded.sts_for(t) for t in (0.0, 0.2, 0.6, 1.0, 1.5)] == [greedy, greedy, sampled, sampled, sampled]
    assert loaded.calibrated_at(0.0) == 0.0 and loaded.calibrated_at(0.9) == 1.0
    save_drafter(path, DCFG, params, sts_temperatures=sampled)  # one list (drafters calibrated before): every request
    loaded = load_drafter(path)
    assert loaded.calibrated_at(0.0) is None and loaded.sts_for(0.0) == loaded.sts_for(1.0) == sampled
    meta = json.load(open(os.path.join(path, "drafter.json")))
    meta["sts_by_temperature"] = {"greedy": [1.0]}
    json.dump(meta, open(os.path.join(path, "drafter.json"), "w"))
    with pytest.raises(UserError, match="corrupt sts_by_temperature"):
        load_drafter(path)


@pytest.mark.parametrize("stored,target_dtype,want", [("float32", "float32", "float32"),
                                                      ("bfloat16", "float32", "bfloat16"),
                                                      ("float32", "bfloat16", "bfloat16")])
def test_a_drafter_decodes_in_the_narrower_of_its_storage_and_the_target_dtype(tmp_path, stored, target_dtype, want):
    """A bf16-stored drafter decodes in bf16 beside an fp32 target (its exact values, half the bytes
    per pass), in the decoding layout, with the bf16 copy of the target's head; fp32 stays fp32."""
    import types

    import jax.numpy as jnp

    from dspark_jax.models import decoder

    path = str(tmp_path / "d")
    save_drafter(path, DCFG, jax.device_get(init_drafter_params(DCFG, jax.random.key(0))), dtype=stored)
    loaded = load_drafter(path, TARGET, "tiny")
    target_params = jax.tree.map(lambda a: a.astype(target_dtype), decoder.init_params(TARGET, jax.random.key(1)))
    target = types.SimpleNamespace(weight_dtype=target_dtype, params=target_params, config=TARGET)
    assert loaded.decoding_dtype(target) == want
    params = loaded.decoding_params(target)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(want)}
    assert decoder.layout_of(params) == decoder.default_layout()
    assert ("draft_head" in params) == (want == "bfloat16" and target_dtype == "float32")
