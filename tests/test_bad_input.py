"""Every command, given bad input as a hostile user would: exit 2, one `error:` line naming the
problem, no traceback, nothing written, and no model loaded when the mistake is visible without one.

Each case runs in-process in an empty working folder whose outputs all point inside it; the folder
must be as empty afterwards as before. Cases marked `before_load` run with the target loader
replaced by one that fails the test, so a value error found only after loading is caught too.
"""

import json
import os

import pytest

from cli_helpers import run_main
from dspark_jax import calibrate, decode, draft_vocab, eval as eval_cli, plot_metrics, train
from dspark_jax import datagen

COMMANDS = {"decode": decode.main, "eval": eval_cli.main, "calibrate": calibrate.main, "datagen": datagen.main,
            "train": train.main, "plot_metrics": plot_metrics.main, "draft_vocab": draft_vocab.main}

CONFIG = "configs/dspark_smollm2-135m.yaml"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (command, argv, what the one error line must mention, detectable before any model loads).
# {T} = the tiny target folder, {D} = a tiny DSpark drafter (block 4), {W} = the working folder,
# {C} = the repo's SmolLM2 training config.
CASES = [
    # decode: flags with types and ranges
    ("decode", ["--prompt", "hi", "--gamma", "0"], "gamma", True),
    ("decode", ["--prompt", "hi", "--output", "memory://bucket/out.jsonl"], "memory:// URLs are not supported", True),
    ("decode", ["--prompt", "hi", "--gamma", "-3"], "gamma", True),
    ("decode", ["--prompt", "hi", "--gamma", "abc"], "gamma", True),
    ("decode", ["--prompt", "hi", "--threshold", "2"], "threshold", True),
    ("decode", ["--prompt", "hi", "--threshold", "-0.1"], "threshold", True),
    ("decode", ["--prompt", "hi", "--threshold", "nan"], "threshold", True),
    ("decode", ["--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens", True),
    ("decode", ["--prompt", "hi", "--batch-size", "0"], "batch-size", True),
    ("decode", ["--prompt", "hi", "--temperature", "-1"], "temperature", True),
    ("decode", ["--prompt", "hi", "--top-p", "0"], "top-p", True),
    ("decode", ["--prompt", "hi", "--top-p", "1.5"], "top-p", True),
    ("decode", ["--prompt", "hi", "--top-k", "-1"], "top-k", True),
    ("decode", ["--prompt", "hi", "--scheduler", "greedy"], "scheduler", True),
    ("decode", ["--prompt", "hi", "--dtype", "float16"], "dtype", True),
    ("decode", ["--prompt", "hi", "--bogus-flag"], "bogus-flag", True),
    ("decode", [], "prompt", True),
    ("decode", ["--prompt", " "], "prompt 1 is empty", True),
    ("decode", ["--prompts-file", "{W}/missing.jsonl"], "missing.jsonl", True),
    ("decode", ["--prompts-file", "{W}/bad.jsonl"], "bad.jsonl:2", True),
    ("decode", ["--prompts-file", "{W}/wrong_shape.jsonl"], "wrong_shape.jsonl:1", True),
    ("decode", ["--prompts-file", "{W}/empty.jsonl"], "no prompts", True),
    # decode: the drafter's limits are known from its config, before the target loads
    ("decode", ["--target", "{T}", "--drafter", "{D}", "--prompt", "w1", "--gamma", "5"], "block size", True),
    ("decode", ["--target", "{T}", "--drafter", "{W}/no_drafter", "--prompt", "w1"], "no_drafter", True),
    ("decode", ["--target", "nope", "--prompt", "hi"], "unknown target 'nope'", False),
    ("decode", ["--target", "{W}/missing.gguf", "--prompt", "hi"], "missing.gguf", False),
    # eval
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--limit", "0"], "limit", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--bins", "0"], "bins", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--thresholds", "a,b"], "thresholds", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--thresholds", "1.5"], "thresholds", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--temperature", "-1"], "temperature", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--sets", "nope"], "nope", True),
    ("eval", ["--drafters", "{D}", "--out", "{W}/out", "--gamma", "0"], "gamma", True),
    ("eval", ["--drafters", "{W}/no_drafter", "--out", "{W}/out"], "no_drafter", True),
    # calibrate
    ("calibrate", ["--drafter", "{W}/no_drafter"], "no_drafter", True),
    ("calibrate", ["--drafter", "{D}", "--limit", "0", "--out", "{W}/out"], "limit", True),
    ("calibrate", ["--drafter", "{D}", "--sets", "nope", "--out", "{W}/out"], "nope", True),
    ("calibrate", ["--drafter", "{D}", "--batch-size", "0", "--out", "{W}/out"], "batch-size", True),
    # draft_vocab
    ("draft_vocab", ["--drafter", "{W}/no_drafter", "--data", "{W}", "--size", "8"], "no_drafter", True),
    ("draft_vocab", ["--drafter", "{D}", "--data", "{W}/no_data", "--size", "8"], "no_data", True),
    ("draft_vocab", ["--drafter", "{D}", "--data", "{W}", "--size", "-1"], "size", True),
    # datagen
    ("datagen", ["--sets", "nope", "--out", "{W}/data"], "nope", True),
    ("datagen", ["--sets", "gsm8k", "--out", "memory://bucket/data"], "memory:// URLs are not supported", True),
    ("datagen", ["--sets", "gsm8k", "--split", "validation", "--out", "{W}/data"], "split", True),
    ("datagen", ["--sets", "gsm8k", "--limit", "0", "--out", "{W}/data"], "limit", True),
    ("datagen", ["--sets", "gsm8k", "--max-new-tokens", "0", "--out", "{W}/data"], "max-new-tokens", True),
    ("datagen", ["--sets", "gsm8k", "--top-p", "2", "--out", "{W}/data"], "top-p", True),
    ("datagen", ["--sets", "gsm8k", "--batch-size", "0", "--out", "{W}/data"], "batch-size", True),
    # train: the config file and every override
    ("train", ["--config", "{W}/missing.yaml"], "missing.yaml", True),
    ("train", ["--config", "{W}/not_yaml.yaml"], "not valid YAML", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "optim.steps=-1"], "optim.steps", True),
    ("train", ["--config", "{C}", "run.out_dir=memory://bucket/run"], "run.out_dir memory://bucket/run: use a local path", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "data.feature_cache=s3://b/f"], "data.feature_cache", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "optim.steps=1.5"], "optim.steps", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "optim.lr=-1"], "optim.lr", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "drafter.num_layers=abc"], "drafter.num_layers", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "drafter.num_layers=0"], "drafter.num_layers", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "drafter.num_layers=[1,2]"], "drafter.num_layers", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "drafter.confidence=maybe"], "drafter.confidence", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "drafter.block_size=0"], "drafter.block_size", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "data.rows=0"], "data.rows", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "optim.nesterov=1"], "nesterov", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "optim.lr"], "key=value", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "nosuch.key=1"], "nosuch", True),
    ("train", ["--config", "{C}", "run.out_dir={W}/run", "--allow-schedule-change"], "--resume", True),
    ("train", ["--config", "{C}", "--bogus-flag"], "bogus-flag", True),
    ("train", [], "--config", True),
    # plot_metrics
    ("plot_metrics", ["{W}/no_run"], "no_run", True),
    ("plot_metrics", ["{W}/corrupt_run"], "metrics.jsonl:1", True),
]


def case_id(case):
    command, argv, _, _ = case
    return f"{command}:{' '.join(argv)}"


@pytest.fixture(scope="module")
def tiny_drafter_folder(tiny_target_folder, tmp_path_factory):
    from test_eval import save_tiny_drafter

    return save_tiny_drafter(tmp_path_factory.mktemp("bad-input") / "drafter", tiny_target_folder)


def write_inputs(work):
    """The bad files some cases read, inside the working folder."""
    (work / "bad.jsonl").write_text(json.dumps({"turns": ["ok"]}) + "\n{not json\n")
    (work / "wrong_shape.jsonl").write_text(json.dumps({"prompt": 3}) + "\n")
    (work / "empty.jsonl").write_text("\n\n")
    (work / "not_yaml.yaml").write_text("target: [unclosed\n")
    (work / "corrupt_run").mkdir()
    (work / "corrupt_run" / "metrics.jsonl").write_text("{oops\n" + json.dumps({"step": 1}) + "\n")


def snapshot(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, files in os.walk(folder) for f in files + [""])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys, tiny_target_folder,
                                          tiny_drafter_folder):
    command, argv, message, before_load = case
    work = tmp_path / "work"
    work.mkdir()
    write_inputs(work)
    fill = {"{T}": tiny_target_folder, "{D}": tiny_drafter_folder, "{W}": str(work),
            "{C}": os.path.join(REPO, CONFIG)}
    for key, value in fill.items():
        argv = [a.replace(key, value) for a in argv]
    if before_load:
        import dspark_jax.checkpoints.registry as registry

        def no_loading(*args, **kwargs):
            raise AssertionError("the target was loaded before the bad input was reported")

        monkeypatch.setattr(registry, "load_target", no_loading)
    monkeypatch.chdir(work)
    before = snapshot(work)
    code, out, err = run_main(COMMANDS[command], capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], err
    assert "Traceback" not in err
    assert snapshot(work) == before, "a failed command wrote files"


# Text that is not valid Unicode is not an error: it is decoded with replacement (U+FFFD), the
# behaviour of most tools, on every way a prompt comes in (argv, --raw, a prompts file).
def test_prompts_that_are_not_unicode_decode_with_replacement(tmp_path, capsys, tiny_target_folder):
    argv_prompt = os.fsdecode(b"w5 w6 caf\xe9")  # how Python hands over an undecodable argv byte
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_bytes(b'{"turns": ["w7 \xff\xfe w8"]}\n' + b'{"turns": ["w9 \\ud800"]}\n')
    for raw in ([], ["--raw"]):
        code, out, err = run_main(decode.main, capsys, "--target", tiny_target_folder, "--prompt", argv_prompt,
                                  "--prompts-file", str(prompts_file), "--max-new-tokens", "2", "--json", *raw)
        assert code == 0, err
        records = [json.loads(line) for line in out.strip().splitlines()][:-1]  # the last line: the summary
        assert [r["prompt"] for r in records] == ["w5 w6 caf\ufffd", "w7 \ufffd\ufffd w8", "w9 \ufffd"]
        assert all(r["num_tokens"] >= 1 for r in records)
