"""Every config field and command-line flag has a type and a range, checked when the config is built
(dspark_jax/core/config_checks.py): YAML files and `key=value` overrides alike, naming the key and where
it came from, before any model or data loads."""

import dataclasses
import glob
import json
import math
import os
import typing

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cli_helpers import assert_one_line_error
from dspark_jax.core import config_checks
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.engine.speculative import SpecConfig
from dspark_jax.core.errors import UserError
from dspark_jax.models.sampling import SamplingConfig
from dspark_jax.training.config import (
    DataConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    load_config,
    parse_override,
)
from dspark_jax.training.losses import LossWeights

CONFIG = "configs/dspark_smollm2-135m.yaml"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SECTIONS = {"loss": LossWeights, "data": DataConfig, "optim": OptimConfig, "run": RunConfig, "drafter": DrafterConfig}


def error_of(overrides=(), path=CONFIG) -> str:
    with pytest.raises(UserError) as e:
        load_config(path, list(overrides))
    assert type(e.value).__name__ in ("UserError", "ConfigError")
    return str(e.value)


def test_every_shipped_config_loads():
    paths = sorted(glob.glob("configs/*.yaml"))
    assert len(paths) >= 12
    for path in paths:
        cfg = load_config(path)
        assert isinstance(cfg.optim.steps, int) and isinstance(cfg.run.mesh, tuple)
        assert cfg.drafter["kind"] in ("dspark", "eagle3")


# ------------------------------------------------------------------------------------------------
# bad values, through overrides and through the file

BAD = [  # (key, YAML value, what the message says)
    ("optim.steps", "-1", "optim.steps must be at least 1, got -1"),
    ("optim.steps", "0", "optim.steps must be at least 1, got 0"),
    ("optim.steps", "1.5", "optim.steps must be an integer, got 1.5"),
    ("optim.steps", "2.0", "optim.steps must be an integer, got 2.0"),
    ("optim.steps", "abc", "optim.steps must be an integer, got 'abc'"),
    ("optim.steps", "true", "optim.steps must be an integer, got true"),
    ("optim.steps", "[1, 2]", "optim.steps must be an integer, got [1, 2]"),
    ("optim.steps", "null", "optim.steps must be an integer, got null"),
    ("optim.lr", "-1", "optim.lr must be greater than 0, got -1"),
    ("optim.lr", "0", "optim.lr must be greater than 0, got 0"),
    ("optim.lr", "nan", "optim.lr must be a number, got nan"),
    ("optim.lr", ".inf", "optim.lr must be a number, got inf"),
    ("optim.lr", "fast", "optim.lr must be a number, got 'fast'"),
    ("optim.lr", "false", "optim.lr must be a number, got false"),
    ("optim.warmup_frac", "1.5", "need 0 <= optim.warmup_frac <= 1, got 1.5"),
    ("optim.b2", "1", "need 0 <= optim.b2 < 1, got 1"),
    ("optim.grad_accum", "0", "optim.grad_accum must be at least 1"),
    ("loss.decay", "0", "loss.decay must be greater than 0, got 0"),
    ("loss.tv", "-0.5", "loss.tv must be at least 0, got -0.5"),
    ("data.rows", "0", "data.rows must be at least 1, got 0"),
    ("data.seed", "-1", "need 0 <= data.seed < 4294967296, got -1"),
    ("data.anchors_per_seq", "64", "data.anchors_per_seq=64 exceeds blocks_per_row=32"),
    ("data.train_dir", "''", "data.train_dir must not be empty"),
    ("data.feature_cache", "true", "data.feature_cache must be a string, got true (false, null or none"),
    ("run.out_dir", "false", "run.out_dir must be a string, got false"),
    ("run.save_every", "0", "run.save_every must be at least 1, got 0"),
    ("run.compute_dtype", "float64", "run.compute_dtype must be one of float32, bfloat16, float16, got 'float64'"),
    ("run.mesh", "[1, 1]", "run.mesh must be a list of 3 integers, got [1, 1]"),
    ("run.mesh", "[1, 0, 1]", "run.mesh (1, 0, 1) must hold axis sizes >= 1"),
    ("run.mesh", "[-1, -1, 1]", "run.mesh (-1, -1, 1) must hold axis sizes >= 1, and -1"),
    ("run.mesh", "[1, -2, 1]", "every element of run.mesh must be at least -1, got [1, -2, 1]"),
    ("run.mesh", "[1, 1.5, 1]", "run.mesh must be a list of 3 integers, got [1, 1.5, 1]"),
    ("run.mesh", "7", "run.mesh must be a list of 3 integers, got 7"),
    ("drafter.num_layers", "abc", "drafter.num_layers must be an integer, got 'abc'"),
    ("drafter.num_layers", "0", "drafter.num_layers must be at least 1, got 0"),
    ("drafter.num_layers", "-2", "drafter.num_layers must be at least 1, got -2"),
    ("drafter.num_layers", "1.5", "drafter.num_layers must be an integer, got 1.5"),
    ("drafter.num_layers", "[1, 2]", "drafter.num_layers must be an integer, got [1, 2]"),
    ("drafter.num_layers", "yes", "drafter.num_layers must be an integer, got true"),
    ("drafter.block_size", "0", "drafter.block_size must be at least 1, got 0"),
    ("drafter.confidence", "maybe", "drafter.confidence must be true or false, got 'maybe'"),
    ("drafter.confidence", "1", "drafter.confidence must be true or false, got 1"),
    ("drafter.kind", "medusa", "drafter.kind must be one of dspark, eagle3, got 'medusa'"),
    ("drafter.head", "mlp", "drafter.head must be one of markov, rnn, none, got 'mlp'"),
    ("drafter.markov_rank", "0", "drafter.markov_rank must be at least 1 with head='markov'"),
    ("drafter.markov_rank", "-1", "drafter.markov_rank must be at least 0, got -1"),
    ("drafter.num_heads", "0", "drafter.num_heads must be at least 1, got 0"),
    ("drafter.head_dim", "7", "drafter.head_dim must be even"),
    ("drafter.mask_token_id", "-1", "drafter.mask_token_id must be at least 0, got -1"),
    ("drafter.mask_token_id", "x", "drafter.mask_token_id must be an integer or null, got 'x'"),
    ("drafter.target_layer_ids", "[1, -7]", "every element of drafter.target_layer_ids must be at least -1"),
    ("drafter.target_layer_ids", "[1, 2.5]", "drafter.target_layer_ids must be a list of integers, got [1, 2.5]"),
    ("drafter.target_layer_ids", "3", "drafter.target_layer_ids must be a list of integers, got 3"),
    ("drafter.ttt_decay", "0", "drafter.ttt_decay must be greater than 0, got 0"),
    ("drafter.rope_scaling", "{factor: 2}", "drafter.rope_scaling.low_freq_factor is required"),
    ("drafter.rope_scaling", "{factor: x, low_freq_factor: 1, high_freq_factor: 4, "
                             "original_max_position_embeddings: 8192}", "drafter.rope_scaling.factor must be a number"),
    ("optim.learning_rate", "1", "unknown optim setting 'optim.learning_rate' (known: lr, "),
    ("drafter.layers", "2", "unknown drafter setting 'drafter.layers'"),
    ("optim", "3", "section optim must be a mapping of settings, got 3"),
    ("target", "''", "target must not be empty"),
    ("target", "[a]", "target must be a string, got ['a']"),
]


@pytest.mark.parametrize("key, value, message", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_bad_override_names_key_and_override(key, value, message):
    text = f"{key}={value}"
    assert error_of([text]).startswith(f"override {text!r}: {message}")


@pytest.mark.parametrize("key, value, message", BAD, ids=[f"{k}={v}" for k, v, _ in BAD])
def test_bad_file_value_names_key_and_file(key, value, message, tmp_path):
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    *sections, last = key.split(".")
    node = raw
    for k in sections:
        node = node[k]
    node[last] = yaml.safe_load(value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert error_of(path=str(path)).startswith(f"{path}: {message}")


def test_the_last_override_is_the_source():
    assert error_of(["optim.steps=5", "optim.steps=-5"]).startswith("override 'optim.steps=-5': optim.steps")
    # a relation names the override that broke it, even through the other key
    assert error_of(["data.blocks_per_row=8"]).startswith(
        "override 'data.blocks_per_row=8': data.anchors_per_seq=16 exceeds")
    # a whole section replaced: the source of its keys is that override
    assert error_of(["optim={steps: 0}"]).startswith("override 'optim={steps: 0}': optim.steps must be at least 1")


@pytest.mark.parametrize("text, message", [
    ("optim.lr", "is not key=value"),
    ("=3", "is not key=value"),
    ("optim..lr=3", "is not key=value"),
    ("optim.l r=3", "is not key=value"),
    ("optim.lr=[", "override 'optim.lr=[' is not valid YAML"),
    ("optim.lr={a: 1", "is not valid YAML"),
    ("optim.lr=2024-13-01", "is not valid YAML: month must be in 1..12"),
    ("optim.lr=!!python/object:os.system x", "is not valid YAML"),
    ("optim.lr.x=1", "optim.lr is not a section"),
    ("target.name=x", "target is not a section"),
    ("nosuch.key=1", "unknown section(s) nosuch"),
])
def test_bad_override_grammar(text, message):
    assert message in error_of([text])


def test_bad_files(tmp_path):
    def bad(content):
        path = tmp_path / "c.yaml"
        path.write_text(content)
        return error_of(path=str(path))

    assert bad("target: [unclosed\n").startswith(f"{tmp_path / 'c.yaml'} is not valid YAML")
    assert "must be a mapping of sections" in bad("- a\n- b\n")
    assert "needs a 'target' and a 'drafter' section" in bad("target: x\n")
    assert "unknown section(s) 1, zzz" in bad("target: x\ndrafter: {kind: dspark, markov_rank: 4}\nzzz: 1\n1: 2\n")
    assert "section drafter must be a mapping" in bad("target: x\ndrafter: [1]\n")
    assert "no such config file" in error_of(path=str(tmp_path / "nope.yaml"))


def test_yaml_quirks_are_fitted_to_the_field_types():
    cfg = load_config(CONFIG, ["optim.lr=1e-3", "run.out_dir=1.50", "data.train_dir=2024-01-02", "loss.ce=1",
                               "target=2024", "data.feature_cache=None"])
    assert cfg.optim.lr == 1e-3 and cfg.run.out_dir == "1.50" and cfg.data.train_dir == "2024-01-02"
    assert cfg.loss.ce == 1.0 and isinstance(cfg.loss.ce, float) and cfg.target == "2024"
    assert cfg.data.feature_cache is None
    cfg = load_config(CONFIG, ["drafter.rope_scaling={factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
                               "original_max_position_embeddings: 8192}", "drafter.target_layer_ids=[0, 3]"])
    assert cfg.drafter["rope_scaling"].factor == 8.0 and cfg.drafter["target_layer_ids"] == (0, 3)


# ------------------------------------------------------------------------------------------------
# the dataclasses check themselves, wherever they are built


@pytest.mark.parametrize("cls, kwargs, message", [
    (SamplingConfig, dict(temperature=-1), "temperature must be at least 0"),
    (SamplingConfig, dict(top_k=-1), "top_k must be at least 0"),
    (SamplingConfig, dict(top_k=2.5), "top_k must be an integer"),
    (SamplingConfig, dict(top_p=0), "need 0 < top_p <= 1, got 0"),
    (SamplingConfig, dict(top_p=1.01), "need 0 < top_p <= 1, got 1.01"),
    (SpecConfig, dict(gamma=0), "gamma must be at least 1, got 0"),
    (SpecConfig, dict(gamma=True), "gamma must be an integer, got true"),
    (SpecConfig, dict(gamma=3, threshold=2), "need 0 <= threshold <= 1, got 2"),
    (SpecConfig, dict(gamma=3, policy="greedy"), "policy must be one of fixed, mtp1, threshold, dspark"),
    (SpecConfig, dict(gamma=3, stop_ids=(1, -1)), "every element of stop_ids must be at least 0"),
    (SpecConfig, dict(gamma=3, verify_buckets=(0, 4)), "every element of verify_buckets must be at least 1"),
    (SpecConfig, dict(gamma=3, sampling=dict(top_p=0)), "need 0 < sampling.top_p <= 1"),
    (SpecConfig, dict(gamma=3, sampling="greedy"), "sampling must be SamplingConfig, got 'greedy'"),
    (LossWeights, dict(conf=-1), "conf must be at least 0"),
    (OptimConfig, dict(steps=-1), "steps must be at least 1"),
    (RunConfig, dict(mesh=[1, 1]), "mesh must be a list of 3 integers"),
    (TrainConfig, dict(target="t", drafter=dict(kind="dspark", num_layers=0)), "drafter.num_layers must be at least 1"),
    (TrainConfig, dict(target="t", drafter=dict(kind="dspark", markov_rank=4), optim=dict(steps=0)),
     "optim.steps must be at least 1"),  # a mapping for a config-typed field is checked as that config
    (TrainConfig, dict(target="t", drafter=dict(kind="dspark", markov_rank=4), optim=3), "optim must be OptimConfig"),
])
def test_dataclasses_check_themselves(cls, kwargs, message):
    with pytest.raises(UserError) as e:
        cls(**kwargs)
    assert message in str(e.value)


DRAFTER = dict(kind="dspark", num_layers=1, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
               intermediate_size=64, vocab_size=100, block_size=4, markov_rank=8, mask_token_id=0,
               target_layer_ids=(0, 1), target_vocab_size=100, target_hidden_size=32, target_num_layers=4)


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=0), "num_layers must be at least 1, got 0"),
    (dict(num_kv_heads=3), "num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(mask_token_id=100), "mask_token_id=100 is not a token id"),
    (dict(target_layer_ids=(0, 4)), "target_layer_ids (0, 4) must be below the target's 4 layers"),
    (dict(confidence="maybe"), "confidence must be true or false, got 'maybe'"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be greater than 0"),
])
def test_drafter_config(change, message):
    ok = DrafterConfig(**{**DRAFTER, "target_layer_ids": [0, 1]})
    assert ok.target_layer_ids == (0, 1)  # a list is checked element by element and stored as a tuple
    with pytest.raises(UserError) as e:
        DrafterConfig(**{**DRAFTER, **change})
    assert message in str(e.value)


def write_drafter_json(folder, **change):
    os.makedirs(folder, exist_ok=True)
    config = {**dataclasses.asdict(DrafterConfig(**DRAFTER)), **change}
    with open(os.path.join(folder, "drafter.json"), "w") as f:
        json.dump({"format_version": 1, "config": config, "sts_temperatures": None, "metadata": {}}, f)
    return str(folder)


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=0), "num_layers must be at least 1, got 0"),
    (dict(confidence="maybe"), "confidence must be true or false, got 'maybe'"),
    (dict(block_size=2.5), "block_size must be an integer, got 2.5"),
    (dict(target_layer_ids="0,1"), "target_layer_ids must be a list of integers, got '0,1'"),
    (dict(rope_scaling={"factor": 1}), "rope_scaling.low_freq_factor is required"),
])
def test_a_bad_stored_drafter_is_a_user_error_naming_the_file(tmp_path, change, message):
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config

    folder = write_drafter_json(tmp_path / "d", **change)
    for read in (read_drafter_config, load_drafter):
        with pytest.raises(UserError) as e:
            read(folder)
        assert str(e.value).startswith(f"{os.path.join(folder, 'drafter.json')}: {message}")


def test_read_drafter_config_reads_only_the_json(tmp_path):
    from dspark_jax.drafters.checkpoint import read_drafter_config

    folder = write_drafter_json(tmp_path / "d")  # no weights at all
    assert read_drafter_config(folder) == DrafterConfig(**DRAFTER)


# ------------------------------------------------------------------------------------------------
# the commands: one `error:` line, exit 2, nothing loaded or written


@pytest.fixture
def no_loading(monkeypatch):
    import dspark_jax.checkpoints.registry as registry

    def fail(*args, **kwargs):
        raise AssertionError("the target was loaded before the bad input was reported")

    monkeypatch.setattr(registry, "load_target", fail)


@pytest.mark.parametrize("argv, message", [
    (["--gamma", "0"], "error: --gamma must be at least 1, got 0"),
    (["--gamma", "1.5"], "error: --gamma must be an integer, got 1.5"),
    (["--threshold", "2"], "error: need 0 <= --threshold <= 1, got 2"),
    (["--threshold", "nan"], "error: --threshold must be a number, got nan"),
    (["--top-p", "0"], "error: need 0 < --top-p <= 1, got 0"),
    (["--temperature", "-0.5"], "error: --temperature must be at least 0, got -0.5"),
    (["--top-k", "-1"], "error: --top-k must be at least 0, got -1"),
    (["--batch-size", "0"], "error: --batch-size must be at least 1, got 0"),
    (["--max-new-tokens", "x"], "error: --max-new-tokens must be an integer, got x"),
    (["--seed", "-1"], "error: need 0 <= --seed < 4294967296, got -1"),
    (["--scheduler", "greedy"], "error: argument --scheduler: invalid choice: 'greedy'"),
    (["--bogus"], "error: unrecognized arguments: --bogus"),
])
def test_decode_flags(capsys, no_loading, argv, message):
    from dspark_jax import decode

    assert_one_line_error(decode.main, capsys, message, "--prompt", "hi", *argv)


@pytest.mark.parametrize("change, argv, message", [
    ({}, ["--gamma", "5"], "--gamma 5 must be between 1 and the drafter's block size 4"),
    (dict(confidence=False), ["--scheduler", "dspark"], "--scheduler dspark needs a drafter with a confidence head"),
    (dict(confidence=False), ["--scheduler", "threshold"], "needs a drafter with a confidence head"),
    (dict(num_layers=0), [], "drafter.json: num_layers must be at least 1, got 0"),
])
def test_decode_checks_the_drafter_before_the_target_loads(capsys, no_loading, tmp_path, change, argv, message):
    from dspark_jax import decode

    folder = write_drafter_json(tmp_path / "d", **change)
    assert_one_line_error(decode.main, capsys, message, "--prompt", "hi", "--drafter", folder, *argv)


@pytest.mark.parametrize("command, argv, message", [
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--gamma", "0"], "--gamma must be at least 1, got 0"),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--gamma", "5"], "--gamma 5 is larger than the block size 4"),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--temperature", "-1"], "--temperature must be at least 0"),
    ("calibrate", ["--drafter", "{D}", "--limit", "0"], "--limit must be at least 1, got 0"),
    ("calibrate", ["--drafter", "{D}", "--sets", "nope"], "unknown prompt set 'nope'"),
    ("calibrate", ["--drafter", "{D}", "--temperature", "x"], "--temperature must be a number, got x"),
    ("datagen", ["--sets", "gsm8k", "--out", "{W}/data", "--top-p", "2"], "need 0 < --top-p <= 1, got 2"),
    ("datagen", ["--sets", "gsm8k", "--out", "{W}/data", "--top-k", "1.5"], "--top-k must be an integer"),
    ("datagen", ["--sets", "gsm8k", "--out", "{W}/data", "--limit", "0"], "--limit must be at least 1"),
    ("datagen", ["--sets", "gsm8k"], "the following arguments are required: --out"),
    ("plot_metrics", [], "the following arguments are required: RUN_DIR"),
])
def test_other_commands(capsys, no_loading, tmp_path, command, argv, message):
    import importlib

    module = importlib.import_module(f"dspark_jax.{command}")
    folder = write_drafter_json(tmp_path / "d")
    argv = [a.replace("{D}", folder).replace("{W}", str(tmp_path)) for a in argv]
    assert_one_line_error(module.main, capsys, message, *argv)
    assert sorted(os.listdir(tmp_path)) == ["d"]  # nothing written


@pytest.mark.parametrize("override, message", [
    ("optim.steps=-1", "error: override 'optim.steps=-1': optim.steps must be at least 1, got -1"),
    ("drafter.num_layers=[1,2]", "drafter.num_layers must be an integer, got [1, 2]"),
    ("drafter.confidence=maybe", "drafter.confidence must be true or false, got 'maybe'"),
])
def test_train_rejects_before_anything_runs(capsys, no_loading, tmp_path, override, message):
    from dspark_jax import train

    run = tmp_path / "run"
    assert_one_line_error(train.main, capsys, message, "--config", CONFIG, f"run.out_dir={run}", override)
    assert not run.exists()


def test_train_subprocess_exit_2_no_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dspark_jax.train", "--config", CONFIG,
                           f"run.out_dir={tmp_path / 'run'}", "optim.steps=-1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: override 'optim.steps=-1': optim.steps must be at least 1, got -1"]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# properties of the parser and the override grammar

_WORDS = {"none", "null", "true", "false", "yes", "no", "on", "off", "~"}
TEXT = st.text(alphabet="abcxyzAZ0123456789_./-", min_size=1, max_size=12).filter(
    lambda t: t[0].isalnum() and t.lower() not in _WORDS)


def valid(hint, rule):
    """Values a field of type `hint` with `rule` takes."""
    inner = config_checks.unwrap_optional(hint)
    if inner is not None:
        return st.one_of(st.none(), valid(inner, rule))
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if args[-1] is Ellipsis:
            return st.lists(valid(args[0], rule), max_size=5).map(tuple)
        return st.tuples(*(valid(a, rule) for a in args))
    if rule.choices is not None:
        return st.sampled_from(rule.choices)
    if hint is bool:
        return st.booleans()
    if hint is int:
        lo = rule.ge if rule.ge is not None else (rule.gt + 1 if rule.gt is not None else -10**9)
        hi = rule.le if rule.le is not None else (rule.lt - 1 if rule.lt is not None else 10**9)
        return st.integers(int(lo), int(hi))
    if hint is float:
        lo = rule.ge if rule.ge is not None else rule.gt
        hi = rule.le if rule.le is not None else rule.lt
        return st.floats(min_value=lo, max_value=1e9 if hi is None else hi, exclude_min=rule.gt is not None,
                         exclude_max=rule.lt is not None, allow_nan=False, allow_infinity=False)
    assert hint is str, hint
    return TEXT


def render(v) -> str:
    """A value as override text."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(map(render, v)) + "]"
    return repr(v) if isinstance(v, float) else str(v)


# Keys whose valid values depend on the shipped config's other values (relations), or are configs.
SPECIAL = {"data.anchors_per_seq": st.integers(1, 32), "data.blocks_per_row": st.integers(16, 10**6),
           "run.mesh": st.tuples(*[st.sampled_from([1, 2, 8])] * 3), "drafter.head_dim": st.integers(1, 999).map(
               lambda n: 2 * n), "drafter.markov_rank": st.integers(1, 10**6), "drafter.vocab_size":
           st.integers(17, 10**6), "drafter.target_num_layers": st.integers(28, 100),
           "data.train_dir": TEXT, "run.out_dir": TEXT}
FIELDS = [(f"{name}.{f.name}", config_checks.hints(cls)[f.name], f.metadata.get("rule", config_checks.NO_RULE))
          for name, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f.name != "rope_scaling"]


@st.composite
def key_and_value(draw):
    key, hint, rule = draw(st.sampled_from(FIELDS))
    return key, draw(SPECIAL[key] if key in SPECIAL else valid(hint, rule))


def value_at(cfg, key):
    section, name = key.split(".")
    return cfg.drafter[name] if section == "drafter" else getattr(getattr(cfg, section), name)


@SETTINGS
@given(key_and_value())
def test_any_valid_value_round_trips_through_an_override(kv):
    key, value = kv
    cfg = load_config(CONFIG, [f"{key}={render(value)}"])
    got = value_at(cfg, key)
    assert got == value and type(got) is type(float(value) if isinstance(value, float) else value)


@SETTINGS
@given(key_and_value())
def test_any_valid_value_round_trips_through_the_file(tmp_path, kv):
    key, value = kv
    with open(CONFIG) as f:
        raw = yaml.safe_load(f)
    section, name = key.split(".")
    raw[section][name] = list(value) if isinstance(value, tuple) else value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert value_at(load_config(str(path)), key) == value


INT_FIELDS = [k for k, hint, _ in FIELDS if hint is int]
NOT_INTS = st.one_of(st.floats(), st.booleans(), TEXT.filter(lambda t: not t.lstrip("-").isdigit()),
                     st.lists(st.integers(), max_size=3), st.none())


@SETTINGS
@given(st.sampled_from(INT_FIELDS), NOT_INTS)
def test_an_int_field_takes_only_ints(key, value):
    text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    assume(not isinstance(yaml.safe_load(text), int) or isinstance(yaml.safe_load(text), bool))
    override = f"{key}={text}"
    message = error_of([override])
    assert message.startswith(f"override {override!r}: {key} must be an integer"), message


@SETTINGS
@given(st.text(max_size=40))
def test_arbitrary_text_as_an_override_is_a_user_error_or_a_config(text):
    try:
        cfg = load_config(CONFIG, [text])
    except UserError:
        return
    assert isinstance(cfg, TrainConfig)


@SETTINGS
@given(st.sampled_from([k for k, _, _ in FIELDS] + ["target", "optim", "drafter", "x.y"]), st.text(max_size=30))
def test_arbitrary_values_for_known_keys_are_checked(key, value):
    try:
        cfg = load_config(CONFIG, [f"{key}={value}"])
    except UserError as e:
        assert str(e).startswith("override ")
        return
    if key.count(".") == 1 and key.split(".")[0] in SECTIONS:  # what was stored passed its field's check
        got = value_at(cfg, key)
        _, hint, rule = next(f for f in FIELDS if f[0] == key)
        assert config_checks.convert(key, got, hint, rule) == got
        assert not (isinstance(got, float) and not math.isfinite(got))


@SETTINGS
@given(st.lists(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True), min_size=1, max_size=3),
       st.text(alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n"), max_size=20))
def test_override_grammar(keys, value):
    try:
        got_keys, parsed = parse_override(" " + ".".join(keys) + " =" + value)
    except UserError as e:
        assert "is not valid YAML" in str(e)
        return
    assert got_keys == keys
