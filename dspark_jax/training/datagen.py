"""Regenerate training responses with the TARGET (the library of `python -m dspark_jax.datagen`): a client
of the engine, so it lives above it.

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

The folder's format (shards, manifest): `dspark_jax.data.shards`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.data.shards import FORMAT, MANIFEST, read_manifest, read_shard_bytes, shard_entry, shard_name, write_shard


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
    from dspark_jax.models.sampling import SamplingConfig

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
