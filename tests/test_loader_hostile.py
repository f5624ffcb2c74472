"""Files are never trusted for sizes: hostile checkpoints fail with one UserError, fast and small.

A config.json or GGUF metadata that claims a huge model, or a header that lies about its tensors,
must be caught by comparing the claims against the tensors' header shapes before anything is
allocated. Every test here builds a tiny checkpoint, mutates it, and checks that loading gives one
clear `UserError` (the CLIs print it as a single `error:` line, exit 2) while the memory traced
during the attempt stays far below the claimed sizes. The property-based tests mutate configs,
safetensors headers and GGUF metadata at random and accept only a correctly shaped load or a
UserError.
"""

import json
import os
import shutil
import struct
import tempfile
import tracemalloc

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from dspark_jax.checkpoints.gguf import load_gguf_model
from dspark_jax.checkpoints.hf import load_hf_model
from dspark_jax.core.errors import UserError
from dspark_jax.models.decoder import param_shapes

MIB = 1 << 20
# The tiny checkpoints hold < 0.5 MiB of weights; a load (or a refusal) may trace a few MiB.
# Anything that sized an array by a hostile claim would trace gigabytes.
PEAK_LIMIT = 64 * MIB
# HOSTILE_EXAMPLES=1000 HOSTILE_RANDOM=1 for a longer, fresh search.
PROPERTY = settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", 40)), deadline=None,
                    derandomize=not os.environ.get("HOSTILE_RANDOM"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------ helpers


def traced_peak(fn):
    """(result or the UserError raised, peak bytes traced while `fn` ran)."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except UserError as e:
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refused(fn, match: str | None = None) -> UserError:
    """Assert `fn` raises a one-line UserError (matching `match`) with a small traced peak."""
    out, peak = traced_peak(fn)
    assert isinstance(out, UserError), f"loaded instead of refusing: {type(out)}"
    message = str(out)
    assert "\n" not in message, message
    if match is not None:
        import re

        assert re.search(match, message), message
    assert peak < PEAK_LIMIT, f"traced {peak / MIB:.0f} MiB before refusing: {message}"
    return out


def loads_or_refuses(fn) -> None:
    """The property: a load gives params of exactly the shapes its config claims, or a UserError;
    never another exception, never a big allocation."""
    out, peak = traced_peak(fn)
    assert peak < PEAK_LIMIT, f"traced {peak / MIB:.0f} MiB"
    if isinstance(out, UserError):
        assert "\n" not in str(out)
        note("refused")
        return
    note("loaded")
    cfg, params = out[0], out[1]
    want = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    have = [tuple(a.shape) for a in jax.tree.leaves(params)]
    assert have == [tuple(s) for s in want]


def note(outcome: str) -> None:
    """Count outcomes for --hypothesis-show-statistics (the mix shows the search reaches both)."""
    if currently_in_test_context():
        from hypothesis import event

        event(outcome)


def copy_folder(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(path, "w") as f:
        json.dump(cfg, f)


_DROP = object()


def read_safetensors(path: str) -> tuple[dict, bytes]:
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: str, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def gguf_scalars(path: str) -> dict[str, tuple[int, np.dtype]]:
    """Metadata key -> (byte offset of its value, numpy type) for every integer scalar field."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out = {}
    for key, field in reader.fields.items():
        value = field.parts[-1]
        if len(field.parts) == 4 and value.dtype.kind in "iu" and value.size == 1:
            out[key] = (field.offset + sum(int(p.nbytes) for p in field.parts[:-1]), value.dtype)
    return out


def patch_gguf(path: str, key: str, value: int) -> None:
    offset, dtype = gguf_scalars(path)[key]
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.asarray(value).astype(dtype).tobytes())


def tensor_data_start(path: str) -> int:
    from gguf import GGUFReader

    return GGUFReader(path).data_offset


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def hf_folder(tiny_target_folder):
    """The tiny Llama folder (config.json, model.safetensors, tokenizer)."""
    return tiny_target_folder


@pytest.fixture(scope="module")
def gguf_file(tiny_hf_model, tmp_path_factory):
    from test_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, tiny_hf_model("llama")[1])
    return str(path)


def test_untouched_checkpoints_load(hf_folder, gguf_file):
    loads_or_refuses(lambda: load_hf_model(hf_folder))
    loads_or_refuses(lambda: load_gguf_model(gguf_file))
    assert not isinstance(traced_peak(lambda: load_gguf_model(gguf_file))[0], UserError)


# ------------------------------------------------------------------ Hugging Face folders


def test_huge_claimed_model_is_refused_before_allocating(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "huge")
    edit_config(folder, vocab_size=4_000_000, hidden_size=65536)
    refused(lambda: load_hf_model(folder),
            r"model\.safetensors: (lm_head|model\.embed_tokens)\.weight is \[128, 64\] but config\.json "
            r"claims vocab_size 4000000 x hidden_size 65536$")


def test_huge_claim_through_the_cli_is_one_error_line(hf_folder, tmp_path, capsys):
    from dspark_jax import decode

    folder = copy_folder(hf_folder, tmp_path / "huge")
    edit_config(folder, vocab_size=4_000_000, hidden_size=65536)
    out, peak = traced_peak(lambda: decode.main(["--target", folder, "--prompt", "hi", "--drafter", "none"]))
    err = capsys.readouterr().err
    assert out == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "claims vocab_size 4000000" in lines[0], err
    assert "Traceback" not in err
    assert peak < PEAK_LIMIT


@pytest.mark.parametrize("layers, match", [
    (40, r"config\.json claims num_hidden_layers 40 but the weights have no layers/\w+ for layers 3-39"),
    (100_000_000, r"claims num_hidden_layers 100000000 but the weights have no layers/\w+ for layers 3-"),
    (2, r"model\.layers\.2\.\S+ is for layer 2 but config\.json claims num_hidden_layers 2"),
])
def test_layer_count_must_match_the_file(hf_folder, tmp_path, layers, match):
    folder = copy_folder(hf_folder, tmp_path / "layers")
    edit_config(folder, num_hidden_layers=layers)
    refused(lambda: load_hf_model(folder), match)


@pytest.mark.parametrize("changes, match", [
    # head_dim 32: k/v projections of 2 * 32 rows where the file has 32
    (dict(num_attention_heads=2, num_key_value_heads=2, head_dim=_DROP),
     r"k_proj\.weight is \[32, 64\] but config\.json claims \(num_key_value_heads 2 \* head_dim 32\) x hidden_size 64"),
    (dict(num_attention_heads=4, num_key_value_heads=3), r"num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(num_attention_heads=0), r"num_attention_heads must be a positive integer, got 0"),
    (dict(num_attention_heads=6, head_dim=_DROP), r"hidden_size 64 is not a multiple of num_attention_heads 6"),
    (dict(head_dim=2**40), r"_proj\.weight is \[\d+, 64\] but config\.json claims \(num_\w+ \d \* head_dim 1099511627776\)"),
    (dict(intermediate_size=96 * 1000), r"mlp\.\w+_proj\.weight is \[\d+, \d+\] but config\.json claims"),
])
def test_inconsistent_shapes_and_heads(hf_folder, tmp_path, changes, match):
    folder = copy_folder(hf_folder, tmp_path / "heads")
    edit_config(folder, **changes)
    refused(lambda: load_hf_model(folder), match)


@pytest.mark.parametrize("value", ["lots", -5, 0, 64.5, True, None, [64], {"a": 1}, 2**80])
def test_non_numeric_or_negative_sizes(hf_folder, tmp_path, value):
    folder = copy_folder(hf_folder, tmp_path / "value")
    edit_config(folder, hidden_size=value)
    refused(lambda: load_hf_model(folder), r"hidden_size")


@pytest.mark.parametrize("changes", [dict(rms_norm_eps="tiny"), dict(rms_norm_eps=float("nan")),
                                     dict(rope_parameters={"rope_theta": -1.0, "rope_type": "default"}),
                                     dict(rope_parameters=[1, 2]), dict(architectures=[["x"]], model_type=["y"]),
                                     dict(vocab_size=_DROP)])
def test_malformed_config_values(hf_folder, tmp_path, changes):
    folder = copy_folder(hf_folder, tmp_path / "value")
    edit_config(folder, **changes)
    refused(lambda: load_hf_model(folder))


def test_config_that_is_not_an_object(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "list")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump([1, 2, 3], f)
    refused(lambda: load_hf_model(folder), "expected a JSON object")


@pytest.mark.parametrize("keep", [0, 4, 100, 5000, 200_000, -1])
def test_truncated_safetensors(hf_folder, tmp_path, keep):
    folder = copy_folder(hf_folder, tmp_path / "cut")
    weights = os.path.join(folder, "model.safetensors")
    raw = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(raw[:keep])
    refused(lambda: load_hf_model(folder), r"corrupt safetensors file .*model\.safetensors")


def test_truncated_safetensors_names_the_cut(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "cut")
    weights = os.path.join(folder, "model.safetensors")
    raw = open(weights, "rb").read()
    open(weights, "wb").write(raw[:-1000])
    refused(lambda: load_hf_model(folder), r"truncated file\?\)$")


@pytest.mark.parametrize("mutate, match", [
    (lambda h: b"\xff" * 64, "not valid JSON"),
    (lambda h: json.dumps([1, 2]).encode(), "not a JSON object"),
    (lambda h: json.dumps({**h, "model.norm.weight": "x"}).encode(), "model.norm.weight"),
    (lambda h: json.dumps({**h, "model.norm.weight": {**h["model.norm.weight"], "dtype": "Q9"}}).encode(),
     "unknown dtype"),
    (lambda h: json.dumps({**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [4_000_000, 65536]}}).encode(),
     "needs 1048576000000 bytes"),
    (lambda h: json.dumps({**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [-64]}}).encode(),
     "invalid shape"),
    (lambda h: json.dumps({**h, "model.norm.weight": {**h["model.norm.weight"],
                                                      "data_offsets": [0, 2**62]}}).encode(), "data_offsets"),
])
def test_garbage_header(hf_folder, tmp_path, mutate, match):
    folder = copy_folder(hf_folder, tmp_path / "header")
    weights = os.path.join(folder, "model.safetensors")
    header, data = read_safetensors(weights)
    text = mutate(header)
    with open(weights, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)
    refused(lambda: load_hf_model(folder), match)


def test_header_length_beyond_the_file(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "length")
    weights = os.path.join(folder, "model.safetensors")
    raw = open(weights, "rb").read()
    open(weights, "wb").write(struct.pack("<Q", 2**60) + raw[8:])
    refused(lambda: load_hf_model(folder), "header claims 1152921504606846976 bytes")


def _resave(folder: str, edit) -> None:
    from safetensors.numpy import load_file, save_file

    weights = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)


def test_missing_tensor(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "missing")
    _resave(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    refused(lambda: load_hf_model(folder), r"claims num_hidden_layers 3 but the weights have no layers/w_up for layers 1$")
    folder = copy_folder(hf_folder, tmp_path / "missing2")
    _resave(folder, lambda t: t.pop("model.norm.weight"))
    refused(lambda: load_hf_model(folder), "does not set parameter final_norm$")


def test_unexpected_tensor_or_dtype(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "extra")
    _resave(folder, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight":
                                        t["model.layers.0.mlp.gate_proj.weight"].astype(np.int32)}))
    refused(lambda: load_hf_model(folder), r"gate_proj\.weight' has dtype I32, expected a float type")
    folder = copy_folder(hf_folder, tmp_path / "extra2")
    _resave(folder, lambda t: t.update({"model.surprise.weight": np.zeros(3, np.float32)}))
    refused(lambda: load_hf_model(folder), "unexpected tensor 'model.surprise.weight'")


def test_bad_shard_index(hf_folder, tmp_path):
    folder = copy_folder(hf_folder, tmp_path / "index")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": 7}}, f)
    refused(lambda: load_hf_model(folder), "weight_map")


# ------------------------------------------------------------------ GGUF files


@pytest.mark.parametrize("key, value, match", [
    ("llama.block_count", 40, r"its metadata claims llama\.block_count 40 but the weights have no layers/\w+ for layers 3-39"),
    ("llama.block_count", 2**31, r"claims llama\.block_count 2147483648"),
    ("llama.embedding_length", 65536,
     r"token_embd\.weight is \[128, 64\] but its metadata claims tokenizer\.ggml\.tokens count 128 x "
     r"llama\.embedding_length 65536$"),
    ("llama.feed_forward_length", 2**32 - 1, r"llama\.feed_forward_length 4294967295"),
    ("llama.attention.head_count", 0, r"llama\.attention\.head_count must be a positive integer, got 0"),
    ("llama.attention.head_count_kv", 3, r"head_count 4 is not a multiple of llama\.attention\.head_count_kv 3"),
    ("llama.attention.key_length", 2**30, "value_length differs"),
])
def test_lying_gguf_metadata(gguf_file, tmp_path, key, value, match):
    path = str(tmp_path / "lying.gguf")
    shutil.copy(gguf_file, path)
    patch_gguf(path, key, value)
    refused(lambda: load_gguf_model(path), match)


def test_absurd_head_dim(gguf_file, tmp_path):
    path = str(tmp_path / "head_dim.gguf")
    shutil.copy(gguf_file, path)
    for key in ("llama.attention.key_length", "llama.attention.value_length", "llama.rope.dimension_count"):
        patch_gguf(path, key, 2**31)
    refused(lambda: load_gguf_model(path), r"attn_q\.weight is \[64, 64\] but its metadata claims "
                                           r"\(llama\.attention\.head_count 4 \* llama\.attention\.key_length 2147483648\)")


def test_lying_gguf_through_the_cli(gguf_file, tmp_path, capsys):
    from dspark_jax import decode

    path = str(tmp_path / "lying.gguf")
    shutil.copy(gguf_file, path)
    patch_gguf(path, "llama.embedding_length", 65536)
    assert decode.main(["--target", path, "--prompt", "hi", "--drafter", "none"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "llama.embedding_length 65536" in lines[0], err


@pytest.mark.parametrize("cut", [1000, 50_000, 200_000])
def test_truncated_gguf_tensor_data(gguf_file, tmp_path, cut):
    path = str(tmp_path / "cut.gguf")
    raw = open(gguf_file, "rb").read()
    open(path, "wb").write(raw[:-cut])
    refused(lambda: load_gguf_model(path), r"corrupt GGUF file .* \(truncated file\?\)$")


def _find_array_count(path: str, key: str) -> int:
    """Byte offset of the element count of metadata array `key`."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields[key]
    return field.offset + 8 + len(key) + 4 + 4  # key length, key, value type, element type


@pytest.mark.parametrize("count", [2**40, 2**64 - 1, 3_000_000])
def test_absurd_gguf_array_length(gguf_file, tmp_path, count):
    path = str(tmp_path / "array.gguf")
    shutil.copy(gguf_file, path)
    offset = _find_array_count(path, "tokenizer.ggml.token_type")  # an int32 array
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<Q", count))
    refused(lambda: load_gguf_model(path), "corrupt GGUF file")


def test_absurd_gguf_counts(gguf_file, tmp_path):
    path = str(tmp_path / "counts.gguf")
    raw = bytearray(open(gguf_file, "rb").read())
    raw[8:16] = struct.pack("<Q", 2**50)  # tensor count
    open(path, "wb").write(bytes(raw))
    refused(lambda: load_gguf_model(path), "more than its")


# ------------------------------------------------------------------ drafter checkpoints


@pytest.fixture(scope="module")
def drafter_folder(tmp_path_factory):
    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.drafters.config import DrafterConfig
    from dspark_jax.drafters.dspark import init_drafter_params

    cfg = DrafterConfig(kind="dspark", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=48, vocab_size=64, block_size=4, head="markov", markov_rank=4,
                        target_layer_ids=(0, 2), mask_token_id=63, target_name="tiny", target_vocab_size=64,
                        target_hidden_size=32, target_num_layers=4)
    path = str(tmp_path_factory.mktemp("drafter") / "d")
    save_drafter(path, cfg, jax.device_get(init_drafter_params(cfg, jax.random.key(0))))
    return path


def _edit_drafter_json(folder: str, **changes) -> None:
    path = os.path.join(folder, "drafter.json")
    meta = json.load(open(path))
    meta["config"].update(changes)
    json.dump(meta, open(path, "w"))


def test_drafter_json_claiming_a_huge_model(drafter_folder, tmp_path):
    from dspark_jax.drafters.checkpoint import load_drafter

    folder = copy_folder(drafter_folder, tmp_path / "d")
    _edit_drafter_json(folder, vocab_size=4_000_000, target_vocab_size=4_000_000, hidden_size=65536,
                       target_hidden_size=65536)
    refused(lambda: load_drafter(folder), "do not match its config")


def test_drafter_weights_truncated_or_odd(drafter_folder, tmp_path):
    from safetensors.numpy import load_file, save_file

    from dspark_jax.drafters.checkpoint import load_drafter

    folder = copy_folder(drafter_folder, tmp_path / "d")
    weights = os.path.join(folder, "drafter.safetensors")
    raw = open(weights, "rb").read()
    open(weights, "wb").write(raw[:-100])
    refused(lambda: load_drafter(folder), r"corrupt drafter weights .*truncated file")
    open(weights, "wb").write(raw)
    tensors = load_file(weights)
    tensors["fc"] = tensors["fc"].astype(np.int16)
    save_file(tensors, weights)
    refused(lambda: load_drafter(folder), r"not floating point: fc \(I16\)")


def test_deepspec_config_claiming_a_huge_model(tmp_path):
    from dspark_jax.drafters.deepspec import load_deepspec_drafter

    fixture = os.path.join(os.path.dirname(__file__), "fixtures", "deepspec")
    folder = tmp_path / "ds"
    folder.mkdir()
    shutil.copy(os.path.join(fixture, "dspark_markov.safetensors"), folder / "model.safetensors")
    config = json.load(open(os.path.join(fixture, "dspark_markov_config.json")))
    config.update(intermediate_size=4_000_000)
    json.dump(config, open(folder / "config.json", "w"))
    refused(lambda: load_deepspec_drafter(str(folder)),
            r"mlp\.\w+_proj\.weight is \[\d+, \d+\] but config\.json claims .*intermediate_size 4000000")
    config.update(hidden_size=65536, vocab_size=4_000_000)
    json.dump(config, open(folder / "config.json", "w"))
    refused(lambda: load_deepspec_drafter(str(folder)), r"(config\.json claims|expected .* by config\.json)")
    config.update(hidden_size=64, vocab_size=256, intermediate_size=128, markov_rank="eight")
    json.dump(config, open(folder / "config.json", "w"))
    refused(lambda: load_deepspec_drafter(str(folder)), "markov_rank must be an integer")
    config.update(markov_rank=8, num_hidden_layers=50)
    json.dump(config, open(folder / "config.json", "w"))
    refused(lambda: load_deepspec_drafter(str(folder)), r"claims num_hidden_layers 50 but the weights have no")


# ------------------------------------------------------------------ properties

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
               "tie_word_embeddings", "architectures", "model_type", "rope_scaling", "attention_bias"]
JSON_VALUES = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 64, 96, 128, 4_000_000, 65536, 2**31, 2**63]),
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4),
    st.none(), st.booleans(), st.lists(st.integers(-3, 70), max_size=3),
    st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "factor", "type"]),
                    st.one_of(st.integers(-2, 10), st.text(max_size=6), st.sampled_from(["llama3", "default"])),
                    max_size=3))


@PROPERTY
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, min_size=1, max_size=3))
def test_property_config_values(hf_folder, changes):
    with tempfile.TemporaryDirectory() as tmp:
        folder = copy_folder(hf_folder, os.path.join(tmp, "m"))
        edit_config(folder, **changes)
        loads_or_refuses(lambda: load_hf_model(folder))


HEADER_VALUES = st.one_of(
    st.lists(st.integers(-2, 200), max_size=3), st.lists(st.sampled_from([1, 32, 64, 96, 128, 2**40]), max_size=3),
    st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "BOOL", "F64", "junk", ""]), st.integers(-5, 2**62),
    st.none(), st.lists(st.integers(-10, 500_000), min_size=2, max_size=2), st.text(max_size=3))


@PROPERTY
@given(which=st.integers(0, 10_000), field=st.sampled_from(["shape", "dtype", "data_offsets", None]),
       value=HEADER_VALUES, index=st.integers(0, 2))
def test_property_safetensors_header(hf_folder, which, field, value, index):
    with tempfile.TemporaryDirectory() as tmp:
        folder = copy_folder(hf_folder, os.path.join(tmp, "m"))
        weights = os.path.join(folder, "model.safetensors")
        header, data = read_safetensors(weights)
        names = sorted(header)
        name = names[which % len(names)]
        if field is None:
            header[name] = value  # the whole entry replaced
        elif isinstance(header[name], dict) and isinstance(header[name].get(field), list) and isinstance(value, int):
            entry = list(header[name][field])
            if entry:
                entry[index % len(entry)] = value  # one number of a shape or the offsets
            header[name][field] = entry
        elif isinstance(header[name], dict):
            header[name][field] = value
        write_safetensors(weights, header, data)
        loads_or_refuses(lambda: load_hf_model(folder))


@PROPERTY
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_property_truncated_safetensors(hf_folder, fraction):
    with tempfile.TemporaryDirectory() as tmp:
        folder = copy_folder(hf_folder, os.path.join(tmp, "m"))
        weights = os.path.join(folder, "model.safetensors")
        raw = open(weights, "rb").read()
        open(weights, "wb").write(raw[:int(fraction * len(raw))])
        refused(lambda: load_hf_model(folder))


GGUF_INTS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 16, 64, 96, 128, 65536, 2**31, 2**32 - 1]),
                      st.integers(0, 2**32 - 1))


@PROPERTY
@given(which=st.integers(0, 10_000), value=GGUF_INTS)
def test_property_gguf_metadata_integers(gguf_file, which, value):
    keys = sorted(k for k in gguf_scalars(gguf_file) if not k.startswith("GGUF."))
    key = keys[which % len(keys)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        shutil.copy(gguf_file, path)
        patch_gguf(path, key, value)
        loads_or_refuses(lambda: load_gguf_model(path))


@PROPERTY
@given(position=st.integers(0, 10**9), byte=st.integers(0, 255))
def test_property_gguf_header_bytes(gguf_file, position, byte):
    """Any byte of the header (metadata and tensor infos) overwritten."""
    raw = bytearray(open(gguf_file, "rb").read())
    raw[position % tensor_data_start(gguf_file)] = byte
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        open(path, "wb").write(bytes(raw))
        loads_or_refuses(lambda: load_gguf_model(path))


@PROPERTY
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_property_truncated_gguf(gguf_file, fraction):
    raw = open(gguf_file, "rb").read()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        open(path, "wb").write(raw[:int(fraction * len(raw))])
        loads_or_refuses(lambda: load_gguf_model(path))
