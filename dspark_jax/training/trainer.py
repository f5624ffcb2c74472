"""The drafter training loop: optax + orbax + grain, jitted with explicit shardings.

State (step, fp32 master params, optimizer state) is one pytree. A step takes `grad_accum`
micro-batches (a `lax.scan`, one optimizer update), computes in `compute_dtype` (bf16 by default)
and never differentiates the frozen target: its params enter the step as a separate argument and
only the drafter params are differentiated. With `data.feature_cache` set, the target's features
come from the on-disk cache (`dspark_jax.data.feature_cache`, built at startup if missing from the
data this run loads, by the target as `target_feature_inputs` sets it up for the online path too),
gathered on the host into each train batch (bf16), and the step never runs the target; evaluation
stays online.

Checkpoints are orbax CheckpointManager saves of {state, grain iterator state, config}; orbax
finalises a step by renaming a temporary folder, so a kill at any moment leaves only complete
checkpoints. `resume=True` continues from the latest one, and because the data order lives in the
iterator state and the step is deterministic, the resumed run is bit-for-bit the uninterrupted one.

Multi-process (every process runs the same program, `dspark_jax.distributed.runtime`): every
process iterates the same global batch stream and keeps the rows its devices hold
(`pipeline.process_rows` of the batch sharding), assembled into global arrays with
`jax.make_array_from_process_local_data`. So global batch g depends on g only, not on the process
count, and the iterator state, identical on every process (checked at each save), is checkpointed
once (item "data_global", JSON): a run saved by 2 processes resumes on 1 (or 1 on 2) with the same
continuation. Every process calls the checkpoint manager (orbax writes each process's shards);
process 0 alone writes run.json, metrics.jsonl and resumes.jsonl, behind barriers. run.out_dir must
be one folder all processes see (a shared file system or a bucket).

A run folder (run.out_dir) belongs to one run (`check_run_folder`): a fresh run refuses a folder
that holds anything, `overwrite=True` clears one that holds only what a run writes, and a resume
compares the folder's run.json (the config it was started with, written atomically at the start)
with this run's config: model, data and optimisation settings must not change; the schedule
(`SCHEDULE_KEYS`) may, with `allow_schedule_change=True`, recorded in resumes.jsonl. On resume
metrics.jsonl is cut back to the restored step, so its records are those of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dspark_jax.distributed import sharding
from dspark_jax.drafters.checkpoint import drafter_logical_axes
from dspark_jax.distributed.gather import barrier
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.config import OptimConfig, TrainConfig, config_to_dict
from dspark_jax.training.losses import blockwise, chain_acceptance_metrics, loss_from_statistics, slot_statistics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: Any


def lr_schedule(o: OptimConfig) -> optax.Schedule:
    """Linear warmup (optim.warmup_steps, else warmup_frac x steps), then cosine decay to 0 at
    optim.steps, or lr held (optim.schedule=constant). The cosine depends on optim.steps, so a
    resume that changes it continues on the new curve (`check_run_folder`)."""
    warmup = o.warmup_steps if o.warmup_steps is not None else max(1, int(o.warmup_frac * o.steps))
    if o.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, o.lr, warmup), optax.constant_schedule(o.lr)],
                                    [warmup])
    return optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(o.steps, warmup + 1), end_value=0.0)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
    return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                       optax.adamw(lr_schedule(o), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


REMAT_POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                  "full": jax.checkpoint_policies.nothing_saveable}


def drafter_functions(dcfg: DrafterConfig, remat: str = "none", logit_chunk: int = 0):
    """(init_params, loss_fn) for the drafter kind; loss_fn(params, target_params, batch) -> (loss,
    metrics). remat and logit_chunk: the run's memory settings (`RunConfig`): they change what the
    backward pass keeps, not the loss."""
    if dcfg.kind == "eagle3":
        from dspark_jax.drafters import eagle3

        def loss_fn(params, target_params, tcfg, batch, weights):
            slots = {}
            if dcfg.ttt_at_anchors:  # the chain at t = p - 1 predicts tokens p+1..p+gamma, as a block at anchor p
                start = batch["block_start"]
                slots = dict(loss_slots=jnp.maximum(start - 1, 0), loss_slots_valid=batch["block_valid"] & (start >= 1))
            out = eagle3.eagle3_train_forward(
                params, dcfg, target_params, tcfg, batch["tokens"], batch["loss_mask"], batch["ctx_features"],
                batch["target_last_hidden"], dcfg.ttt_steps, segment_ids=batch["segment_ids"],
                positions=batch["positions"], remat_policy=REMAT_POLICIES[remat], **slots)
            # Pass i at t drafts the chain's token i+1: per-position metrics as for a block at t + 1.
            alpha, mask = (jnp.moveaxis(out[k], 0, -1) for k in ("acceptance", "position_mask"))
            metrics = {"loss": out["total_loss"], "loss_per_step": out["loss"],
                       **chain_acceptance_metrics(alpha, mask)}
            return out["total_loss"], metrics

        return eagle3.init_eagle3_params, loss_fn

    from dspark_jax.drafters import dspark

    def loss_fn(params, target_params, tcfg, batch, weights):
        out = dspark.train_forward(params, dcfg, target_params, tcfg, batch, batch["ctx_features"],
                                   batch["target_last_hidden"], with_logits=False,
                                   remat_policy=REMAT_POLICIES[remat])

        def statistics(hidden, prev_tokens, target_hidden, labels):
            logits = dspark.slot_logits(params, dcfg, target_params, tcfg, hidden, prev_tokens, target_hidden)
            return slot_statistics(logits["draft_logits"], logits["target_logits"], labels)

        stats = blockwise(statistics, logit_chunk, out["hidden"], out["prev_tokens"], out["target_hidden"],
                          out["labels"])
        return loss_from_statistics(stats, out, weights)

    return dspark.init_drafter_params, loss_fn


def target_feature_inputs(target_params, tcfg: ModelConfig, compute_dtype) -> tuple[dict, ModelConfig]:
    """(params, config) the frozen target computes the drafter's input features with: its params
    cast to the run's compute dtype, its own config (activations in `tcfg.dtype`). The one place
    that decides it, for the online path (`make_loss`) and the feature cache build alike, so that
    cached features are the online ones (up to bf16 storage)."""
    return _cast(jax.lax.stop_gradient(target_params), jnp.dtype(compute_dtype)), tcfg


def with_target_features(target_params, tcfg: ModelConfig, dcfg: DrafterConfig, batch: dict) -> dict:
    """Online path: run the frozen target on the packed rows unless the batch carries cached features."""
    if "ctx_features" in batch:
        return batch
    from dspark_jax.data.pipeline import target_features

    ctx, last = target_features(target_params, tcfg, batch, dcfg.tap_layers)
    return {**batch, "ctx_features": jax.lax.stop_gradient(ctx), "target_last_hidden": jax.lax.stop_gradient(last)}


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def make_loss(cfg: TrainConfig, dcfg: DrafterConfig, tcfg: ModelConfig) -> Callable:
    """loss(params, target_params, batch) -> (loss, metrics) in the run's compute dtype."""
    _, loss_fn = drafter_functions(dcfg, cfg.run.remat, cfg.run.logit_chunk)
    compute = jnp.dtype(cfg.run.compute_dtype)

    def loss(params, target_params, batch):
        target_params, feature_cfg = target_feature_inputs(target_params, tcfg, compute)
        batch = with_target_features(target_params, feature_cfg, dcfg, batch)
        return loss_fn(_cast(params, compute), target_params, tcfg.replace(dtype=str(compute)),
                       _cast(batch, compute), cfg.loss)

    return loss


def make_train_step(cfg: TrainConfig, dcfg: DrafterConfig, tcfg: ModelConfig, optimizer) -> Callable:
    micro_loss = make_loss(cfg, dcfg, tcfg)
    accum = cfg.optim.grad_accum

    def step(state: TrainState, target_params: dict, batch: dict):
        # Micro-batch i takes rows i, i + accum, i + 2 accum, ... of the batch, so that each micro-batch
        # is spread over the data axis as the batch is (a device holds a contiguous block of its rows):
        # split into consecutive blocks instead, a micro-batch would sit on one device, and XLA would
        # run every micro-batch on every device of the data axis.
        micro_batches = jax.tree.map(lambda a: jnp.swapaxes(a.reshape((a.shape[0] // accum, accum) + a.shape[1:]), 0, 1),
                                     batch)

        def accumulate(grads_sum, micro):
            (_, metrics), grads = jax.value_and_grad(micro_loss, has_aux=True)(state.params, target_params, micro)
            return jax.tree.map(jnp.add, grads_sum, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, metrics = jax.lax.scan(accumulate, zeros, micro_batches)
        grads = jax.tree.map(lambda g: g / accum, grads)
        metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


class TrainPrograms:
    """The jitted train and eval steps of a config on a mesh, with their inputs' shardings, and those
    inputs as shapes alone (`abstract_inputs`): what the Trainer runs, and what the compile check
    (`training.compile_check`) hands the TPU compiler without a weight in memory."""

    def __init__(self, cfg: TrainConfig, dcfg: DrafterConfig, tcfg: ModelConfig, mesh, target_layout: str):
        self.cfg, self.dcfg, self.tcfg, self.mesh, self.target_layout = cfg, dcfg, tcfg, mesh, target_layout
        self.optimizer = make_optimizer(cfg)
        init_params, _ = drafter_functions(dcfg)
        self.abstract_params = jax.eval_shape(functools.partial(init_params, dcfg), jax.random.key(0))
        p_sh = sharding.tree_shardings(mesh, drafter_logical_axes(self.abstract_params),
                                       jax.tree.map(lambda a: a.shape, self.abstract_params))
        self.replicated = NamedSharding(mesh, P())
        self.abstract_opt = jax.eval_shape(self.optimizer.init, self.abstract_params)
        opt_sh = optax.tree_utils.tree_map_params(self.optimizer, lambda _, s: s, self.abstract_opt, p_sh,
                                                  transform_non_params=lambda _: self.replicated)
        self.state_shardings = TrainState(self.replicated, p_sh, opt_sh)
        self.target_shardings = sharding.param_shardings(mesh, tcfg, target_layout)
        self.batch_rows = cfg.data.rows * cfg.optim.grad_accum  # global rows of a train batch
        self.batch_sharding = NamedSharding(mesh, sharding.logical_spec(mesh, ("batch",), (self.batch_rows,)))
        step = make_train_step(cfg, dcfg, tcfg, self.optimizer)
        self.train_step = jax.jit(step, in_shardings=(self.state_shardings, self.target_shardings, self.batch_sharding),
                                  out_shardings=(self.state_shardings, self.replicated), donate_argnums=(0,))
        self.eval_step = jax.jit(make_loss(cfg, dcfg, tcfg), out_shardings=self.replicated)
        self.eval_sharding = NamedSharding(mesh, sharding.logical_spec(mesh, ("batch",), (cfg.data.rows,)))

    def abstract_batch(self, rows: int) -> dict:
        """A packed batch of `rows` rows as shapes (data.pipeline's fields; the cached features with
        data.feature_cache)."""
        S, NB = self.cfg.data.seq_len, self.cfg.data.blocks_per_row
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        batch = dict(tokens=i32(rows, S), positions=i32(rows, S), segment_ids=i32(rows, S), loss_mask=i32(rows, S),
                     block_start=i32(rows, NB), block_valid=jax.ShapeDtypeStruct((rows, NB), jnp.bool_))
        if self.cfg.data.feature_cache:
            m, d = len(self.dcfg.target_layer_ids), self.tcfg.hidden_size
            batch.update(ctx_features=jax.ShapeDtypeStruct((rows, S, m * d), jnp.bfloat16),
                         target_last_hidden=jax.ShapeDtypeStruct((rows, S, d), jnp.bfloat16))
        return batch

    def abstract_inputs(self) -> tuple[TrainState, dict, dict]:
        """(state, target params, batch) of the train step as ShapeDtypeStructs carrying their
        shardings: the target's weights in its float32 (`registry.load_target`'s default)."""
        with_sharding = lambda tree, shardings: jax.tree.map(  # noqa: E731
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)
        state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), self.abstract_params, self.abstract_opt)
        target = jax.eval_shape(lambda k: decoder.with_layout(decoder.init_params(self.tcfg, k), self.tcfg,
                                                               self.target_layout), jax.random.key(0))
        batch = self.abstract_batch(self.batch_rows)
        return (with_sharding(state, self.state_shardings), with_sharding(target, self.target_shardings),
                with_sharding(batch, jax.tree.map(lambda _: self.batch_sharding, batch)))


def layers_from_target(dparams: dict, dcfg: DrafterConfig, target_params: dict, target_cfg: ModelConfig) -> dict:
    """dparams with its draft layers' weights copied from the target's last dcfg.num_layers layers,
    wherever a weight has the same name and shape (DSpark's draft layers are shaped like the
    target's; the rest keeps its random init)."""
    if dcfg.kind != "dspark" or dcfg.num_layers > target_cfg.num_layers:
        raise UserError("optim.init_from_target needs a DSpark/DFlash drafter with at most the target's layers")
    stacked = decoder.with_layout(target_params, target_cfg, "stacked")["layers"]
    last = slice(target_cfg.num_layers - dcfg.num_layers, target_cfg.num_layers)
    layers = {name: stacked[name][last].astype(w.dtype) if name in stacked and stacked[name].shape[1:] == w.shape[1:]
              else w for name, w in dparams["layers"].items()}
    return {**dparams, "layers": layers}


def load_data(folder: str):
    """The ShardSource of a datagen folder, or of every datagen folder inside `folder` (one level,
    in name order: e.g. greedy and sampled responses of the same prompts); a UserError if there is
    none."""
    from dspark_jax.data.shards import MANIFEST
    from dspark_jax.data.pipeline import ShardSource

    if not files.is_dir(folder):
        raise UserError(f"no data at {folder}: generate it with python -m dspark_jax.datagen")
    if files.exists(os.path.join(folder, MANIFEST)):
        return ShardSource(folder)
    inner = [os.path.join(folder, name) for name in sorted(files.listdir(folder))
             if files.exists(os.path.join(folder, name, MANIFEST))]
    if not inner:
        raise UserError(f"{folder} holds no datagen output (no {MANIFEST} in it or in its folders): "
                        "generate it with python -m dspark_jax.datagen")
    return ShardSource(inner)


def _packed_batches(cfg: TrainConfig, dcfg: DrafterConfig, data, rows: int, epochs: int | None):
    """The global stream of packed batches of `rows` rows of `data` (a folder or a loaded
    ShardSource): the same on every process (see the module docstring)."""
    import grain

    from dspark_jax.data.pipeline import PackingConfig, make_dataset

    packing = PackingConfig(batch_size=rows, seq_len=cfg.data.seq_len,
                            max_blocks=cfg.data.blocks_per_row, block_size=dcfg.block_size,
                            anchors_per_seq=cfg.data.anchors_per_seq, seed=cfg.data.seed, num_epochs=epochs)
    return iter(make_dataset(load_data(data) if isinstance(data, (str, os.PathLike)) else data, packing,
                             shard_options=grain.sharding.NoSharding()))


def make_train_iterator(cfg: TrainConfig, dcfg: DrafterConfig, source=None):
    """The checkpointable grain iterator of global packed batches (grad_accum micro-batches each,
    every process the same) of `source` (a ShardSource; default: data.train_dir loaded now)."""
    return _packed_batches(cfg, dcfg, cfg.data.train_dir if source is None else source,
                           cfg.data.rows * cfg.optim.grad_accum, None)


# ---- the run folder: one run's run.json, checkpoints/, metrics.jsonl, resumes.jsonl, drafter/ ----

RUN_FILE, RESUMES_FILE, METRICS_FILE, CHECKPOINTS_DIR = "run.json", "resumes.jsonl", "metrics.jsonl", "checkpoints"
# Everything a run (and plot_metrics) writes into its folder, temporary files of atomic writes included.
_RUN_ENTRY = re.compile(r"(run\.json|resumes\.jsonl|metrics\.jsonl|checkpoints|drafter|drafter-step-\d+|plots)"
                        r"|\.(run\.json|resumes\.jsonl|metrics\.jsonl)\.(tmp\.\d+|[^/]+\.tmp)|\.overwrite-trash\.\d+")
_STEP_DIR = re.compile(r"\d+(\.orbax-checkpoint-tmp.*)?")  # orbax step folders, finished or not
# What a resume may change (with allow_schedule_change): how long it runs and how often it logs,
# evaluates and saves, and its device layout. Everything else (target, drafter, loss, data, the
# other optim settings, run.compute_dtype) is what was trained and must stay; run.out_dir is the
# folder itself, which may have moved.
SCHEDULE_KEYS = ("optim.steps", "run.log_every", "run.save_every", "run.keep_checkpoints", "run.eval_every",
                 "run.eval_batches", "run.mesh", "run.time_budget_s", "run.remat", "run.logit_chunk")
IGNORED_KEYS = ("run.out_dir",)
_UNSET = "<unset>"


def jsonable_config(cfg: TrainConfig) -> dict:
    """config_to_dict(cfg) as it reads back from JSON (tuples as lists)."""
    return json.loads(json.dumps(config_to_dict(cfg), default=str))


def config_differences(old: dict, new: dict) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} of the keys whose values differ between two config
    dicts (config_to_dict / run.json); a key missing on one side has the value "<unset>"."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(json.loads(json.dumps(old))), flat(json.loads(json.dumps(new)))
    return {k: (a.get(k, _UNSET), b.get(k, _UNSET)) for k in sorted(set(a) | set(b))
            if a.get(k, _UNSET) != b.get(k, _UNSET)}


def _describe(diff: dict) -> str:
    show = lambda v: v if v == _UNSET else json.dumps(v)  # noqa: E731
    return ", ".join(f"{k} ({show(a)} -> {show(b)})" for k, (a, b) in diff.items())


def _names(entries: list[str], limit: int = 6) -> str:
    return ", ".join(entries[:limit]) + (f" and {len(entries) - limit} more" if len(entries) > limit else "")


def _finished_steps(out_dir: str) -> list[int]:
    """The steps of the folder's finished checkpoints (orbax renames a step's temporary folder to
    the bare step number when the save is complete; temporary folders are ignored on restore)."""
    folder = os.path.join(out_dir, CHECKPOINTS_DIR)
    return sorted(int(n) for n in files.listdir(folder) if n.isdigit() and files.is_dir(os.path.join(folder, n)))


def stored_run_config(out_dir: str) -> dict | None:
    """The config the folder's run was started with: run.json, or for a folder written before
    run.json existed, the config saved in its latest checkpoint; None if there is neither."""
    path = os.path.join(out_dir, RUN_FILE)
    sources = [path] + [os.path.join(out_dir, CHECKPOINTS_DIR, str(s), "config", "metadata")
                        for s in _finished_steps(out_dir)[-1:]]
    for source in sources:
        try:
            record = json.loads(files.read_bytes(source))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the run's config {source}: {e}") from None
        config = record.get("config") if source == path and isinstance(record, dict) else record
        if not isinstance(config, dict):
            raise UserError(f"{source} holds no run config: delete the folder or choose another run.out_dir")
        return config
    return None


@dataclasses.dataclass(frozen=True)
class RunFolderCheck:
    stored: dict | None  # the config the folder's run was started with (None: this run starts it)
    changes: dict  # accepted schedule changes, {key: (old, new)}


def check_run_folder(cfg: TrainConfig, resume: bool = False, overwrite: bool = False,
                     allow_schedule_change: bool = False) -> RunFolderCheck:
    """Whether this run may use cfg.run.out_dir; a one-line UserError if not. Reads only.

    * fresh (neither flag): the folder must not exist or be empty;
    * overwrite: the folder may hold only what a run writes (`_RUN_ENTRY`; checkpoints/ only orbax
      step folders), or anything besides that if it holds a run.json; `fit` then removes exactly
      those entries and nothing else;
    * resume: a folder without run.json may hold only what a run writes (a run from before run.json
      existed, or one killed before it wrote any); the stored config (`stored_run_config`) must
      equal this run's except run.out_dir and, with allow_schedule_change, the SCHEDULE_KEYS.
    """
    out = cfg.run.out_dir
    if resume and overwrite:
        raise UserError("--resume continues the run in run.out_dir and --overwrite replaces it: pass one of them")
    if files.exists(out) and not files.is_dir(out):
        raise UserError(f"run.out_dir {out} is a file, not a folder")
    entries = files.listdir(out)
    foreign = [e for e in entries if not _RUN_ENTRY.fullmatch(e)]
    has_record = RUN_FILE in entries
    if overwrite:
        if foreign and not has_record:
            raise UserError(f"--overwrite: {out} does not look like a run folder (no {RUN_FILE}; it holds "
                            f"{_names(foreign)}): clear it yourself or choose another run.out_dir")
        folder = os.path.join(out, CHECKPOINTS_DIR)
        others = [n for n in files.listdir(folder) if not _STEP_DIR.fullmatch(n)]
        if others:
            raise UserError(f"--overwrite: {folder} holds more than checkpoints ({_names(others)}): "
                            f"clear it yourself or choose another run.out_dir")
        return RunFolderCheck(None, {})
    if not resume:
        if entries:
            raise UserError(f"run folder {out} is not empty (it holds {_names(entries)}): pass --resume to continue "
                            f"its run, --overwrite to replace it, or choose another run.out_dir")
        return RunFolderCheck(None, {})
    if foreign and not has_record:
        raise UserError(f"--resume: {out} holds no run (no {RUN_FILE}; it holds {_names(foreign)}): "
                        f"choose another run.out_dir")
    stored = stored_run_config(out)
    if stored is None:
        return RunFolderCheck(None, {})
    diff = {k: v for k, v in config_differences(stored, jsonable_config(cfg)).items() if k not in IGNORED_KEYS}
    fixed = {k: v for k, v in diff.items() if k not in SCHEDULE_KEYS}
    if fixed:
        raise UserError(f"cannot resume {out} with another configuration: {_describe(fixed)} differ from the run's "
                        f"{RUN_FILE}; resume with its settings, or start a new run in another run.out_dir "
                        f"(or --overwrite this one)")
    if diff and not allow_schedule_change:
        raise UserError(f"resuming {out} with a changed schedule: {_describe(diff)}; pass --allow-schedule-change "
                        f"to accept it (recorded in {RESUMES_FILE})")
    latest = _finished_steps(out)[-1:]
    if latest and cfg.optim.steps < latest[0]:
        raise UserError(f"optim.steps={cfg.optim.steps} is below step {latest[0]}, where the run in {out} "
                        f"stopped: a resume can only continue it")
    return RunFolderCheck(stored, diff)


def clear_run_folder(out_dir: str) -> None:
    """Remove what a run wrote into out_dir (only `_RUN_ENTRY` names; `check_run_folder` vetted
    them): each is first renamed into one trash folder, so a kill part-way leaves no half-deleted
    checkpoint that would look complete, only the trash, which the next overwrite removes too. On
    an object store (no renames) the entries are deleted one by one."""
    if files.is_url(out_dir):
        for name in files.listdir(out_dir):
            if _RUN_ENTRY.fullmatch(name):
                entry = files.path(os.path.join(out_dir, name))
                entry.rmtree() if entry.is_dir() else entry.unlink()
        return
    if not os.path.isdir(out_dir):
        return
    trash = os.path.join(out_dir, f".overwrite-trash.{os.getpid()}")
    os.makedirs(trash, exist_ok=True)
    for name in sorted(os.listdir(out_dir)):
        if _RUN_ENTRY.fullmatch(name) and os.path.join(out_dir, name) != trash:
            os.rename(os.path.join(out_dir, name), os.path.join(trash, name))
    shutil.rmtree(trash)


def truncate_metrics(path: str, step: int) -> int:
    """Cut a run's metrics log back to the records of steps 1..`step` (those of the checkpoint a
    resume restored), atomically; returns how many lines it dropped. Keeps a record only if it
    is complete and its step is above the last kept one, so records written again by a resume
    (logs from before this truncation existed) and a torn last line go too."""
    if not files.exists(path):
        return 0
    lines = files.read_text(path).splitlines(keepends=True)
    kept, last = [], 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        s = record.get("step") if isinstance(record, dict) else None
        if line.endswith("\n") and isinstance(s, int) and last < s <= step:
            kept.append(line)
            last = s
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped:
        files.atomic_write_text(path, "".join(kept))
    return dropped


def _check_same_everywhere(what: str, text: str) -> None:
    """A UserError unless every process holds the same `text` (a no-op with one process)."""
    if jax.process_count() == 1:
        return
    import hashlib

    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    try:
        multihost_utils.assert_equal(digest, what)
    except AssertionError:
        raise UserError(f"the processes of this run disagree on {what}: every process must run the same "
                        f"command with the same config and data") from None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class TimeBudget:
    """run.time_budget_s: after each step, whether another step would overrun the budget (the
    slowest of the last few steps, the first one's compilation left out). Process 0's clock decides
    for every process, so all stop at the same step."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, seconds: float):
        self.seconds, self.start, self.last, self.steps = seconds, self.clock(), None, []

    def spent_after_step(self) -> bool:
        if not self.seconds:
            return False
        now = self.clock()
        if self.last is not None:
            self.steps = (self.steps + [now - self.last])[-5:]
        self.last = now
        spent = now - self.start + (max(self.steps) if self.steps else 0.0) > self.seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            spent = bool(multihost_utils.broadcast_one_to_all(np.asarray(spent)))
        return spent


class Trainer:
    """Owns the mesh, shardings, jitted step and checkpoint manager of one run."""

    def __init__(self, cfg: TrainConfig, target,
                 data_factory: Callable[[TrainConfig, DrafterConfig, Any], Iterator] = make_train_iterator,
                 progress: bool = True):
        """`data_factory(cfg, dcfg, source)` makes the train iterator (global batches, the same on
        every process) from `source`, the ShardSource of data.train_dir loaded once here (the
        feature cache is built from and checked against that same source, so the batches'
        token_index and the cache always agree). Nothing is written to run.out_dir until `fit`
        (or `save`)."""
        self.cfg, self.target = cfg, target
        self.dcfg = cfg.drafter_config(target.config, target.name)
        self.dcfg.check_target(target.config, target.name)
        self.train_source = load_data(cfg.data.train_dir)
        self.draft_vocab_coverage = self.draft_vocab_eval_coverage = None
        if self.dcfg.draft_vocab_size and not self.dcfg.draft_vocab:  # picked from the data: the same on resume
            self._pick_draft_vocabulary(progress)
        self.start_params = self._start_from_drafter() if cfg.optim.init_from_drafter else None
        self.mesh = sharding.make_mesh(*cfg.run.mesh)
        init_params, _ = drafter_functions(self.dcfg)
        self._init_params = functools.partial(init_params, self.dcfg)
        programs = TrainPrograms(cfg, self.dcfg, target.config, self.mesh, decoder.layout_of(target.params))
        self.optimizer, self.state_shardings = programs.optimizer, programs.state_shardings
        self.target_shardings, self.batch_sharding = programs.target_shardings, programs.batch_sharding
        self.target_params = jax.device_put(target.params, self.target_shardings)
        self.batch_rows = programs.batch_rows
        self.train_step, self.eval_step = programs.train_step, programs.eval_step
        self.data = data_factory(cfg, self.dcfg, self.train_source)
        self.eval_sharding = programs.eval_sharding
        self.feature_cache = self._feature_cache(progress) if cfg.data.feature_cache else None
        self._manager = None

    def _pick_draft_vocabulary(self, progress: bool) -> None:
        """Fill dcfg.draft_vocab with the most frequent response tokens of train_dir and measure
        what they cover there and, what counts, on eval_dir's held-out responses."""
        from dspark_jax.data.pipeline import draft_vocabulary, vocabulary_coverage

        ids, self.draft_vocab_coverage = draft_vocabulary(self.train_source, self.dcfg.draft_vocab_size,
                                                          self.dcfg.vocab_size)
        self.dcfg = self.dcfg.replace(draft_vocab=ids)
        held_out = ""
        if self.cfg.data.eval_dir:
            self.draft_vocab_eval_coverage = vocabulary_coverage(load_data(self.cfg.data.eval_dir), ids,
                                                                 self.dcfg.vocab_size)
            held_out = f" and {100 * self.draft_vocab_eval_coverage:.2f}% of the held-out ones"
        if progress and jax.process_index() == 0:
            print(f"draft vocabulary: the {len(ids)} most frequent response tokens cover "
                  f"{100 * self.draft_vocab_coverage:.2f}% of the training responses' tokens{held_out}", flush=True)

    def _start_from_drafter(self) -> dict:
        """The params of optim.init_from_drafter (float32 numpy), refused in one line unless its
        config is this run's drafter config, and the same on every process."""
        import hashlib

        from dspark_jax.checkpoints.assemble import flatten
        from dspark_jax.drafters.checkpoint import load_drafter

        path = self.cfg.optim.init_from_drafter
        loaded = load_drafter(path, self.target.config, self.target.name)
        if loaded.config.draft_vocab_size and not self.dcfg.draft_vocab_size:
            # a draft vocabulary given after training (`python -m dspark_jax.draft_vocab`): the run
            # trains the drafter for the vocabulary it decodes with, and keeps it
            self.dcfg = self.dcfg.replace(draft_vocab_size=loaded.config.draft_vocab_size,
                                          draft_vocab=loaded.config.draft_vocab)
            if jax.process_index() == 0:
                print(f"optim.init_from_drafter: training over its {loaded.config.draft_vocab_size}-token draft "
                      "vocabulary", flush=True)
        differ = [f.name for f in dataclasses.fields(DrafterConfig)
                  if getattr(loaded.config, f.name) != getattr(self.dcfg, f.name)]
        if differ:
            raise UserError(f"optim.init_from_drafter: the drafter at {path} is not this run's drafter (its "
                            f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''} from the config's)")
        if jax.process_count() > 1:  # each process reads its own copy (the path may differ per host)
            digest = hashlib.blake2b(digest_size=16)
            for name, value in sorted(flatten(loaded.params, ".").items()):
                digest.update(name.encode() + np.ascontiguousarray(value).tobytes())
            _check_same_everywhere("the weights of optim.init_from_drafter", digest.hexdigest())
        return loaded.params

    @property
    def manager(self):
        """The orbax CheckpointManager of run.out_dir/checkpoints, opened on first use. It removes
        the temporary folders of saves a kill interrupted (orbax never restores those anyway)."""
        if self._manager is None:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(
                files.absolute(os.path.join(self.cfg.run.out_dir, CHECKPOINTS_DIR)),  # orbax does gs:// itself
                options=ocp.CheckpointManagerOptions(max_to_keep=self.cfg.run.keep_checkpoints, create=True,
                                                     enable_async_checkpointing=True, cleanup_tmp_directories=True))
        return self._manager

    def init_state(self, seed: int = 0) -> TrainState:
        def init(key, target_params, start):
            params = self._init_params(key)
            if start is not None:  # optim.init_from_drafter
                params = jax.tree.map(lambda p, w: w.astype(p.dtype), params, start)
            if self.cfg.optim.init_from_target:
                params = layers_from_target(params, self.dcfg, target_params, self.target.config)
            return TrainState(jnp.int32(0), params, self.optimizer.init(params))

        return jax.jit(init, out_shardings=self.state_shardings)(jax.random.key(seed), self.target_params,
                                                                 self.start_params)

    def save(self, state: TrainState) -> None:
        """Checkpoint `state` and the data position; every process calls it (orbax writes each
        process's shards, the JSON items from process 0)."""
        import orbax.checkpoint as ocp

        data_state = json.loads(json.dumps(self.data.get_state()))
        _check_same_everywhere(f"the data position at step {int(state.step)}", json.dumps(data_state, sort_keys=True))
        self.manager.save(int(state.step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data_global=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(json.loads(json.dumps(config_to_dict(self.cfg), default=str)))))

    def abstract_state(self) -> TrainState:
        """The train state's shapes, dtypes and shardings (what a restore fills in)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            jax.eval_shape(self.init_state), self.state_shardings)

    def restore_latest(self) -> TrainState | None:
        """The latest checkpoint's state (on this run's mesh, whatever the topology that saved it),
        with the data iterator set to its position; None without checkpoints."""
        import grain
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = self.abstract_state()
        if files.is_dir(os.path.join(self.cfg.run.out_dir, CHECKPOINTS_DIR, str(step), "data_global")):
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data_global=ocp.args.JsonRestore()))
            self.data.set_state(restored["data_global"])
            if hasattr(self.data, "start_prefetch"):
                self.data.start_prefetch()
        else:  # a checkpoint from before the global stream: grain's per-process iterator state (same topology)
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(self.data)))
        return restored["state"]

    def latest_state(self) -> TrainState | None:
        """The latest checkpoint's train state alone (the data iterator untouched); None without
        checkpoints. For exporting a drafter from a run that is still going."""
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = self.abstract_state()
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]

    def _feature_cache(self, progress: bool):
        """Open data.feature_cache, checked against this run; build it first if it is not complete."""
        from dspark_jax.data import feature_cache

        cfg, path = self.cfg, self.cfg.data.feature_cache
        expected = feature_cache.cache_spec(self.target.name, self.target.config, self.dcfg.tap_layers,
                                            feature_cache.data_fingerprint(self.train_source), cfg.data.seq_len)
        weights_dtype = cfg.data.feature_cache_dtype or cfg.run.compute_dtype
        expected["compute_dtype"] = weights_dtype
        if not feature_cache.is_complete(path):
            if jax.process_count() > 1:
                raise UserError(f"no complete feature cache in {path}: build it with a single-process run "
                                f"(it is one file for all processes), or train without data.feature_cache")
            print(f"building the feature cache of {cfg.data.train_dir} in {path} (once; later runs reuse it)",
                  file=sys.stderr, flush=True)
            # what the online path runs the target with (make_loss), unless data.feature_cache_dtype says otherwise
            params, feature_cfg = target_feature_inputs(self.target_params, self.target.config, weights_dtype)
            feature_cache.build_feature_cache(
                params, feature_cfg, self.dcfg.tap_layers, self.train_source, cfg.data.seq_len, path,
                rows=cfg.data.rows, progress=progress, target_name=self.target.name,
                batch_sharding=self.eval_sharding)
        return feature_cache.open_feature_cache(path, expected)

    def host_batch(self, batch: dict) -> dict:
        """A train batch from the pipeline -> what the step takes: the cached target features added
        (with data.feature_cache), the host-only token_index dropped."""
        batch = dict(batch)
        token_index = batch.pop("token_index", None)
        if self.feature_cache is None:
            return batch
        if token_index is None:
            raise UserError("data.feature_cache needs batches with token_index (dspark_jax.data.pipeline)")
        from dspark_jax.data.feature_cache import gather

        ctx, last = gather(self.feature_cache, token_index, batch["segment_ids"] > 0)
        return {**batch, "ctx_features": ctx, "target_last_hidden": last}

    def local_batch(self, batch: dict, batch_sharding: NamedSharding | None = None) -> dict:
        """A global batch (from the stream every process iterates) -> the rows this process's
        devices hold under `batch_sharding` (default: the train batch's); all of them with one
        process."""
        from dspark_jax.data.pipeline import process_rows

        batch_sharding = batch_sharding or self.batch_sharding
        rows = len(next(iter(batch.values())))
        keep = process_rows(batch_sharding, rows)
        if len(keep) == rows:
            return batch
        return {k: np.asarray(v)[keep] for k, v in batch.items()}

    def device_batch(self, batch: dict, batch_sharding: NamedSharding | None = None,
                     rows: int | None = None) -> dict:
        """This process's rows (`local_batch`) -> one global array per field of `rows` rows
        (default: inferred from the sharding); token_index stays on the host."""
        batch_sharding = batch_sharding or self.batch_sharding
        shape = lambda v: None if rows is None else (rows,) + np.shape(v)[1:]  # noqa: E731
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v), shape(v))
                for k, v in batch.items() if k != "token_index"}

    def next_batch(self) -> tuple[dict, int]:
        """The next train batch as the step takes it (global arrays), and its number of valid blocks."""
        batch = next(self.data)
        blocks = int(np.asarray(batch["block_valid"]).sum())
        return self.device_batch(self.host_batch(self.local_batch(batch)), rows=self.batch_rows), blocks

    def host_params(self, state: TrainState) -> dict:
        """The params as numpy arrays on every process (a collective with several processes: all of
        them must call it)."""
        if jax.process_count() == 1:
            return jax.tree.map(np.asarray, jax.device_get(state.params))
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(state.params, tiled=True))

    def evaluate(self, params) -> dict:
        """Mean metrics over the first run.eval_batches batches of data.eval_dir (the same batches
        every time: one epoch, fixed anchors), prefixed `eval_`; {} without eval data."""
        if not self.cfg.data.eval_dir:
            return {}
        batches = _packed_batches(self.cfg, self.dcfg, self.cfg.data.eval_dir, self.cfg.data.rows, 1)
        totals: dict = {}
        count = 0
        for batch, _ in zip(batches, range(self.cfg.run.eval_batches)):  # the same count on every process
            batch = self.device_batch(self.local_batch(batch, self.eval_sharding), self.eval_sharding,
                                      self.cfg.data.rows)  # online target features
            _, metrics = self.eval_step(params, self.target_params, batch)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0) + np.asarray(v, np.float64)
            count += 1
        return {f"eval_{k}": (v / max(count, 1)).tolist() for k, v in totals.items()}

    def claim_run_folder(self, resume: bool, overwrite: bool = False,
                         allow_schedule_change: bool = False) -> RunFolderCheck:
        """`check_run_folder`, then (process 0) clear it for an overwrite and write run.json for a
        new run, atomically."""
        cfg = self.cfg
        same = dict(jsonable_config(cfg))  # paths may differ per host (local copies)
        same["data"] = {k: v for k, v in same["data"].items() if k not in ("train_dir", "eval_dir", "feature_cache")}
        same["optim"] = {k: v for k, v in same["optim"].items() if k != "init_from_drafter"}  # its weights: checked
        same["run"] = {k: v for k, v in same["run"].items() if k != "out_dir"}
        _check_same_everywhere("the run's config (paths aside)", json.dumps({**same, "target": None}, sort_keys=True))
        check = check_run_folder(cfg, resume, overwrite, allow_schedule_change)
        barrier("dspark-run-folder-checked")  # every process checked before process 0 writes
        if jax.process_index() == 0:
            if overwrite:
                clear_run_folder(cfg.run.out_dir)
            files.makedirs(cfg.run.out_dir)
            if check.stored is None or not files.exists(os.path.join(cfg.run.out_dir, RUN_FILE)):
                files.atomic_write_text(os.path.join(cfg.run.out_dir, RUN_FILE),
                              json.dumps({"config": jsonable_config(cfg), "started": _now()}, indent=1) + "\n")
        barrier("dspark-run-folder-claimed")
        return check

    def _record_resume(self, check: RunFolderCheck, step: int, dropped: int) -> None:
        """Append the resume to resumes.jsonl; a schedule change also goes into run.json (the run's
        config from now on), and the learning rate it moves is reported."""
        cfg, out = self.cfg, self.cfg.run.out_dir
        record = {"time": _now(), "step": step, "dropped_log_lines": dropped,
                  "changes": {k: list(v) for k, v in check.changes.items()}}
        if "optim.steps" in check.changes:
            try:
                old = float(lr_schedule(OptimConfig(**check.stored["optim"]))(step))
            except TypeError:  # a stored optim section of another shape: nothing to compare
                old = None
            new = float(lr_schedule(cfg.optim)(step))
            record["lr_at_step"] = [old, new]
            if old is not None:
                print(f"{_describe({'optim.steps': check.changes['optim.steps']})}: the learning rate at step {step} "
                      f"goes from {old:.3g} to {new:.3g} (warmup and cosine decay span optim.steps)",
                      file=sys.stderr, flush=True)
        path = os.path.join(out, RESUMES_FILE)
        before = files.read_text(path) if files.exists(path) else ""
        files.atomic_write_text(path, before + json.dumps(record) + "\n")
        if check.changes:
            run = json.loads(files.read_bytes(os.path.join(out, RUN_FILE)))
            files.atomic_write_text(os.path.join(out, RUN_FILE),
                          json.dumps({**run, "config": jsonable_config(cfg)}, indent=1) + "\n")

    def fit(self, resume: bool = False, stop_after: int | None = None, progress: bool = True,
            overwrite: bool = False, allow_schedule_change: bool = False) -> TrainState:
        """Train to optim.steps (or stop after `stop_after` more steps, as an interruption would).

        resume: continue the run in run.out_dir from its latest checkpoint (from step 0 if it has
        none); otherwise the folder must be empty, or `overwrite` clears it. See check_run_folder."""
        cfg = self.cfg
        check = self.claim_run_folder(resume, overwrite, allow_schedule_change)
        state = self.restore_latest() if resume else None
        if state is None:
            state = self.init_state(cfg.data.seed)
        start = int(state.step)
        if start > cfg.optim.steps:
            raise UserError(f"optim.steps={cfg.optim.steps} is below step {start}, where the run in "
                            f"{cfg.run.out_dir} stopped: a resume can only continue it")
        end = cfg.optim.steps if stop_after is None else min(cfg.optim.steps, start + stop_after)
        log_path = os.path.join(cfg.run.out_dir, METRICS_FILE)
        primary = jax.process_index() == 0
        if resume and primary:
            # the records after the restored checkpoint are written again below
            dropped = truncate_metrics(log_path, start)
            if check.stored is not None:
                self._record_resume(check, start, dropped)
        barrier("dspark-run-log-ready")  # metrics.jsonl cut back before anything is appended
        bar = tqdm(total=cfg.optim.steps, initial=start, disable=not (progress and primary), desc="train",
                   unit="step")
        rows = self.batch_rows
        budget = TimeBudget(cfg.run.time_budget_s)
        # On an object store metrics.jsonl is rewritten whole every files.OBJECT_REWRITE_S seconds (no appends).
        with files.open_append(log_path) if primary else open(os.devnull, "a") as log:
            if start == 0 and cfg.optim.init_from_drafter and cfg.data.eval_dir:
                # The drafter it starts from, on the same held-out batches: what the run must beat.
                log.write(json.dumps({"step": 0, **self.evaluate(state.params)}) + "\n")
                log.flush()
            t_last, blocks = time.perf_counter(), 0
            for _ in range(start, end):
                batch, batch_blocks = self.next_batch()
                blocks += batch_blocks
                state, metrics = self.train_step(state, self.target_params, batch)
                step = int(state.step)
                bar.update(1)
                stop = budget.spent_after_step()  # the same answer on every process (process 0's clock)
                if step % cfg.run.log_every == 0 or step == cfg.optim.steps or stop:  # not at stop_after
                    now = time.perf_counter()
                    record = {"step": step, **{k: np.asarray(v).tolist() for k, v in metrics.items()},
                              "blocks_per_s": blocks / (now - t_last), "rows": rows}
                    if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == cfg.optim.steps or stop:
                        record.update(self.evaluate(state.params))  # held-out tau proxy, per-position acceptance
                    if stop:
                        record["time_budget_spent"] = True
                    t_last, blocks = time.perf_counter(), 0
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record.get('expected_tau', 0):.2f}")
                if step % cfg.run.save_every == 0 or step == end or stop:
                    self.save(state)
                if stop:
                    if primary:
                        print(f"run.time_budget_s={cfg.run.time_budget_s:g} spent: stopped at step {step} "
                              f"(--resume continues)", file=sys.stderr, flush=True)
                    break
        bar.close()
        self.manager.wait_until_finished()
        return state

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
