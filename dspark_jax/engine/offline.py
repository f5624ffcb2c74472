"""Offline generation over a list of prompts (`python -m dspark_jax.decode`): requests, the
resumable results file, the engine run (continuous or static batches, plain or speculative) and
the reporting of results in input order.

The run's settings are one `DecodeSettings` value (`engine.decode_settings`, which documents every
field); `decode_settings.resolve` settles what the flags leave open before any weights load. The
pipeline, top to bottom: read the prompts, select what is left to do, tokenize, run, write.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys

from dspark_jax.core.errors import UserError
from dspark_jax.core import files
from dspark_jax.data.prompt_files import PromptRecord, prompt_text, read_prompt_records
from dspark_jax.distributed import gather
from dspark_jax.engine.decode_settings import DecodeSettings, resolve
from dspark_jax.engine.speculative_run import Speculative, load_speculative, request_stats

# Continuous batching runs prompts in groups of equal KV-cache length (shortest first), since with
# several rows every step attends over the whole cache; a group smaller than this many prompts per
# slot joins the next longer one, as the tail of a group (slots idling while its last requests
# finish) would cost more than the shorter cache saves (about slots / (2 x group size) of the group).
MIN_GROUP_PER_SLOT = 8
RESULTS_FORMAT = "dspark_jax.decode/1"
TIMING_FIELDS = ("request_wall_s", "request_tokens_per_s")  # the fields that differ between identical runs


# ----------------------------------------------------------------------------- requests


@dataclasses.dataclass
class Request:
    index: int  # position in the whole input (--prompt ones, then the file's lines), before --offset
    prompt: PromptRecord
    sha256: str  # of the prompt (text or messages): its identity in --output
    ids: list[int] | None = None  # prompt token ids, once tokenised


def prompt_sha256(record: PromptRecord) -> str:
    content = {"prompt": record.text} if record.messages is None else {"messages": list(record.messages)}
    return hashlib.sha256(json.dumps(content, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def read_inputs(settings: DecodeSettings) -> list[PromptRecord]:
    """Every prompt of the command line, --prompt ones first (not yet --offset / --limit)."""
    records = [PromptRecord(f"prompt {i}", text=prompt_text(p)) for i, p in enumerate(settings.prompt, 1)]
    if settings.prompts_file:
        records += read_prompt_records(settings.prompts_file)
    if not records:
        raise UserError("give at least one --prompt or a --prompts-file")
    return records


def select(settings: DecodeSettings, records: list[PromptRecord]) -> list[Request]:
    """The requests --offset / --limit select, each checked (no empty prompt, no conversation with --raw)."""
    if settings.offset >= len(records):
        raise UserError(f"--offset {settings.offset} skips all {len(records)} prompts")
    end = len(records) if settings.limit is None else min(len(records), settings.offset + settings.limit)
    chosen = []
    for index in range(settings.offset, end):
        rec = records[index]
        if rec.messages is None and not rec.text.strip():
            raise UserError(f"{rec.source} is empty" if rec.source.startswith("prompt ") else
                            f"{rec.source}: the prompt is empty")
        if rec.messages is not None and not any(m["content"].strip() for m in rec.messages):
            raise UserError(f"{rec.source}: every message is empty")
        if rec.messages is not None and settings.raw:
            raise UserError(f'{rec.source}: a conversation ("messages") needs the chat template; drop --raw')
        chosen.append(Request(index, rec, prompt_sha256(rec)))
    return chosen


# ----------------------------------------------------------- --output: what is left to do


def generation_settings(settings: DecodeSettings, target_name: str) -> dict:
    """What decides a result (the --output header): a resumed run must match it exactly. Execution
    choices (--max-batch, --batching, --length-groups) are left out: greedy output does not depend
    on them."""
    from dspark_jax.checkpoints.registry import KNOWN_TARGETS

    header = {"target": settings.target if settings.target in KNOWN_TARGETS else os.path.abspath(settings.target),
                "target_name": target_name, "dtype": settings.dtype, "raw": settings.raw,
                "max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature, "top_k": settings.top_k,
                "top_p": settings.top_p, "seed": settings.seed,
                "drafter": settings.drafter if settings.drafter == "none" else files.absolute(settings.drafter)}
    if settings.drafter != "none":
        header.update(scheduler=settings.scheduler, gamma=settings.gamma, plain_steps=settings.plain_steps == "on")
        if settings.scheduler == "threshold":
            header["threshold"] = settings.threshold
    return header


class ResultsFile:
    """--output: JSONL, a header line {"format", "settings"} then one record per finished request,
    appended as it completes (one write of the whole line, then fsync). Reading it back checks the
    header against this run's settings and every record's `prompt_sha256` against the prompt now at
    its `index`; a last line without its newline (a write cut short by a kill) is dropped. The file
    is locked while a run uses it.

    On an object store (--output gs://...) an object cannot be appended to or locked: the whole
    object is rewritten at most every files.OBJECT_REWRITE_S seconds and at the end
    (`files.AppendedObject`), so a kill loses at most that much work (the resume redoes it), and two
    runs must not share one URL."""

    def __init__(self, path: str, settings: dict, hashes: list[str]):
        self.path, self.settings = path, settings
        self.fd: int | None = None  # a local file
        self.object: files.AppendedObject | None = None  # an object-store URL
        self.records: dict[int, dict] = {}
        self.keep = 0  # bytes of complete lines (what stays when a torn last line is cut)
        self.size = 0
        self.data = b""  # what an object held when opened
        if files.is_url(path):
            if files.is_dir(path):
                raise UserError(f"--output {path} is a folder")
            if files.exists(path):
                try:
                    self.data = files.read_bytes(path)
                except OSError as e:
                    raise UserError(f"cannot read --output {path}: {e}") from None
                self._read(self.data, hashes)
            return
        if os.path.isdir(path):
            raise UserError(f"--output {path} is a directory")
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UserError(f"--output {path}: no such folder {os.path.dirname(os.path.abspath(path))}")
        if os.path.exists(path):
            try:
                self.fd = os.open(path, os.O_RDWR)
            except OSError as e:
                raise UserError(f"cannot open --output {path}: {e.strerror}") from None
            try:
                self._lock()
                with os.fdopen(os.dup(self.fd), "rb") as f:
                    self._read(f.read(), hashes)
            except BaseException:
                self.close()
                raise

    def _lock(self) -> None:
        import fcntl

        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"--output {self.path} is in use by another decode run") from None

    def _read(self, data: bytes, hashes: list[str]) -> None:
        self.size = len(data)
        self.keep = data.rfind(b"\n") + 1
        lines = data[: self.keep].split(b"\n")[:-1]
        if not lines:  # empty, or a header cut short
            if data and not data.startswith(b'{"format"'):
                raise UserError(f"--output {self.path} is not a results file of python -m dspark_jax.decode")
            return
        header = self._parse(lines[0], 1)
        if not isinstance(header, dict) or header.get("format") != RESULTS_FORMAT:
            raise UserError(f"{self.path}:1: not a results file of python -m dspark_jax.decode "
                            f"(no {RESULTS_FORMAT} header); use another --output")
        if header.get("settings") != self.settings:
            old = header.get("settings") if isinstance(header.get("settings"), dict) else {}
            diff = [f"{k} {old.get(k)!r} there, {self.settings.get(k)!r} now"
                    for k in sorted(set(old) | set(self.settings)) if old.get(k) != self.settings.get(k)]
            raise UserError(f"--output {self.path} holds results of other settings ({'; '.join(diff)}): use another "
                            "--output, or delete the file to start afresh")
        for number, line in enumerate(lines[1:], 2):
            if not line.strip():
                continue
            record = self._parse(line, number)
            index = record.get("index") if isinstance(record, dict) else None
            if not isinstance(index, int) or not isinstance(record.get("prompt_sha256"), str):
                raise UserError(f"{self.path}:{number}: a record without index / prompt_sha256 (corrupt results file)")
            if not 0 <= index < len(hashes) or record["prompt_sha256"] != hashes[index]:
                raise UserError(f"{self.path}:{number}: the result for prompt {index} was made from another prompt "
                                "than the one now at that position (the prompts changed): use another --output, or "
                                "delete the file to start afresh")
            if index in self.records:
                raise UserError(f"{self.path}:{number}: a second result for prompt {index} (corrupt results file)")
            self.records[index] = record

    def _parse(self, line: bytes, number: int):
        try:
            return json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"{self.path}:{number}: not valid JSON (corrupt results file)") from None

    def start(self) -> None:
        """Ready to append: create the file with its header, or cut a torn last line."""
        if files.is_url(self.path):
            self.object = files.AppendedObject(self.path, self.data[: self.keep].decode("utf-8", "surrogateescape"))
            if self.keep == 0:
                self._write({"format": RESULTS_FORMAT, "settings": self.settings})
            return
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise UserError(f"--output {self.path} was created by another process meanwhile") from None
            except OSError as e:
                raise UserError(f"cannot create --output {self.path}: {e.strerror}") from None
            self._lock()
            files.sync_folder(os.path.dirname(os.path.abspath(self.path)))
        if self.keep != self.size:
            os.ftruncate(self.fd, self.keep)
        os.lseek(self.fd, 0, os.SEEK_END)
        if self.keep == 0:
            self._write({"format": RESULTS_FORMAT, "settings": self.settings})

    def _write(self, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace")
        if self.object is not None:
            self.object.write(data.decode("utf-8"))
            self.object.flush()
            return
        while data:
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def append(self, record: dict) -> None:
        self._write(record)

    def close(self) -> None:
        if self.object is not None:
            self.object.close()
            self.object = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ----------------------------------------------------------------------------- tokenize


def tokenize(settings: DecodeSettings, target, requests: list[Request]) -> None:
    """Prompt ids of every request (chat template unless --raw), each checked against the context."""
    from dspark_jax.engine.generate import check_context

    tok = target.tokenizer
    if tok.chat_template is None and not settings.raw and any(r.prompt.messages is None for r in requests):
        print(f"note: {target.name} has no chat template (a base model): prompts are tokenised as raw text"
              + (" after its BOS" if tok.bos_token_id is not None else ""), file=sys.stderr)
    for r in requests:
        try:
            if r.prompt.messages is not None:
                r.ids = tok.encode(tok.apply_chat_template(list(r.prompt.messages)))
            else:
                r.ids = tok.raw_prompt_ids(r.prompt.text) if settings.raw else tok.chat_prompt_ids(r.prompt.text)
            check_context(target.config, [len(r.ids)], settings.max_new_tokens)
        except UserError as e:
            raise UserError(f"{r.prompt.source}: {e}") from None


# ----------------------------------------------------------------------------- running


def derived_seed(seed: int, *parts) -> int:
    """A seed of its own for part of a run (a resumed run, a later length group)."""
    digest = hashlib.sha256(repr((seed,) + parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def cache_groups(lengths: list[int], cache_len, slots: int) -> list[list[int]]:
    """Positions of `lengths` grouped by KV-cache length `cache_len(length)`, shortest cache first,
    input order inside a group; a group of fewer than MIN_GROUP_PER_SLOT x slots prompts joins the
    next longer one (the last joins the one before)."""
    by_cache: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_cache.setdefault(cache_len(n), []).append(i)
    groups: list[list[int]] = []
    pending: list[int] = []
    for c in sorted(by_cache):
        pending += by_cache[c]
        if len(pending) >= MIN_GROUP_PER_SLOT * slots:
            groups.append(sorted(pending))
            pending = []
    if pending:
        if groups:
            groups[-1] = sorted(groups[-1] + pending)
        else:
            groups.append(sorted(pending))
    return groups


def run_engine(settings: DecodeSettings, target, speculative: Speculative | None, requests: list[Request],
               sampling, seed: int, on_result=None, on_progress=None) -> dict:
    """Decode `requests` (tokenised) as settings.batching / max_batch / length_groups say: plain target
    decoding, or speculative with `speculative`. on_result(request, token_ids, stats) as each
    completes (stats: "wall_s", and the speculative totals); on_progress(tokens, seconds) now and
    then. Returns the run's totals: wall_s and compile_s (excluded from wall_s), tokens, and for
    speculative decoding rounds, tau_sum (over every request's rounds) and plain_steps."""
    from dspark_jax.engine.generate import bucket, generate, serve

    stops = target.tokenizer.eos_token_ids
    slots = settings.max_batch
    totals = no_totals()
    done = [0, 0.0]  # tokens and seconds of the engine calls finished so far

    def progress(tokens, seconds):
        if on_progress is not None:
            on_progress(done[0] + tokens, done[1] + seconds)

    def finished(request, ids, stats):
        totals["tokens"] += len(ids)
        totals["rounds"] += stats.get("rounds", 0)
        totals["tau_sum"] += stats.get("tau_sum", 0)
        totals["plain_steps"] += stats.get("plain_steps", 0)
        if on_result is not None:
            on_result(request, ids, stats)

    def account(result):
        totals["wall_s"] += result.wall_s
        totals["compile_s"] += result.compile_s
        done[0], done[1] = totals["tokens"], totals["wall_s"]
        progress(0, 0.0)

    ids = [r.ids for r in requests]
    if settings.batching == "static":
        for start in range(0, len(requests), slots):
            batch = ids[start: start + slots]
            if speculative is None:
                result = generate(target.params, target.config, batch, max_new_tokens=settings.max_new_tokens,
                                  sampling=sampling, stop_ids=stops, seed=seed + start)
                stats = [{} for _ in batch]
            else:
                result = speculative(batch, sampling, seed + start, progress=False)
                stats = request_stats(result, speculative.gamma)
            for j, token_ids in enumerate(result.token_ids):
                finished(requests[start + j], token_ids, {**stats[j], "wall_s": result.wall_s})
            account(result)
        return totals

    slack = 0 if speculative is None else speculative.gamma + 1

    def cache_len(n: int) -> int:  # as generate.pad_prompts sizes the cache
        return bucket(max(bucket(n), n + settings.max_new_tokens + slack), minimum=64)

    groups = cache_groups([len(p) for p in ids], cache_len, slots) if settings.length_groups else [
        list(range(len(ids)))]
    for g, members in enumerate(groups):
        prompts = [ids[i] for i in members]
        on_finish = functools.partial(lambda members, j, token_ids, stats: finished(requests[members[j]], token_ids,
                                                                                    stats), members)
        group_seed = seed if g == 0 else derived_seed(seed, "group", g)
        if speculative is None:
            result = serve(target.params, target.config, prompts, slots=slots, max_new_tokens=settings.max_new_tokens,
                           sampling=sampling, stop_ids=stops, seed=group_seed, on_finish=on_finish,
                           on_progress=progress)
        else:
            result = speculative.serve(prompts, sampling, group_seed, slots=slots, on_finish=on_finish,
                                       on_progress=progress)
        account(result)
    return totals


# ----------------------------------------------------------- results: records, stdout, progress


def make_record(request: Request, ids: list[int], stats: dict, target, max_batch: int) -> dict:
    tok = target.tokenizer
    wall = stats["wall_s"]
    prompt = {"prompt": request.prompt.text} if request.prompt.messages is None else {
        "messages": list(request.prompt.messages)}
    record = {"index": request.index, **prompt, "prompt_sha256": request.sha256, "text": tok.decode(ids),
              "token_ids": ids, "prompt_token_ids": list(request.ids), "num_tokens": len(ids),
              "finish_reason": "stop" if ids and ids[-1] in tok.eos_token_ids else "length",
              "request_wall_s": round(wall, 4), "request_tokens_per_s": round(len(ids) / wall, 2) if wall > 0 else None,
              "max_batch": max_batch, "target": target.name}
    if "rounds" in stats:
        record.update(acceptance_length=round(stats["tau_sum"] / stats["rounds"], 4) if stats["rounds"] else 1.0,
                      rounds=stats["rounds"], verified_tokens=stats["verified_tokens"],
                      position_reached=stats["position_reached"], position_accepted=stats["position_accepted"],
                      plain_steps=stats.get("plain_steps", 0))
    return record


class Reporter:
    """Where results go: --output as each completes, stdout in input order (readable or --json),
    and the progress bar on stderr (requests done, aggregate tokens/s, mean tau)."""

    def __init__(self, settings: DecodeSettings, order: list[int], done: dict[int, dict], output: ResultsFile | None, todo: int):
        from tqdm.auto import tqdm

        self.settings, self.order, self.output = settings, order, output
        self.print_records = settings.json or output is None
        self.ready = dict(done) if self.print_records else {}  # records waiting for their turn on stdout
        self.next = 0
        self.tau_sum = self.rounds = 0
        self.bar = tqdm(total=todo, unit="req", desc="decode", disable=settings.json or todo == 0, file=sys.stderr,
                        dynamic_ncols=True)
        self.flush()

    def result(self, record: dict, stats: dict) -> None:
        if self.output is not None:
            self.output.append(record)
        self.tau_sum += stats.get("tau_sum", 0)
        self.rounds += stats.get("rounds", 0)
        if self.print_records:
            self.ready[record["index"]] = record
            self.flush()
        self.bar.update(1)

    def progress(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            tau = f", tau {self.tau_sum / self.rounds:.2f}" if self.rounds else ""
            self.bar.set_postfix_str(f"{tokens / seconds:.1f} tok/s{tau}", refresh=False)

    def flush(self) -> None:
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            record = self.ready.pop(self.order[self.next])
            self.next += 1
            self.bar.write(json.dumps(record, ensure_ascii=False) if self.settings.json else readable(record),
                           file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()


def readable(record: dict) -> str:
    prompt = record["prompt"] if "prompt" in record else record["messages"][-1]["content"]
    extra = f", tau {record['acceptance_length']:.2f}" if "acceptance_length" in record else ""
    rate = record["request_tokens_per_s"] or 0.0
    return (f"### {prompt}\n{record['text']}\n"
            f"[{record['num_tokens']} tokens, {record['request_wall_s']:.2f} s, {rate:.1f} tokens/s{extra}]\n")


# ----------------------------------------------------------------------------- processes

def shard_target(target):
    """The tensor layout: the target's params placed on one (data=1, fsdp=1, tensor=all devices)
    mesh spanning every process, as `distributed.sharding` maps their logical axes (a dimension
    the tensor axis does not divide stays whole). The jitted engine then runs on the sharded
    params as they are: XLA inserts the collectives, and every process gets the same tokens.
    Returns the mesh."""
    import jax

    from dspark_jax.distributed import sharding
    from dspark_jax.models import decoder

    mesh = sharding.make_mesh(tensor=-1)
    shardings = sharding.param_shardings(mesh, target.config, decoder.layout_of(target.params))
    target.params = jax.device_put(target.params, shardings)
    return mesh


def shard_drafter(speculative, mesh) -> None:
    """The drafter's decoding params split over the tensor layout's mesh as the target's are (by
    their logical axes): replicated, every chip would read the whole drafter each round."""
    import jax

    from dspark_jax.distributed import sharding
    from dspark_jax.drafters.checkpoint import drafter_logical_axes

    params = speculative.dparams
    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    speculative.dparams = jax.device_put(params, sharding.tree_shardings(mesh, drafter_logical_axes(params), shapes))


TOTALS = ("wall_s", "compile_s", "tokens", "rounds", "tau_sum", "plain_steps")


def no_totals() -> dict:
    return {"wall_s": 0.0, "compile_s": 0.0, "tokens": 0, "rounds": 0, "tau_sum": 0, "plain_steps": 0}


def combined_totals(totals: dict, layout: str) -> tuple[dict, list[float]]:
    """The run's totals over every process, and each process's wall seconds. The wall and compile
    time are the slowest process's (they ran side by side, and the run ends with the last);
    under the data layout the counts add up, under the tensor layout every process decoded the
    same tokens, so they are process 0's."""
    every = gather.allgather_json({k: totals[k] for k in TOTALS})
    walls = [t["wall_s"] for t in every]
    out = dict(every[0]) if layout == "tensor" else {k: sum(t[k] for t in every) for k in (
        "tokens", "rounds", "tau_sum", "plain_steps")}
    out.update(wall_s=max(walls), compile_s=max(t["compile_s"] for t in every))
    return out, walls


def check_complete(indices: list[int], todo: list[Request]) -> None:
    """Every request decoded exactly once over all processes (a broken split would show here)."""
    want = sorted(r.index for r in todo)
    if sorted(indices) != want:
        missing = sorted(set(want) - set(indices))
        extra = sorted(i for i in set(indices) if indices.count(i) > 1 or i not in set(want))
        raise RuntimeError(f"the processes returned {len(indices)} results for {len(want)} requests "
                           f"(missing {missing[:10]}, duplicated or unknown {extra[:10]})")


def decode_prompts(settings: DecodeSettings) -> dict:
    """Everything `python -m dspark_jax.decode` does between parsing and the summary: read and select
    the prompts, check what can be checked before the target's weights load, resume from --output,
    decode the rest (results reported as they complete) and, with --compare-ar, plain decoding too.
    Returns the summary object.

    In a multi-process run every process calls this with the same arguments. Process 0 alone reads
    and writes --output (it tells the others which prompts are done) and reports results; under the
    data layout each process decodes its share of the remaining prompts and process 0 gathers the
    others' records at the end, under the tensor layout every process decodes all of them with the
    target split over every device."""
    records = read_inputs(settings)
    requests = select(settings, records)

    from dspark_jax.checkpoints import registry
    from dspark_jax.models.sampling import SamplingConfig

    # Everything that can be checked without the target's weights is checked before they load.
    settings, target_name = resolve(settings, len(requests))
    layout, processes, primary = settings.layout, gather.process_count(), gather.is_primary()
    output = None

    def open_output() -> list[int]:  # process 0 only: the prompts already done
        nonlocal output
        output = ResultsFile(settings.output, generation_settings(settings, target_name), [prompt_sha256(r) for r in records])
        return sorted(i for i in output.records if requests[0].index <= i <= requests[-1].index)

    try:
        done_indices = gather.on_primary(open_output) if settings.output else []
        done = {i: output.records[i] if output is not None else None for i in done_indices}
        todo = [r for r in requests if r.index not in done]
        totals, ar, speculative, reporter = no_totals(), None, None, None
        walls, mesh = [0.0] * processes, None
        if todo:
            target = registry.load_target(settings.target, dtype=settings.dtype)
            if layout == "tensor":
                mesh = shard_target(target)
            tokenize(settings, target, todo)  # all of them on every process: an error is the same everywhere
            mine = gather.share(todo) if layout == "data" else todo
            speculative = None if settings.drafter == "none" else load_speculative(settings, target)
            if speculative is not None and mesh is not None:
                shard_drafter(speculative, mesh)
            sampling = SamplingConfig(settings.temperature, settings.top_k, settings.top_p)
            seed = settings.seed if not done else derived_seed(settings.seed, "resume", len(done))
            if layout == "data" and gather.process_index() > 0:  # its own random numbers
                seed = derived_seed(seed, "process", gather.process_index())
            if output is not None:
                output.start()
            if primary:
                reporter = Reporter(settings, [r.index for r in requests], done, output, len(todo))
            local: list[dict] = []  # the records this process made (for process 0, under the data layout)

            def on_result(request, ids, stats):
                record = make_record(request, ids, stats, target, settings.max_batch)
                if reporter is not None:
                    reporter.result(record, stats)
                local.append(record)

            if mine:
                totals = run_engine(settings, target, speculative, mine, sampling, seed, on_result,
                                    None if reporter is None else reporter.progress)
            if settings.compare_ar and speculative is not None:
                ar = run_engine(settings, target, None, mine, sampling, seed) if mine else no_totals()
            if layout == "data" and processes > 1:
                # process 0 gathers the others' records (it has its own) and reports them; every
                # process checks that all were decoded once, so a failure stops them all alike
                every = gather.allgather_json({"indices": [r["index"] for r in local],
                                               "records": [] if primary else local})
                check_complete([i for part in every for i in part["indices"]], todo)
                for record in [record for part in every[1:] for record in part["records"]] if primary else []:
                    rounds = record.get("rounds", 0)
                    reporter.result(record, {"rounds": rounds, "tau_sum": record.get("acceptance_length", 1.0) * rounds})
            else:
                check_complete([r["index"] for r in local], todo)
            if processes > 1:
                totals, walls = combined_totals(totals, layout)
                if ar is not None:
                    ar, _ = combined_totals(ar, layout)
        elif primary:
            reporter = Reporter(settings, [r.index for r in requests], done, output, 0)
        if reporter is not None:
            reporter.close()
    finally:
        if output is not None:
            output.close()
    summary = {"requests": len(requests), "decoded": len(todo), "skipped": len(done),
               "generated_tokens": totals["tokens"], "wall_s": round(totals["wall_s"], 4),
               "compile_s": round(totals["compile_s"], 2),
               "aggregate_tokens_per_s": round(totals["tokens"] / totals["wall_s"], 2) if totals["wall_s"] else None,
               "batching": settings.batching, "max_batch": settings.max_batch, "target": target_name,
               "drafter": settings.drafter, "output": settings.output}
    if processes > 1:  # aggregate tokens/s above: every process's tokens over the slowest one's wall time
        summary.update(processes=processes, layout=layout, process_wall_s=[round(w, 4) for w in walls])
    elif layout != "data":
        summary["layout"] = layout
    if mesh is not None:
        summary["mesh"] = dict(mesh.shape)
    if speculative is not None:
        summary.update(scheduler=settings.scheduler, gamma=settings.gamma, plain_steps=totals["plain_steps"],
                       rounds=totals["rounds"],
                       mean_acceptance_length=round(totals["tau_sum"] / totals["rounds"], 4) if totals["rounds"] else 1.0)
    if ar is not None and ar["wall_s"]:
        summary.update(ar_wall_s=round(ar["wall_s"], 4),
                       ar_aggregate_tokens_per_s=round(ar["tokens"] / ar["wall_s"], 2),
                       speedup=round((totals["tokens"] / totals["wall_s"]) / (ar["tokens"] / ar["wall_s"]), 3))
    return summary
