"""The speculative engine set up for an offline decode run (`engine.offline`): the drafter its
settings name, loaded for the target, with the scheduler, gamma and verify buckets they resolve to
and the SPS table (round cost per verify bucket) the dspark schedulers plan with, measured once
per device, model and cache length and kept in .dspark_cache/."""

from __future__ import annotations

import os
import sys

from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather
from dspark_jax.engine.decode_settings import DecodeSettings, with_drafter


class Speculative:
    """The speculative engine for the drafter given on the command line: call it on a static batch
    (prompts, sampling, seed) -> SpecResult, or `serve` prompts with continuous batching.

    The settings supply drafter, scheduler, gamma, threshold, plain_steps, max_new_tokens,
    max_batch (the request slots, which the verify buckets and the SPS table are sized for), json,
    sps_table, profile_sps, layout."""

    def __init__(self, settings: DecodeSettings, target):
        from dspark_jax.drafters.checkpoint import load_drafter

        self.target = target
        self.loaded = load_drafter(settings.drafter, target.config, target.name)
        self.dcfg = self.loaded.config
        self.settings = settings = with_drafter(settings, self.dcfg)
        self.gamma = settings.gamma
        self.dparams = self.loaded.decoding_params(target)
        self.policy = settings.scheduler.replace("-", "_")
        self.plain_steps = settings.plain_steps == "on"
        self.gates = {}  # (rows, greedy) -> PlainStepGate, kept across batches (see `gate`)
        # Every policy but "fixed" verifies fewer tokens than R x (gamma + 1): flatten them into buckets.
        self.buckets = None
        if self.policy != "fixed":
            from dspark_jax.engine.sps import token_buckets

            self.buckets = token_buckets(settings.max_batch * (self.gamma + 1))

    def config(self, prompts, sampling):
        """The SpecConfig for these prompts (the dspark schedulers' SPS table is the one for the KV
        cache they get)."""
        from dspark_jax.engine.speculative import SpecConfig
        from dspark_jax.engine.generate import pad_prompts

        sps = None
        if self.policy.startswith("dspark"):  # the round's cost depends on the KV cache this batch gets
            max_len = pad_prompts(self.target.config, prompts, self.settings.max_new_tokens, slack=self.gamma + 1)[2]
            sps = sps_table(self.settings, self.target, self.dcfg, self.dparams, self.gamma, max_len, self.buckets)
        return SpecConfig(gamma=self.gamma, sampling=sampling, policy=self.policy, threshold=self.settings.threshold,
                          stop_ids=tuple(self.target.tokenizer.eos_token_ids), sps=sps, verify_buckets=self.buckets,
                          plain_steps=self.plain_steps)

    def gate(self, rows: int, cfg):
        """The plain-step gate for batches of `rows` rows at this sampling mode (None without plain
        steps), one per (rows, greedy) kept across calls: what it learned of this drafter's tau and
        of this machine's round and plain-step costs carries over to the next batch, which then
        pays no measuring round and no early re-probes again when drafts do not pay."""
        if not cfg.plain_steps:
            return None
        from dspark_jax.engine.fallback import PlainStepGate

        key = (rows, cfg.sampling.greedy)
        if key not in self.gates:  # the tensor layout's processes run one batch together: the same choices
            shared = self.settings.layout == "tensor" and gather.process_count() > 1
            self.gates[key] = PlainStepGate.from_table(cfg.sps, rows, self.gamma, timed=not shared)
        return self.gates[key]

    def __call__(self, batch, sampling, seed, progress: bool | None = None):
        from dspark_jax.engine.speculative import speculative_generate

        t = self.target
        cfg = self.config(batch, sampling)
        return speculative_generate(t.params, t.config, self.dparams, self.dcfg, batch,
                                    max_new_tokens=self.settings.max_new_tokens, cfg=cfg, gate=self.gate(len(batch), cfg),
                                    temperatures=self.loaded.sts_for(sampling.temperature), seed=seed,
                                    progress=(not self.settings.json and gather.is_primary()) if progress is None
                                    else progress)

    def serve(self, prompts, sampling, seed, *, slots: int, on_finish=None, on_progress=None):
        from dspark_jax.engine.speculative import speculative_serve

        t = self.target
        cfg = self.config(prompts, sampling)
        return speculative_serve(t.params, t.config, self.dparams, self.dcfg, prompts, slots=slots,
                                 max_new_tokens=self.settings.max_new_tokens, cfg=cfg, gate=self.gate(slots, cfg),
                                 temperatures=self.loaded.sts_for(sampling.temperature), seed=seed, on_finish=on_finish,
                                 on_progress=on_progress, keep_rounds=False)


def load_speculative(settings: DecodeSettings, target) -> Speculative:
    """The speculative engine for the settings' drafter (see `Speculative`)."""
    return Speculative(settings, target)


_TABLES: dict = {}  # SPS tables this process loaded or profiled, by file: read (or re-measured) once


def sps_table(settings: DecodeSettings, target, dcfg, dparams, gamma, max_len, buckets):
    """Load the SPS table (round cost per verify bucket: the drafter's pass + the target's verify)
    for this device, target, drafter, batch size, gamma and KV-cache length, or profile and save it.
    The cache length matters: attention over a batch runs over the whole cache, so on a small
    target it is a large part of a round (a table profiled at 512 positions overstates what extra
    verify tokens cost at 256)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.core import host_memory
    from dspark_jax.engine.speculative import profile_verify
    from dspark_jax.engine.sps import SPSTable, code_tag, device_kind, load_sps_table, save_sps_table
    from dspark_jax.models import cpu_kernels, decoder

    # The draft cost is part of a round: the table belongs to the drafter's shape as well as the target's.
    # So do the decoder's layer layout, its weights' dtype and what runs the products: their costs differ.
    drafter = f"{dcfg.kind}-{dcfg.num_layers}L-{dcfg.head}-d{dcfg.hidden_size}-{decoder.layout_of(dparams)}"
    drafter += "".join(sorted({f"_{a.dtype}" for a in jax.tree.leaves(dparams) if a.dtype != jnp.float32}))
    layout = decoder.layout_of(target.params)
    weights = "" if target.weight_dtype == "float32" else f"_{target.weight_dtype}"
    # Each version of the code a round runs has its own costs: our CPU kernels (verify passes through
    # them cost about half what they cost through XLA's dot) and the decoding modules (`code_tag`).
    code = (f"_rowkernel-{cpu_kernels.source_tag()}" if cpu_kernels.active() else "") + f"_code-{code_tag()}"
    code += "" if host_memory.applied() else "_malloc-system"  # freed temporaries re-faulted each step
    model = (f"{target.name}:{target.config.num_layers}x{target.config.hidden_size}:{target.weight_dtype}{code}:"
             f"{layout}+{drafter}:kv{max_len}")
    path = settings.sps_table or os.path.join(".dspark_cache", f"sps_{target.name}_{layout}{weights}{code}_{drafter}_"
                                          f"{device_kind().replace(' ', '_')}_b{settings.max_batch}_g{gamma}_kv{max_len}.json")
    if path in _TABLES:
        return _TABLES[path]

    def stored() -> dict | None:  # the table on disk, or None to profile one
        if files.exists(path) and not settings.profile_sps:
            return load_sps_table(path, device=device_kind(), model=model, buckets=buckets).to_json()
        if settings.sps_table and not settings.profile_sps:
            raise UserError(f"no SPS table at {settings.sps_table} (add --profile-sps to measure one)")
        return None

    # Under the tensor layout every process runs the same sharded program, so all must plan with
    # one table: process 0's (read by it alone; profiling is a collective, timed on every process).
    shared = settings.layout == "tensor" and gather.process_count() > 1
    found = gather.on_primary(stored) if shared else stored()
    if found is not None:
        _TABLES[path] = SPSTable.from_json(found)
        return _TABLES[path]
    if not settings.json and gather.is_primary():
        print(f"profiling a round (draft + verify) for {len(buckets)} token buckets ...", file=sys.stderr)
    table = profile_verify(target.params, target.config, dcfg, rows=settings.max_batch, gamma=gamma, max_len=max_len,
                           model=model, dparams=dparams)
    if shared:
        table = SPSTable.from_json(gather.broadcast_json(table.to_json()))
    if gather.is_primary() or not shared:  # data layout: each process its own devices' (atomic writes)
        save_sps_table(path, table)
    _TABLES[path] = table
    return table


def request_stats(result, gamma: int) -> list[dict]:
    """Per request of a static speculative batch, the totals `engine.speculative.RequestStats`
    keeps under continuous batching: rounds, tau summed (bonus included), verified draft tokens
    and, per draft position k, the rounds that reached k (1..k-1 accepted, k verified) and accepted it."""
    from dspark_jax.engine.speculative import RequestStats

    totals = RequestStats(len(result.token_ids), gamma)
    for r in result.rounds:
        totals.add(r)
    return [totals.take(i) for i in range(len(result.token_ids))]
