"""Regenerate training responses with the TARGET (the library of `python -m dspark_jax.datagen`).

    python -m dspark_jax.datagen --target smollm2-135m --sets gsm8k,humaneval,arena-hard-v2 \
        --split train --out data/smollm2-train [--limit N] [--max-new-tokens 512] \
        [--temperature 0.7 --top-p 0.8 --top-k 20] [--batch-size 32] [--shard-size 64] [--seed 0]

Every prompt of the chosen sets and split (see `dspark_jax.data.splits`; `--limit N` keeps the
first N per set in file order) is rendered with the target's chat template (one user turn) and
answered by the target (sampling settings as DeepSpec: T=0.7, top-p 0.8, top-k 20; --temperature 0
for greedy responses). A prompt longer than --max-prompt-tokens keeps the start and the end of its
text with a "[...]" between (`fit_prompt`; counted in the manifest as truncated).

Decoding. The prompts are decoded with continuous batching (`engine.generate.serve`): --batch-size
rows decode together and a finished row takes the next prompt at once, so short responses do not
wait for the longest one in their batch. Each response is drawn with its own random key,
fold_in(key(--seed), the first 8 hex digits of its example id), so it does not depend on the rows
beside it, the batch size or where a run was interrupted.

Plan and resumability. All prompts are sorted by (token length, id) and cut into shards of
--shard-size. The plan is a pure function of the settings, so a run that is interrupted and
restarted produces the shards an uninterrupted run would (byte for byte where decoding is
batch-invariant: the CPU kernels in fp32, up to 32 rows): on restart, shards already on disk are
checked and skipped.

Several processes (`python -m dspark_jax.datagen ... --num-processes N --process-id I
--coordinator-address HOST:PORT`, the same command on each) share the plan: shard i is generated
and written (atomically, its own file, as soon as its last response is done) by process i % N on
its own devices, process 0 alone reads the old manifest and writes the new one once every
process's shards are in. The shards and the manifest are those of a one-process run with the same
settings (the shards byte for byte), and an interrupted run resumes with any number of processes. The folder must be one all processes see: a
shared disk or an object store URL (`--out gs://bucket/data`, see `core.files`).

Output folder:
* `shard-00000.npz` ... one per batch, written atomically (`core.files.atomic_writer`: never half
  written), deflate-compressed and with fixed member dates, so the same arrays give the same bytes
  (small enough to commit to git: docs/training.md). Arrays (all plain dtypes;
  `np.load(path, allow_pickle=False)` works; `read_shard` returns the tokens as int32):
    tokens        uint16 [sum of lengths] prompt ids then response ids of every example, flat
                  (int32 where an id is 65,536 or more; shards of older runs are int32 throughout)
    offsets       int64 [n + 1]           example k is tokens[offsets[k]:offsets[k+1]]
    prompt_lens   int32 [n]               the first prompt_lens[k] ids of example k are the prompt
    finished      bool  [n]               the response ends with a stop token (it is included)
    example_ids   str   [n]               "<set>/<first 16 hex of sha256(prompt text)>"
* `manifest.json`: format, target (name + shape), sampling, max_new_tokens, max_prompt_tokens,
  seed, shard_size, split, sets, limit, planned/done/truncated counts per set, shard list (each with
  the sha256 of its file, checked whenever the shard is read back: a resumed run, training),
  complete.
  A folder made with other settings is refused (one line, exit status 2).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import time
from typing import Sequence

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.errors import UserError

FORMAT = "dspark-datagen-v1"
MANIFEST = "manifest.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npz"


# ---------------------------------------------------------------------------- shard files


def write_shard(path: str, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                example_ids: Sequence[str], finished: Sequence[bool]) -> dict:
    """Write one shard atomically (`files.atomic_writer`). Returns its manifest entry."""
    if not (len(prompts) == len(responses) == len(example_ids) == len(finished)):
        raise ValueError("shard columns differ in length")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    offsets = np.zeros(len(lengths) + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    tokens = np.zeros(int(offsets[-1]), np.int64)
    for k, (p, r) in enumerate(zip(prompts, responses)):
        tokens[offsets[k]: offsets[k] + len(p)] = p
        tokens[offsets[k] + len(p): offsets[k + 1]] = r
    # Two bytes a token for every vocabulary under 65,536 (SmolLM2, Llama 2): the data then fits in git.
    tokens = tokens.astype(np.uint16 if tokens.size == 0 or (0 <= tokens.min() and tokens.max() < 2**16) else np.int32)
    arrays = dict(tokens=tokens, offsets=offsets, prompt_lens=np.asarray([len(p) for p in prompts], np.int32),
                  finished=np.asarray(finished, bool), example_ids=np.asarray(list(example_ids), dtype=str))
    buffer = io.BytesIO()
    save_npz(buffer, arrays)
    blob = buffer.getvalue()
    files.atomic_write_bytes(path, blob)
    return shard_entry(os.path.basename(path), blob, arrays)


def shard_entry(name: str, blob: bytes, data: dict[str, np.ndarray]) -> dict:
    """A shard's manifest entry: its counts and the sha256 of its file's bytes."""
    return dict(file=name, num_examples=len(data["prompt_lens"]), num_tokens=int(len(data["tokens"])),
                response_tokens=int(len(data["tokens"]) - data["prompt_lens"].sum()),
                sha256=hashlib.sha256(blob).hexdigest())


def save_npz(f, arrays: dict[str, np.ndarray]) -> None:
    """`np.savez_compressed(f, **arrays)` (the same .npz: deflated zip64 .npy members), but every
    member dated 1980-01-01 instead of now, so that the same arrays give the same bytes: a shard is
    then byte for byte the same whichever run, or process, made it."""
    import zipfile

    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as z:
        for key, value in arrays.items():
            info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def read_shard(path: str, sha256: str | None = None) -> dict[str, np.ndarray]:
    """The arrays of one shard (see the module docstring), loaded without pickle, tokens as int32.
    With `sha256` (its manifest entry's), a file whose bytes hash otherwise is refused."""
    data, _ = read_shard_bytes(path, sha256)
    return data


def read_shard_bytes(path: str, sha256: str | None = None) -> tuple[dict[str, np.ndarray], bytes]:
    """`read_shard`, and the file's bytes (for its manifest entry)."""
    blob = files.read_bytes(path)
    if sha256 is not None and hashlib.sha256(blob).hexdigest() != sha256:
        raise UserError(f"corrupt data shard {path}: its sha256 is not the manifest's (changed or damaged since "
                        "it was written)")
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            data = {k: z[k] for k in ("tokens", "offsets", "prompt_lens", "finished", "example_ids")}
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise UserError(f"corrupt data shard {path}: {e}") from None
    n = len(data["prompt_lens"])
    if len(data["offsets"]) != n + 1 or data["offsets"][-1] != len(data["tokens"]):
        raise UserError(f"corrupt data shard {path}: offsets do not match the tokens")
    data["tokens"] = data["tokens"].astype(np.int32)
    return data, blob


def read_json_file(path: str, fmt: str, missing: str, hint: str = "") -> dict:
    """A JSON file with a "format" field (a manifest, a cache's metadata): UserError `missing` if it
    does not exist, a one-line UserError (ending in `hint`) if it is corrupt or of another format."""
    try:
        obj = json.loads(files.read_bytes(path))
    except FileNotFoundError:
        raise UserError(missing) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"corrupt {path}: {e}{hint}") from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        found = obj.get("format") if isinstance(obj, dict) else None
        raise UserError(f"{path}: unknown format {found!r} (expected {fmt}){hint}")
    return obj


def read_manifest(folder: str) -> dict:
    return read_json_file(os.path.join(folder, MANIFEST), FORMAT,
                          f"{folder} is not a datagen output folder (no {MANIFEST})")


# ---------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Example:
    example_id: str
    prompt_ids: tuple[int, ...]


TRUNCATION_MARK = "\n\n[...]\n\n"


def fit_prompt(tokenizer, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """The chat prompt ids of `text`, at most `max_tokens` of them: a longer text keeps its first
    three quarters and its last quarter of what fits (a task statement opens a prompt and its
    question often closes it), joined by TRUNCATION_MARK. Returns (ids, truncated)."""
    ids = tokenizer.chat_prompt_ids(text)
    if len(ids) <= max_tokens:
        return ids, False
    body = tokenizer.encode(text)
    budget = len(body) - (len(ids) - max_tokens) - len(tokenizer.encode(TRUNCATION_MARK))
    while budget > 0:
        head = budget * 3 // 4
        short = tokenizer.decode(body[:head]) + TRUNCATION_MARK + tokenizer.decode(body[len(body) - (budget - head):])
        ids = tokenizer.chat_prompt_ids(short)
        if len(ids) <= max_tokens:  # re-tokenising at the seams can cost a token or two: shrink until it fits
            return ids, True
        budget -= max(1, len(ids) - max_tokens)
    raise UserError(f"--max-prompt-tokens={max_tokens} leaves no room for a prompt's text after the chat template")


def plan_examples(tokenizer, sets: Sequence[str], split: str, limit: int | None,
                  max_prompt_tokens: int) -> tuple[list[Example], dict]:
    """Every example to generate, sorted by (prompt length, id), and per-set counts."""
    from dspark_jax.data.splits import get_split, prompt_hash

    examples, counts = [], {}
    for name in sets:
        prompts = get_split(name, split)
        if limit is not None:
            prompts = prompts[:limit]
        if not prompts:
            raise UserError(f"prompt set {name!r} has no {split} prompts")
        truncated = 0
        for text in prompts:
            ids, cut = fit_prompt(tokenizer, text, max_prompt_tokens)
            truncated += cut
            examples.append(Example(f"{name}/{prompt_hash(text)[:16]}", tuple(ids)))
        counts[name] = dict(planned=len(prompts), truncated=truncated)
    examples.sort(key=lambda e: (len(e.prompt_ids), e.example_id))
    return examples, counts


def request_id(example_id: str) -> int:
    """The id an example's random key is folded from: the first 8 hex digits of its prompt hash."""
    return int(example_id.split("/")[1][:8], 16)


def _check_compatible(folder: str, settings: dict) -> dict | None:
    """The existing manifest if `folder` holds a run with the same settings; None if empty/new."""
    if files.exists(folder) and not files.is_dir(folder):
        raise UserError(f"--out {folder} exists and is not a folder")
    names = files.listdir(folder)  # [] for a new folder (on an object store: a prefix without objects)
    if MANIFEST not in names:
        if any(not f.endswith(".tmp") for f in names):
            raise UserError(f"--out {folder} is not empty and holds no {MANIFEST}: refusing to write there")
        return None
    manifest = read_manifest(folder)
    for key, value in settings.items():
        if manifest.get(key) != value:
            raise UserError(f"--out {folder} was generated with different settings ({key}: "
                            f"{json.dumps(manifest.get(key))} there, {json.dumps(value)} now); use another --out")
    return manifest


class _Interrupt(Exception):
    """Raised from the decode loop once `max_shards` new shards are written."""


def generate_dataset(target, sets: Sequence[str], split: str, out: str, *, limit: int | None = None,
                     max_new_tokens: int = 512, temperature: float = 0.7, top_k: int = 20, top_p: float = 0.8,
                     batch_size: int = 32, shard_size: int = 64, seed: int = 0, max_prompt_tokens: int = 1024,
                     max_shards: int | None = None, progress: bool = True) -> dict:
    """Generate (or resume) the dataset in `out`. `target` is a registry `Target`.

    `batch_size` rows decode together (not a setting of the data: the responses do not depend on
    it); `max_shards` stops after writing that many NEW shards (tests use it to simulate an
    interrupt). Returns the manifest.
    """
    from tqdm.auto import tqdm

    from dspark_jax.distributed import gather
    from dspark_jax.engine.generate import serve
    from dspark_jax.engine.sampling import SamplingConfig

    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if batch_size < 1 or shard_size < 1:
        raise UserError("--batch-size and --shard-size must be at least 1")
    if limit is not None and limit < 1:
        raise UserError("--limit must be at least 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise UserError("need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if max_prompt_tokens + max_new_tokens > target.config.max_position_embeddings:
        raise UserError(f"--max-prompt-tokens {max_prompt_tokens} + --max-new-tokens {max_new_tokens} exceeds the "
                        f"target's context of {target.config.max_position_embeddings} tokens")
    from dspark_jax.data.splits import domain_of, list_sets

    for name in sets:
        domain_of(name)  # validates
    sets = sorted(dict.fromkeys(sets), key=list_sets().index)  # canonical order: --sets order is no setting
    cfg = target.config
    settings = dict(
        format=FORMAT, target=target.name,
        target_shape=dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers),
        sampling=dict(temperature=temperature, top_k=top_k, top_p=top_p),
        max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens, seed=seed, shard_size=shard_size,
        split=split, sets=list(sets), limit=limit, stop_ids=[int(i) for i in target.tokenizer.eos_token_ids])
    # Several processes: shard i is made (and its file written) by process i % processes, process
    # 0 alone reads the old manifest and writes the new one, from every process's shard list.
    processes, me, primary = gather.process_count(), gather.process_index(), gather.is_primary()
    existing = gather.on_primary(lambda: _check_compatible(out, settings))
    examples, counts = plan_examples(target.tokenizer, sets, split, limit, max_prompt_tokens)
    batches = [examples[i: i + shard_size] for i in range(0, len(examples), shard_size)]
    mine = [i for i in range(len(batches)) if i % processes == me]
    files.makedirs(out)

    listed = {entry["file"]: entry.get("sha256") for entry in (existing or {}).get("shards", [])}

    def resumed() -> list:  # this process's finished shards that match the plan (and the manifest's hashes)
        found, present = [], set(files.listdir(out))  # one listing, not a request per shard
        for index in mine:
            path = os.path.join(out, shard_name(index))
            if shard_name(index) not in present:
                continue
            data, blob = read_shard_bytes(path, listed.get(shard_name(index)))
            if [str(i) for i in data["example_ids"]] != [e.example_id for e in batches[index]]:
                raise UserError(f"{path} does not match the plan of this run (different prompt files?); "
                                "use another --out")
            found.append((index, shard_entry(shard_name(index), blob, data)))
        return found

    shards: dict[int, dict] = {}

    def collect(entries: list) -> None:  # every process's (index, entry) pairs into `shards`
        for found in gather.allgather_json(entries):
            shards.update((int(index), entry) for index, entry in found)

    collect(gather.everywhere(resumed))

    def manifest() -> dict:
        done = {name: 0 for name in sets}
        for index in shards:
            for e in batches[index]:
                done[e.example_id.split("/")[0]] += 1
        per_set = {name: dict(counts[name], done=done[name]) for name in sets}
        entries = [shards[i] for i in sorted(shards)]
        return dict(settings, counts=per_set, num_examples=sum(s["num_examples"] for s in entries),
                    num_planned=len(examples), num_tokens=sum(s["num_tokens"] for s in entries),
                    response_tokens=sum(s["response_tokens"] for s in entries), num_shards_planned=len(batches),
                    shards=entries, complete=len(shards) == len(batches),
                    created=(existing or {}).get("created", created))

    created = gather.broadcast_json(time.strftime("%Y-%m-%dT%H:%M:%S"))  # one date for every process
    if primary:
        files.atomic_write_json(os.path.join(out, MANIFEST), manifest())
    sampling = SamplingConfig(temperature, top_k, top_p)
    stop_ids = tuple(target.tokenizer.eos_token_ids)
    todo = [i for i in mine if i not in shards]
    bar = tqdm(total=len(examples), initial=sum(len(batches[i]) for i in shards), unit="prompt",
               desc=f"datagen {split}", disable=not progress or not primary, dynamic_ncols=True, mininterval=5.0)
    queue = [e for i in todo for e in batches[i]]  # in plan order: rows decode prompts of similar lengths
    shard_of = [i for i in todo for _ in batches[i]]
    responses: dict[int, dict[str, list[int]]] = {i: {} for i in todo}
    made = []

    def finish(k: int, tokens: list[int], stats: dict) -> None:
        index = shard_of[k]
        responses[index][queue[k].example_id] = tokens
        bar.update(1)
        if len(responses[index]) < len(batches[index]):
            return
        batch = batches[index]
        got = responses.pop(index)
        answers = [got[e.example_id] for e in batch]
        shards[index] = write_shard(os.path.join(out, shard_name(index)), [list(e.prompt_ids) for e in batch],
                                    answers, [e.example_id for e in batch],
                                    [bool(r) and r[-1] in stop_ids for r in answers])
        made.append((index, shards[index]))
        if primary:  # the others' new shards join the manifest at the end
            files.atomic_write_json(os.path.join(out, MANIFEST), manifest())
        bar.set_postfix(shard=f"{len(shards)}/{len(batches)}", refresh=False)
        if max_shards is not None and len(made) >= max_shards:
            raise _Interrupt

    def progress_tokens(tokens: int, seconds: float) -> None:
        bar.set_postfix(shard=f"{len(shards)}/{len(batches)}", tok_s=f"{tokens / max(seconds, 1e-9):.0f}", refresh=False)

    if queue:
        try:
            serve(target.params, cfg, [list(e.prompt_ids) for e in queue], slots=batch_size,
                  max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids, seed=seed,
                  request_ids=[request_id(e.example_id) for e in queue], each_alone=True,
                  on_finish=finish, on_progress=progress_tokens)
        except _Interrupt:
            pass
    if processes > 1:  # every process's shards are written (the gather waits for all): the manifest
        known = set(shards)
        collect(made)
        bar.update(sum(len(batches[i]) for i in set(shards) - known))
        if primary:
            files.atomic_write_json(os.path.join(out, MANIFEST), manifest())
    bar.close()
    return manifest()
