"""Data pipeline: prompt splits, datagen shards + resume, anchors, packing, iterator state, target features."""

import hashlib
import json
import os
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.checkpoints.registry import Target
from dspark_jax import datagen as datagen_cli
from dspark_jax.data import shards, splits
from dspark_jax.training import datagen
from dspark_jax.data.pipeline import (PackingConfig, ShardSource, block_labels, make_dataset, target_features)
from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig

TINY = ModelConfig(family="llama", vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, intermediate_size=48, max_position_embeddings=512)


# ---------------------------------------------------------------------------- splits


def test_split_is_fixed_disjoint_and_hash_based():
    assert splits.list_domains() == {"math": ("gsm8k", "math500", "aime24"),
                                     "code": ("humaneval", "mbpp", "livecodebench", "lbpp", "swe-bench"),
                                     "chat": ("arena-hard-v2",)}
    all_train, all_eval = set(), set()
    for name in splits.list_sets():
        train, evals = splits.split_prompts(name)
        assert (train, evals) == splits.split_prompts(name)  # deterministic
        assert not set(train) & set(evals)
        assert len(evals) >= 20, name
        assert set(train) | set(evals) == set(splits.load_set(name))
        # the side depends only on the prompt's own text: adding prompts never moves existing ones
        fraction = splits.eval_fraction(name)
        assert all(splits.prompt_bucket(p) < fraction for p in evals)
        assert all(splits.prompt_bucket(p) >= fraction for p in train)
        all_train |= set(train)
        all_eval |= set(evals)
    assert not all_train & all_eval  # no eval prompt of any set is training data of any set
    assert splits.split_prompts("aime24")[0] == []  # evaluation-only
    assert splits.parse_sets("math,mbpp") == ["gsm8k", "math500", "aime24", "mbpp"]
    with pytest.raises(UserError, match="unknown prompt set 'nope'"):
        splits.parse_sets("gsm8k,nope")


# ---------------------------------------------------------------------------- shards + datagen


def test_shard_round_trip(tmp_path):
    path = str(tmp_path / "shard-00000.npz")
    entry = shards.write_shard(path, [[5, 6, 7], [8]], [[9, 2], [10, 11, 65535]], ["a/1", "b/2"], [True, False])
    blob = open(path, "rb").read()
    assert entry == dict(file="shard-00000.npz", num_examples=2, num_tokens=9, response_tokens=5,
                         sha256=hashlib.sha256(blob).hexdigest())
    assert os.listdir(tmp_path) == ["shard-00000.npz"]  # no temporary left behind
    with np.load(path, allow_pickle=False) as z:  # two bytes a token on disk, deflated
        assert z["tokens"].dtype == np.uint16 and z["offsets"].tolist() == [0, 5, 9]
    with zipfile.ZipFile(path) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
    data = shards.read_shard(path, entry["sha256"])
    assert data["tokens"].dtype == np.int32 and data["tokens"].tolist() == [5, 6, 7, 9, 2, 8, 10, 11, 65535]
    assert data["prompt_lens"].tolist() == [3, 1] and data["finished"].tolist() == [True, False]
    assert data["example_ids"].tolist() == ["a/1", "b/2"]


def test_shards_are_compact_reproducible_and_hash_checked(tmp_path):
    a, b = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    rows = [list(range(k, k + 300)) for k in range(20)]
    entry = shards.write_shard(a, rows, rows, [f"s/{k}" for k in range(20)], [True] * 20)
    assert shards.write_shard(b, rows, rows, [f"s/{k}" for k in range(20)], [True] * 20)["sha256"] == entry["sha256"]
    assert os.path.getsize(a) < 2 * 12_000  # 12,000 tokens: under two bytes a token
    big = str(tmp_path / "big.npz")  # an id past uint16 keeps int32, read back the same
    shards.write_shard(big, [[70_000]], [[1]], ["s/x"], [False])
    with np.load(big, allow_pickle=False) as z:
        assert z["tokens"].dtype == np.int32
    assert shards.read_shard(big)["tokens"].tolist() == [70_000, 1]
    with open(a, "r+b") as f:  # one byte changed: the manifest's hash refuses it
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(UserError, match="sha256 is not the manifest's"):
        shards.read_shard(a, entry["sha256"])


def test_atomic_write_json_syncs_before_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None))
        fsync(fd)

    def recorded_replace(src, dst):
        events.append(("replace", os.path.basename(src)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    path = tmp_path / "manifest.json"
    files.atomic_write_json(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == ["manifest.json"]
    names = [e[0] for e in events]
    assert names == ["fsync", "replace", "fsync"], events  # the data, the rename, then the folder
    assert events[1][1].startswith(".manifest.json.") and events[1][1].endswith(".tmp")
    if events[0][1] is not None:
        assert events[0][1] is False and events[2][1] is True  # a file, then the folder


class WordTokenizer:
    """Stand-in for the target tokenizer: words -> ids, a tiny chat frame, stop id 2."""

    eos_token_ids = (2,)

    def chat_prompt_ids(self, text):
        words = [3 + int(splits.prompt_hash(w)[:6], 16) % (TINY.vocab_size - 3) for w in text.split()[:40]]
        return [1] + words + [2, 1]


@pytest.fixture(scope="module")
def tiny_target():
    return Target("tiny", "-", TINY, decoder.init_params(TINY, jax.random.key(0), scale=0.3), WordTokenizer())


GEN = dict(limit=3, max_new_tokens=6, temperature=0.7, top_k=20, top_p=0.9, batch_size=2, shard_size=2, seed=3,
           max_prompt_tokens=128, progress=False)


def shard_arrays(folder):
    m = shards.read_manifest(folder)
    return [{k: v.tolist() for k, v in shards.read_shard(os.path.join(folder, s["file"])).items()}
            for s in m["shards"]]


def test_datagen_resume_matches_uninterrupted_run(tmp_path, tiny_target):
    sets = ["gsm8k", "mbpp"]
    full = str(tmp_path / "full")
    m_full = datagen.generate_dataset(tiny_target, sets, "eval", full, **GEN)
    assert m_full["complete"] and m_full["num_examples"] == 6 and len(m_full["shards"]) == 3
    assert m_full["counts"]["gsm8k"] == dict(planned=3, truncated=0, done=3)

    part = str(tmp_path / "part")
    m1 = datagen.generate_dataset(tiny_target, sets, "eval", part, max_shards=1, **GEN)  # "interrupted"
    assert not m1["complete"] and len(m1["shards"]) == 1
    first = os.path.join(part, "shard-00000.npz")
    stamp = os.stat(first).st_mtime_ns
    m2 = datagen.generate_dataset(tiny_target, sets, "eval", part, **GEN)
    assert m2["complete"] and os.stat(first).st_mtime_ns == stamp  # not redone
    assert shard_arrays(part) == shard_arrays(full)
    assert {k: v for k, v in m2.items() if k != "created"} == {k: v for k, v in m_full.items() if k != "created"}
    for shard in shard_arrays(full):  # prompts = the chat-templated split prompts, stop token kept
        for k, pl in enumerate(shard["prompt_lens"]):
            ids = shard["tokens"][shard["offsets"][k]: shard["offsets"][k + 1]]
            assert ids[:pl][-2:] == [2, 1] and 1 <= len(ids) - pl <= 6
            assert shard["finished"][k] == (ids[-1] == 2 and len(ids) > pl)

    # a different setting or target is refused (one line), as is a foreign folder
    with pytest.raises(UserError, match="different settings .*max_new_tokens"):
        datagen.generate_dataset(tiny_target, sets, "eval", full, **dict(GEN, max_new_tokens=7))
    other = Target("other", "-", TINY, tiny_target.params, WordTokenizer())
    with pytest.raises(UserError, match="different settings .*target"):
        datagen.generate_dataset(other, sets, "eval", full, **GEN)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        datagen.generate_dataset(tiny_target, sets, "eval", str(tmp_path / "foreign"), **GEN)


def test_datagen_responses_do_not_depend_on_the_batch_size(tmp_path, tiny_target):
    """Each response has its own key (from its example id), so the rows decoding beside it, the
    batch size and the refill order change nothing: the shards of any batch size are the same."""
    sets = ["gsm8k", "mbpp"]
    runs = [shard_arrays(str(tmp_path / f"b{b}")) for b in (1, 4)
            if datagen.generate_dataset(tiny_target, sets, "eval", str(tmp_path / f"b{b}"), **dict(GEN, batch_size=b))]
    assert runs[0] == runs[1]
    greedy = str(tmp_path / "greedy")
    datagen.generate_dataset(tiny_target, sets, "eval", greedy, **dict(GEN, temperature=0.0))
    assert shard_arrays(greedy) != runs[0]  # the sampled responses are sampled


def test_long_prompts_keep_their_start_and_end():
    from dspark_jax.checkpoints.registry import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    text = "Task: add the numbers below.\n" + " ".join(str(i) for i in range(600)) + "\nQuestion: what is the sum?"
    full = tokenizer.chat_prompt_ids(text)
    ids, cut = datagen.fit_prompt(tokenizer, text, 256)
    assert cut and 250 <= len(ids) <= 256 < len(full)
    shown = tokenizer.decode(ids)
    assert "Task: add the numbers below." in shown and "what is the sum?" in shown and "[...]" in shown
    assert datagen.fit_prompt(tokenizer, text, len(full)) == (full, False)
    with pytest.raises(UserError, match="no room"):
        datagen.fit_prompt(tokenizer, text, 10)


def assert_cli_fails(capsys, message, *argv):
    code = datagen_cli.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_cli_one_line_errors(capsys, tmp_path):
    out = str(tmp_path / "o")
    assert_cli_fails(capsys, "unknown prompt set 'nope'", "--sets", "gsm8k,nope", "--out", out)
    assert_cli_fails(capsys, "prompt set 'aime24' has no train prompts", "--sets", "aime24", "--out", out)
    assert_cli_fails(capsys, "unknown split 'test'", "--sets", "gsm8k", "--split", "test", "--out", out)
    assert_cli_fails(capsys, "--limit must be at least 1", "--sets", "gsm8k", "--limit", "0", "--out", out)
    with pytest.raises(UserError, match="not a datagen output folder"):
        ShardSource(str(tmp_path))
    with pytest.raises(UserError, match="exceeds max_blocks"):
        PackingConfig(batch_size=2, seq_len=64, max_blocks=2, block_size=4, anchors_per_seq=3)


def test_cli_on_tiny_hf_target(capsys, tmp_path, tiny_target_folder):
    out = str(tmp_path / "o")
    argv = ["--target", tiny_target_folder, "--sets", "mbpp,humaneval", "--split", "eval", "--limit", "2",
            "--max-new-tokens", "4", "--max-prompt-tokens", "200", "--batch-size", "3", "--out", out, "--quiet"]
    assert datagen_cli.main(argv) == 0, capsys.readouterr().err
    m = shards.read_manifest(out)
    assert m["complete"] and m["num_examples"] == 4 and m["sets"] == ["humaneval", "mbpp"]
    assert m["sampling"] == dict(temperature=0.7, top_k=20, top_p=0.8) and m["split"] == "eval"
    argv[3] = "humaneval,mbpp"
    assert datagen_cli.main(argv) == 0  # already complete (set order is not a setting): nothing to do
    capsys.readouterr()
    assert_cli_fails(capsys, "different settings (max_new_tokens: 4 there, 5 now)",
                     *[a if a != "4" else "5" for a in argv])
    assert_cli_fails(capsys, "exceeds the target's context of 256 tokens",
                     *[a if a != "200" else "1024" for a in argv])
    # a domain (or "all") leaves out its sets without prompts in the split: aime24 is eval-only
    math = str(tmp_path / "math")
    assert datagen_cli.main(["--target", tiny_target_folder, "--sets", "math", "--split", "train", "--limit", "1",
                             "--max-new-tokens", "2", "--max-prompt-tokens", "200", "--out", math, "--quiet"]) == 0
    assert shards.read_manifest(math)["sets"] == ["gsm8k", "math500"]


# ---------------------------------------------------------------------------- pipeline


def write_fake_dataset(folder, examples, target="tiny"):
    """examples: [(prompt ids, response ids)] -> a datagen folder (2 shards)."""
    os.makedirs(folder, exist_ok=True)
    entries = []
    half = (len(examples) + 1) // 2
    for i, chunk in enumerate([examples[:half], examples[half:]]):
        entries.append(shards.write_shard(os.path.join(folder, shards.shard_name(i)), [p for p, _ in chunk],
                                           [r for _, r in chunk], [f"fake/{i}-{k}" for k in range(len(chunk))],
                                           [False] * len(chunk)))
    manifest = dict(format=shards.FORMAT, target=target, target_shape=dict(vocab_size=64, hidden_size=32,
                                                                             num_layers=3), shards=entries)
    with open(os.path.join(folder, shards.MANIFEST), "w") as f:
        json.dump(manifest, f)


def fake_examples(seed=0, count=24, vocab=None):
    """Example i starts with the unique token 1000 + i (so packed segments can be traced back)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        p, r = int(rng.integers(3, 30)), int(rng.integers(1, 60))
        if i == 5:
            r = 150  # longer than seq_len: must be truncated
        if i == 6:
            r = 1  # no valid anchor: dropped
        ids = rng.integers(1, vocab or 900, p + r)
        ids[0] = i + 1 if vocab else 1000 + i
        out.append((ids[:p].tolist(), ids[p:].tolist()))
    return out


CFG = PackingConfig(batch_size=3, seq_len=96, max_blocks=6, block_size=4, anchors_per_seq=3, seed=7, num_epochs=2)


def segments(batch):
    """(row, segment id, slot start, slot end) of every packed sequence."""
    out = []
    for b, row in enumerate(batch["segment_ids"]):
        for s in np.unique(row[row > 0]):
            slots = np.nonzero(row == s)[0]
            out.append((b, int(s), int(slots[0]), int(slots[-1]) + 1))
    return out


def test_packing_invariants_and_anchors(tmp_path):
    examples = fake_examples()
    write_fake_dataset(str(tmp_path / "d"), examples)
    batches = list(make_dataset(str(tmp_path / "d"), CFG))
    B, S, NB, G = CFG.batch_size, CFG.seq_len, CFG.max_blocks, CFG.block_size
    seen, anchors_by_epoch = [], {}
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            "tokens": ((B, S), np.int32), "positions": ((B, S), np.int32), "segment_ids": ((B, S), np.int32),
            "loss_mask": ((B, S), bool), "block_start": ((B, NB), np.int32), "block_valid": ((B, NB), bool),
            "token_index": ((B, S), np.int64)}
        pad = batch["segment_ids"] == 0
        assert not batch["tokens"][pad].any() and not batch["loss_mask"][pad].any()
        blocks_seen = 0
        for b, s, start, end in segments(batch):
            assert (batch["segment_ids"][b, start:end] == s).all()  # contiguous: segments never mix
            assert batch["positions"][b, start:end].tolist() == list(range(end - start))
            i = int(batch["tokens"][b, start]) - 1000
            prompt, response = examples[i]
            full = prompt + response
            assert batch["tokens"][b, start:end].tolist() == full[: end - start]
            assert batch["loss_mask"][b, start:end].tolist() == [k >= len(prompt) for k in range(end - start)]
            mine = batch["block_valid"][b] & (batch["segment_ids"][b, batch["block_start"][b]] == s)
            anchors = batch["block_start"][b][mine] - start
            blocks_seen += len(anchors)
            assert len(anchors) == min(3, min(len(full) - 2, S - G - 1) - len(prompt) + 1)
            assert len(set(anchors.tolist())) == len(anchors)
            # anchors inside the response, each predicting at least one response token, block fits in S
            assert (anchors >= len(prompt)).all() and (anchors + 1 <= len(full) - 1).all()
            assert (anchors <= S - G - 1).all()
            # anchor-bounded truncation: kept exactly up to the last block's last label
            assert end - start == min(anchors.max() + G + 1, len(full))
            seen.append(i)
            anchors_by_epoch.setdefault(i, []).append(tuple(anchors))
        assert blocks_seen == batch["block_valid"].sum() <= B * NB
        # every valid label stays inside its own block's segment and is a response token
        idx, valid = block_labels(batch, G)
        rows = np.arange(B)[:, None, None]
        anchor_seg = np.take_along_axis(batch["segment_ids"], batch["block_start"], 1)[:, :, None]
        assert (batch["segment_ids"][rows, idx][valid] == np.broadcast_to(anchor_seg, idx.shape)[valid]).all()
        assert batch["loss_mask"][rows, idx][valid].all()
        assert valid[..., 0][batch["block_valid"]].all()  # slot 0 always has a label
    on_device = block_labels({k: jnp.asarray(v) for k, v in batches[0].items()}, G)
    np.testing.assert_array_equal(on_device[0], block_labels(batches[0], G)[0])
    np.testing.assert_array_equal(on_device[1], block_labels(batches[0], G)[1])
    usable = [i for i, (p, r) in enumerate(examples) if len(r) >= 2]
    assert 6 not in usable and 5 in usable
    assert sorted(seen) == sorted(usable * 2)  # every usable example once per epoch
    assert sum(a[0] != a[1] for a in anchors_by_epoch.values()) >= len(usable) // 2  # resampled per epoch
    assert sum(b["block_valid"].any(1).sum() for b in batches[:-1]) == B * (len(batches) - 1)


def test_iterator_state_restores_exactly(tmp_path):
    write_fake_dataset(str(tmp_path / "d"), fake_examples(1, count=40))
    cfg = PackingConfig(batch_size=2, seq_len=96, max_blocks=6, block_size=4, anchors_per_seq=3, seed=1)
    ds = make_dataset(str(tmp_path / "d"), cfg)
    it = iter(ds)
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(30)]  # crosses the epoch boundary
    resumed = iter(make_dataset(str(tmp_path / "d"), cfg))
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_process_sharding_is_disjoint(tmp_path):
    import grain

    write_fake_dataset(str(tmp_path / "d"), fake_examples(2, count=20))
    cfg = PackingConfig(batch_size=2, seq_len=96, max_blocks=6, block_size=4, anchors_per_seq=2, num_epochs=1)
    firsts = []
    for index in range(2):
        opts = grain.sharding.ShardOptions(shard_index=index, shard_count=2, drop_remainder=True)
        got = set()
        for batch in make_dataset(str(tmp_path / "d"), cfg, shard_options=opts):
            got |= {int(batch["tokens"][b, start]) for b, _, start, _ in segments(batch)}
        firsts.append(got)
    assert not firsts[0] & firsts[1] and len(firsts[0]) + len(firsts[1]) == 18  # 19 usable, remainder dropped


def test_target_features_match_each_sequence_alone(tmp_path):
    examples = fake_examples(3, count=8, vocab=TINY.vocab_size)
    write_fake_dataset(str(tmp_path / "d"), examples)
    cfg = PackingConfig(batch_size=2, seq_len=128, max_blocks=16, block_size=4, anchors_per_seq=4, num_epochs=1)
    batch = next(iter(make_dataset(str(tmp_path / "d"), cfg)))
    params = decoder.init_params(TINY, jax.random.key(1), scale=0.1)
    taps = (1, 3)
    ctx, last = target_features(params, TINY, batch, taps)
    assert ctx.shape == (2, 128, 2 * TINY.hidden_size) and last.shape == (2, 128, TINY.hidden_size)
    forward = jax.jit(lambda p, t, c, n: decoder.forward(p, TINY, t, c, n, tap_layers=taps))
    packed = segments(batch)
    assert len(packed) > 2  # some row holds several sequences
    for b, _, start, end in packed:
        alone_tokens = np.zeros((1, 128), np.int32)  # one shape for every sequence: one compilation
        alone_tokens[0, : end - start] = batch["tokens"][b, start:end]
        cache = decoder.init_cache(TINY, 1, 128)
        hidden, _, alone = forward(params, alone_tokens, cache, jnp.asarray([end - start]))
        hidden, alone = hidden[:, : end - start], alone[:, :, : end - start]
        np.testing.assert_allclose(last[b, start:end], hidden[0], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(ctx[b, start:end], jnp.concatenate([alone[0, 0], alone[1, 0]], -1),
                                   atol=1e-4, rtol=1e-4)
