"""Export to the reference (DeepSpec) checkpoint layout: the reference fixture round-trips exactly
(names, shapes, values, config.json), our drafters export and read back to the same parameters and
the same draft / confidence logits, bf16 storage, the shipped drafter, inexpressible drafters and bad
command lines are one-line errors, and the output folder appears atomically."""

import dataclasses
import json
import os
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from cli_helpers import assert_one_line_error, run_main
from dspark_jax import export
from dspark_jax.checkpoints import registry
from dspark_jax.checkpoints.hf import GEMMA3_HF_NAMES, HF_NAMES, load_hf_model, read_json, safetensors_header
from dspark_jax.drafters import deepspec, dspark, eagle3
from dspark_jax.drafters.checkpoint import load_drafter, save_drafter
from dspark_jax.drafters.export import export_drafter, whole_vocabulary
from dspark_jax.core.errors import UserError

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "deepspec")
TARGET_DIR = os.path.join(FIXTURE, "target")
VARIANTS = ("dspark_markov", "dspark_rnn", "dflash", "eagle3")

train_forward = jax.jit(dspark.train_forward, static_argnums=(1, 3))
eagle3_forward = jax.jit(eagle3.eagle3_train_forward, static_argnames=("dcfg", "target_cfg", "steps"))


@pytest.fixture(scope="module")
def target():
    return load_hf_model(TARGET_DIR)


@pytest.fixture(scope="module")
def inputs():
    out = dict(np.load(os.path.join(FIXTURE, "inputs.npz")))
    out["eagle3_taps"] = np.load(os.path.join(FIXTURE, "eagle3_inputs.npz"))["target_hidden_states"]
    return out


def load_variant(variant, target):
    tcfg, tparams = target
    return deepspec.load_deepspec_drafter(os.path.join(FIXTURE, f"{variant}.safetensors"),
                                          os.path.join(FIXTURE, f"{variant}_config.json"),
                                          target_cfg=tcfg, target_params=tparams)


def load_variant_cfg(variant):
    """A fixture variant's DrafterConfig from its config.json alone (the format its architecture names)."""
    path = os.path.join(FIXTURE, f"{variant}_config.json")
    _, fmt = deepspec._format_for(read_json(path), path)
    return fmt.config_from_json(read_json(path), path)


def forward(dcfg, params, target, inputs):
    """Our training forward on the fixture's rows: draft (and confidence) logits."""
    tcfg, tparams = target
    if dcfg.kind == "eagle3":
        out = eagle3_forward(params, dcfg=dcfg, target_params=tparams, target_cfg=tcfg,
                             input_ids=inputs["input_ids"], loss_mask=inputs["loss_mask"],
                             ctx_features=inputs["eagle3_taps"],
                             target_last_hidden=inputs["target_last_hidden_states"], steps=3)
        return {"draft_logits": np.asarray(out["draft_logits"])}
    B, S = inputs["input_ids"].shape
    batch = dict(tokens=inputs["input_ids"].astype(np.int32),
                 positions=np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)),
                 segment_ids=np.ones((B, S), np.int32), loss_mask=inputs["loss_mask"] > 0.5,
                 block_start=inputs["anchor_positions"].astype(np.int32), block_valid=inputs["block_keep_mask"])
    out = train_forward(params, dcfg, tparams, tcfg, batch, inputs["target_hidden_states"],
                        inputs["target_last_hidden_states"])
    return {k: np.asarray(out[k]) for k in ("draft_logits", "confidence_logits") if k in out}


def assert_same_params(a, b):
    flat_a, flat_b = (jax.tree_util.tree_leaves_with_path(t) for t in (a, b))
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=str(path))


# --------------------------------------------------------------------------------------------------
# The reference fixture, read and written back: exactly the reference's files


@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_exports_back_to_itself(variant, target, tmp_path):
    tcfg, tparams = target
    dcfg, params = load_variant(variant, target)
    want_config = read_json(os.path.join(FIXTURE, f"{variant}_config.json"))
    # num_anchors is a training-only key the reference requires; our DrafterConfig does not hold it.
    training = {"num_anchors": want_config["num_anchors"]} if "num_anchors" in want_config else {}
    out = str(tmp_path / "out")
    summary = deepspec.save_deepspec_drafter(out, dcfg, params, tcfg, tparams, dtype="float32", training=training,
                                             target_json=read_json(os.path.join(TARGET_DIR, "config.json")))
    assert sorted(os.listdir(out)) == sorted(summary["files"])
    got_config = read_json(os.path.join(out, "config.json"))
    assert set(got_config) == set(want_config)
    assert got_config == want_config  # drafter fields and the target's config fields alike
    got, want = load_file(os.path.join(out, deepspec.WEIGHTS_FILE)), load_file(os.path.join(FIXTURE, f"{variant}.safetensors"))
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)  # embed / lm_head copies included
    assert summary["outside_layout"] == {}


def test_every_name_table_entry_inverts():
    for fmt in (deepspec.FORMATS["dspark"], deepspec.format_of(load_variant_cfg("eagle3"))):
        for pattern, path, _ in fmt.names:
            for layer in ((0, 3, 12) if path.startswith("layers/") else (None,)):
                name = deepspec.tensor_name(pattern, layer)
                m = re.fullmatch(pattern, name)
                assert m and (layer is None or int(m.group(1)) == layer)
    assert deepspec.tensor_name(r"layers\.(\d+)\.mlp\.up_proj\.weight", 7) == "layers.7.mlp.up_proj.weight"
    assert deepspec.tensor_name(HF_NAMES[0][0]) == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="cannot be inverted"):
        deepspec.tensor_name(GEMMA3_HF_NAMES[0][0])  # an alternation has no single inverse


# --------------------------------------------------------------------------------------------------
# Our drafters: export through the command line, read back with the DeepSpec loaders


def our_drafter(variant, target, tmp_path, **changes):
    """A drafter folder in OUR format (the fixture's weights, or fresh ones where `changes` alter
    the parameter shapes), with STS temperatures and training metadata as training writes them."""
    dcfg, params = load_variant(variant, target)
    dcfg = dcfg.replace(target_name="tiny-target", **changes)
    if changes:
        init = eagle3.init_eagle3_params if dcfg.kind == "eagle3" else dspark.init_drafter_params
        fresh = jax.device_get(init(dcfg, jax.random.key(1)))
        # Norms away from one, so a mix-up between norm tensors could not pass.
        params = jax.tree_util.tree_map_with_path(
            lambda p, a: a + 0.1 * np.arange(a.size, dtype=np.float32).reshape(a.shape) / a.size
            if "norm" in jax.tree_util.keystr(p) else a, fresh)
    folder = str(tmp_path / f"ours_{variant}")
    temps = [1.0 + 0.1 * k for k in range(dcfg.block_size)]
    save_drafter(folder, dcfg, params, sts_temperatures=temps, metadata={"train_config": {"data": {"anchors_per_seq": 12}}})
    return folder, dcfg, params, temps


OURS = [("dspark_markov", {}), ("dspark_rnn", {}), ("dflash", {}), ("eagle3", {}),
        ("dspark_markov", {"confidence_with_markov": False}),  # confidence on h alone
        ("dflash", {"confidence": True}),  # DFlash backbone with a confidence head
        ("eagle3", {"ttt_at_anchors": True, "ttt_steps": 5})]


@pytest.mark.parametrize("variant,changes", OURS, ids=[f"{v}{'-' + '-'.join(c) if c else ''}" for v, c in OURS])
def test_our_drafter_exports_and_reads_back(variant, changes, target, inputs, tmp_path, capsys):
    tcfg, tparams = target
    folder, dcfg, params, temps = our_drafter(variant, target, tmp_path, **changes)
    out = str(tmp_path / "export")
    code, stdout, err = run_main(export.main, capsys, "--drafter", folder, "--format", "deepspec", "--out", out,
                                 "--target", TARGET_DIR, "--dtype", "float32")
    assert code == 0, err
    assert "Qwen3Eagle3Model" in stdout if dcfg.kind == "eagle3" else "Qwen3DSparkModel" in stdout
    loader = eagle3.load_deepspec_eagle3 if dcfg.kind == "eagle3" else deepspec.load_deepspec_drafter
    back_cfg, back = loader(out, target_cfg=tcfg, target_params=tparams)  # also checks the copies
    assert_same_params(params, back)
    assert deepspec._meaning(back_cfg) == deepspec._meaning(dcfg)
    ours, theirs = forward(dcfg, params, target, inputs), forward(back_cfg, back, target, inputs)
    assert set(ours) == set(theirs) == ({"draft_logits", "confidence_logits"} if dcfg.confidence and dcfg.kind == "dspark"
                                        else {"draft_logits"})
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    side = deepspec.read_side_file(out)
    assert side["sts_temperatures"] == temps
    config = read_json(os.path.join(out, "config.json"))
    if dcfg.kind == "dspark":
        assert config["num_anchors"] == 12  # from the training metadata
        assert side["outside_layout"]["target_name"] == "tiny-target"  # DSpark configs have no such key
    else:
        assert config["target_model_name_or_path"] == "tiny-target" and config["ttt_length"] == dcfg.ttt_steps
        assert side["outside_layout"].get("ttt_at_anchors", False) == dcfg.ttt_at_anchors


def test_bf16_export(target, inputs, tmp_path):
    tcfg, tparams = target
    folder, dcfg, params, _ = our_drafter("dspark_rnn", target, tmp_path)
    out = str(tmp_path / "bf16")
    export_drafter(folder, out, target=TARGET_DIR)  # bfloat16 is the default
    header = safetensors_header(os.path.join(out, deepspec.WEIGHTS_FILE))
    assert {dtype for dtype, _ in header.values()} == {"BF16"}
    assert read_json(os.path.join(out, "config.json"))["dtype"] == "bfloat16"
    back_cfg, back = deepspec.load_deepspec_drafter(out, target_cfg=tcfg, target_params=tparams)
    rounded = jax.tree.map(lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    assert_same_params(rounded, back)
    ours, theirs = forward(dcfg, params, target, inputs), forward(back_cfg, back, target, inputs)
    for key in ours:
        np.testing.assert_allclose(theirs[key], ours[key], atol=0.05, rtol=0.05, err_msg=key)
    fp32 = str(tmp_path / "fp32")
    export_drafter(folder, fp32, target=TARGET_DIR, dtype="float32")
    size = lambda d: os.path.getsize(os.path.join(d, deepspec.WEIGHTS_FILE))  # noqa: E731
    assert size(out) < 0.55 * size(fp32)


def test_shipped_drafter_exports_and_reloads(tmp_path, capsys, monkeypatch):
    smollm2 = registry.load_target("smollm2-135m", layout="stacked")
    monkeypatch.setattr(registry, "load_target", lambda spec, **kw: smollm2)  # load it once for both sides
    shipped = registry.default_drafter_path("smollm2-135m")
    out = str(tmp_path / "shipped")
    code, stdout, err = run_main(export.main, capsys, "--drafter", shipped, "--format", "deepspec", "--out", out)
    assert code == 0, err
    assert "note: the target smollm2-135m is a GGUF file" in stdout
    loaded = load_drafter(shipped)
    dcfg, back = deepspec.load_deepspec_drafter(out, target_name="smollm2-135m", target_cfg=smollm2.config,
                                                target_params=smollm2.params)
    assert_same_params(loaded.params, back)  # stored in bf16 already: exact
    # the shipped drafter drafts over a draft vocabulary, which the layout does not carry: exported whole
    assert loaded.config.draft_vocab_size and "draft vocabulary is not exported" in stdout
    assert deepspec._meaning(dcfg) == deepspec._meaning(whole_vocabulary(loaded.config))
    assert tuple(deepspec.read_side_file(out)["sts_temperatures"]) == loaded.sts_temperatures
    config = read_json(os.path.join(out, "config.json"))
    assert config["rope_parameters"]["rope_theta"] == 100000.0 and config["model_type"] == "qwen3"
    assert config["eos_token_id"] in smollm2.tokenizer.eos_token_ids and config["num_anchors"] == 16
    tensors = load_file(os.path.join(out, deepspec.WEIGHTS_FILE))
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["embed_tokens.weight"])  # tied target


# --------------------------------------------------------------------------------------------------
# What the layout cannot express, bad command lines, atomic output


@pytest.mark.parametrize("changes,message", [
    ({"qk_norm": False}, "always have q/k RMSNorm"),
    ({"target_embed_scale": 8.0}, "embed tokens unscaled"),
], ids=["no-qk-norm", "scaled-embedding"])
def test_inexpressible_drafter_is_one_clear_error(changes, message, target, tmp_path, capsys):
    folder, *_ = our_drafter("dspark_markov", target, tmp_path, **changes)
    out = tmp_path / "never"
    assert_one_line_error(export.main, capsys, message, "--drafter", folder, "--format", "deepspec",
                          "--out", str(out), "--target", TARGET_DIR)
    assert not out.exists() and [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_draft_vocabulary_is_refused_by_the_layout():
    dcfg = load_variant_cfg("dspark_markov")
    with pytest.raises(UserError, match="draft-to-target token map"):
        deepspec.check_exportable(dcfg.replace(vocab_size=128, mask_token_id=127))


def test_a_draft_vocabulary_is_exported_as_the_whole_vocabulary(target, tmp_path, capsys):
    """The layout has no d2t here: export writes the drafter over the whole vocabulary (same weights)
    and says so in a note."""
    _, dcfg, params, _ = our_drafter("dspark_markov", target, tmp_path)
    save_drafter(str(tmp_path / "small"), dcfg.replace(draft_vocab_size=5, draft_vocab=(1, 4, 9, 16, 25)), params)
    out = str(tmp_path / "out")
    code, stdout, err = run_main(export.main, capsys, "--drafter", str(tmp_path / "small"), "--format", "deepspec",
                                 "--out", out, "--target", TARGET_DIR, "--dtype", "float32")
    assert code == 0, err
    assert "5-token draft vocabulary is not exported" in stdout
    back_cfg, back = deepspec.load_deepspec_drafter(out, target_cfg=target[0], target_params=target[1])
    assert back_cfg.draft_vocab_size == 0 and deepspec._meaning(back_cfg) == deepspec._meaning(dcfg)
    assert_same_params(params, back)


def test_bad_command_lines(target, tmp_path, capsys):
    folder, *_ = our_drafter("dflash", target, tmp_path)
    base = ["--drafter", folder, "--format", "deepspec", "--target", TARGET_DIR]
    out = str(tmp_path / "o")

    def fails(message, *argv):
        assert_one_line_error(export.main, capsys, message, *argv)

    fails("--format", "--drafter", folder, "--out", out)
    fails("invalid choice", *base[:2], "--format", "vllm", "--out", out)
    fails("invalid choice", *base, "--out", out, "--dtype", "float16")
    fails("no drafter checkpoint", "--drafter", str(tmp_path / "missing"), "--format", "deepspec", "--out", out)
    fails("unknown target", *base[:4], "--target", "no-such-target", "--out", out)
    fails("is the drafter folder itself", *base, "--out", folder, "--overwrite")
    (tmp_path / "file").write_text("x")
    fails("is not a folder", *base, "--out", str(tmp_path / "file"))
    os.makedirs(out)
    (tmp_path / "o" / "old.txt").write_text("old")
    fails("not empty (pass --overwrite", *base, "--out", out)
    assert os.listdir(out) == ["old.txt"]
    meta = json.loads(open(os.path.join(folder, "drafter.json")).read())
    meta["config"]["target_name"] = ""
    no_target = tmp_path / "no_target"
    os.makedirs(no_target)
    (no_target / "drafter.json").write_text(json.dumps(meta))
    os.link(os.path.join(folder, "drafter.safetensors"), no_target / "drafter.safetensors")
    fails("records no target; pass --target", "--drafter", str(no_target), "--format", "deepspec", "--out", str(tmp_path / "n"))
    # --overwrite replaces the folder as a whole: nothing of the old content stays.
    code, _, err = run_main(export.main, capsys, *base, "--out", out, "--overwrite")
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted(["config.json", deepspec.WEIGHTS_FILE, deepspec.SIDE_FILE])


def test_a_failed_write_leaves_nothing_half_written(target, tmp_path, monkeypatch):
    folder, *_ = our_drafter("dspark_markov", target, tmp_path)
    out = tmp_path / "out"

    def broken(*args, **kw):
        raise OSError(28, "No space left on device")

    import safetensors.numpy

    monkeypatch.setattr(safetensors.numpy, "save_file", broken)
    with pytest.raises(UserError, match="No space left on device"):
        export_drafter(folder, str(out), target=TARGET_DIR)
    assert not out.exists()
    os.makedirs(out)
    (out / "keep.txt").write_text("previous export")
    with pytest.raises(UserError, match="No space left on device"):
        export_drafter(folder, str(out), target=TARGET_DIR, overwrite=True)
    assert os.listdir(out) == ["keep.txt"]  # the old folder is untouched
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporary folders left


def test_writer_bug_is_caught_before_publishing(target, tmp_path, monkeypatch):
    """The read-back check: a table entry written under the wrong name never reaches --out."""
    folder, *_ = our_drafter("dspark_markov", target, tmp_path)
    real = deepspec.deepspec_tensors

    def swapped(*args):
        tensors = real(*args)
        a, b = "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"
        tensors[a], tensors[b] = tensors[b], tensors[a]
        return tensors

    monkeypatch.setattr(deepspec, "deepspec_tensors", swapped)
    with pytest.raises(RuntimeError, match="reads back differently"):
        export_drafter(folder, str(tmp_path / "out"), target=TARGET_DIR)
    assert not (tmp_path / "out").exists()


def test_dataclass_fields_all_accounted_for():
    """Every DrafterConfig field is either written to config.json, unused by a family, or reported
    in the side file: a new field that changes what a drafter computes fails check_exportable."""
    dcfg = load_variant_cfg("dspark_markov")
    assert deepspec.check_exportable(dcfg) == {}
    fields = {f.name for f in dataclasses.fields(dcfg)}
    assert set(deepspec._meaning(dcfg)) == fields - set(deepspec._UNUSED["dspark"]) - {"target_name"}


def test_target_config_spelled_the_transformers_4_way(target, tmp_path):
    """A target config.json with transformers-4 keys (rope_theta, rope_scaling, torch_dtype) and a
    quantisation block: the RoPE keys are rewritten to the drafter's values, the dtype keys agree,
    and the target's quantisation does not pass to the drafter."""
    tcfg, tparams = target
    dcfg, params = load_variant("dflash", target)
    base = dict(read_json(os.path.join(TARGET_DIR, "config.json")), rope_theta=5.0, rope_scaling=None,
                torch_dtype="float16", quantization_config={"quant_method": "fp8"}, auto_map={"AutoModel": "x.Y"})
    base.pop("rope_parameters")
    out = str(tmp_path / "out")
    deepspec.save_deepspec_drafter(out, dcfg, params, tcfg, tparams, target_json=base, dtype="bfloat16")
    config = read_json(os.path.join(out, "config.json"))
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == dcfg.rope_theta
    assert config["rope_scaling"] is None and config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert "quantization_config" not in config and "auto_map" not in config
    back_cfg, _ = deepspec.load_deepspec_drafter(out, target_cfg=tcfg, target_params=tparams)
    assert deepspec._meaning(back_cfg) == deepspec._meaning(dcfg)


def test_overwrite_puts_the_old_folder_back_if_the_final_rename_fails(target, tmp_path, monkeypatch):
    folder, *_ = our_drafter("dflash", target, tmp_path)
    out = tmp_path / "out"
    os.makedirs(out)
    (out / "keep.txt").write_text("previous export")
    real = os.replace

    def failing_publish(src, dst):
        if os.path.basename(str(src)).startswith(".out.tmp-"):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(deepspec.os, "replace", failing_publish)
    with pytest.raises(UserError, match="Input/output error"):
        export_drafter(folder, str(out), target=TARGET_DIR, overwrite=True)
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "previous export"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
