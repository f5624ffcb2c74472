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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm.auto import tqdm

from dspark_jax import sharding
from dspark_jax.drafters.config import DrafterConfig
from dspark_jax.errors import UserError
from dspark_jax.models import decoder
from dspark_jax.models.config import ModelConfig
from dspark_jax.training.config import TrainConfig, config_to_dict
from dspark_jax.training.losses import chain_acceptance_metrics, dspark_loss


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: Any


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    o = cfg.optim
    warmup = max(1, int(o.warmup_frac * o.steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, o.lr, warmup, max(o.steps, warmup + 1), end_value=0.0)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm),
                       optax.adamw(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))


def drafter_functions(dcfg: DrafterConfig):
    """(init_params, loss_fn) for the drafter kind; loss_fn(params, target_params, batch) -> (loss, metrics)."""
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
                positions=batch["positions"], **slots)
            # Pass i at t drafts the chain's token i+1: per-position metrics as for a block at t + 1.
            alpha, mask = (jnp.moveaxis(out[k], 0, -1) for k in ("acceptance", "position_mask"))
            metrics = {"loss": out["total_loss"], "loss_per_step": out["loss"],
                       **chain_acceptance_metrics(alpha, mask)}
            return out["total_loss"], metrics

        return eagle3.init_eagle3_params, loss_fn

    from dspark_jax.drafters import dspark

    def loss_fn(params, target_params, tcfg, batch, weights):
        out = dspark.train_forward(params, dcfg, target_params, tcfg, batch, batch["ctx_features"],
                                   batch["target_last_hidden"])
        return dspark_loss(out, weights)

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
    _, loss_fn = drafter_functions(dcfg)
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
        micro_batches = jax.tree.map(lambda a: a.reshape((accum, a.shape[0] // accum) + a.shape[1:]), batch)

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


def drafter_logical_axes(params: dict) -> dict:
    """Logical axes of drafter params by name (see sharding.LOGICAL_TO_MESH)."""
    layer_axes = {"wq": ("layers", "embed", "heads"), "wk": ("layers", "embed", "kv_heads"),
                  "wv": ("layers", "embed", "kv_heads"), "wo": ("layers", "heads", "embed"),
                  "w_gate": ("layers", "embed", "mlp"), "w_up": ("layers", "embed", "mlp"),
                  "w_down": ("layers", "mlp", "embed")}
    top = {"fc": (None, "embed"), "w1": ("vocab", None), "w2": (None, "vocab")}

    def axes(path, leaf):
        name = path[-1].key
        if path[0].key == "layers":
            return layer_axes.get(name, ("layers",) + (None,) * (leaf.ndim - 1))
        return top.get(name, (None,) * leaf.ndim)

    return jax.tree_util.tree_map_with_path(axes, params)


def load_data(folder: str):
    """The ShardSource of a datagen folder (a UserError if there is none)."""
    from dspark_jax.data.pipeline import ShardSource

    if not os.path.isdir(folder):
        raise UserError(f"no data at {folder}: generate it with python -m dspark_jax.datagen")
    return ShardSource(folder)


def _packed_batches(cfg: TrainConfig, dcfg: DrafterConfig, data, rows: int, epochs: int | None):
    """Packed batches of `data` (a folder or a loaded ShardSource)."""
    from dspark_jax.data.pipeline import PackingConfig, make_dataset

    if rows % jax.process_count():
        raise UserError(f"{rows} rows per step must divide over {jax.process_count()} processes")
    packing = PackingConfig(batch_size=rows // jax.process_count(), seq_len=cfg.data.seq_len,
                            max_blocks=cfg.data.blocks_per_row, block_size=dcfg.block_size,
                            anchors_per_seq=cfg.data.anchors_per_seq, seed=cfg.data.seed, num_epochs=epochs)
    return iter(make_dataset(load_data(data) if isinstance(data, (str, os.PathLike)) else data, packing))


def make_train_iterator(cfg: TrainConfig, dcfg: DrafterConfig, source=None):
    """This process's checkpointable grain iterator of packed batches (grad_accum micro-batches each)
    of `source` (a ShardSource; default: data.train_dir loaded now)."""
    return _packed_batches(cfg, dcfg, cfg.data.train_dir if source is None else source,
                           cfg.data.rows * cfg.optim.grad_accum, None)


class Trainer:
    """Owns the mesh, shardings, jitted step and checkpoint manager of one run."""

    def __init__(self, cfg: TrainConfig, target,
                 data_factory: Callable[[TrainConfig, DrafterConfig, Any], Iterator] = make_train_iterator,
                 progress: bool = True):
        """`data_factory(cfg, dcfg, source)` makes the train iterator from `source`, the ShardSource
        of data.train_dir loaded once here (the feature cache is built from and checked against
        that same source, so the batches' token_index and the cache always agree)."""
        import orbax.checkpoint as ocp

        self.cfg, self.target = cfg, target
        self.dcfg = cfg.drafter_config(target.config, target.name)
        self.dcfg.check_target(target.config, target.name)
        self.mesh = sharding.make_mesh(*cfg.run.mesh)
        self.optimizer = make_optimizer(cfg)
        init_params, _ = drafter_functions(self.dcfg)
        self._init_params = functools.partial(init_params, self.dcfg)

        abstract_params = jax.eval_shape(self._init_params, jax.random.key(0))
        p_sh = sharding.tree_shardings(self.mesh, drafter_logical_axes(abstract_params),
                                       jax.tree.map(lambda a: a.shape, abstract_params))
        replicated = NamedSharding(self.mesh, P())
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_sh = optax.tree_utils.tree_map_params(self.optimizer, lambda _, s: s, abstract_opt, p_sh,
                                                  transform_non_params=lambda _: replicated)
        self.state_shardings = TrainState(replicated, p_sh, opt_sh)
        self.target_shardings = sharding.param_shardings(self.mesh, target.config, decoder.layout_of(target.params))
        self.target_params = jax.device_put(target.params, self.target_shardings)
        self.batch_sharding = NamedSharding(self.mesh, sharding.logical_spec(
            self.mesh, ("batch",), (cfg.data.rows * cfg.optim.grad_accum,)))
        step = make_train_step(cfg, self.dcfg, target.config, self.optimizer)
        self.train_step = jax.jit(step, in_shardings=(self.state_shardings, self.target_shardings, self.batch_sharding),
                                  out_shardings=(self.state_shardings, replicated), donate_argnums=(0,))
        self.train_source = load_data(cfg.data.train_dir)
        self.data = data_factory(cfg, self.dcfg, self.train_source)
        self.eval_step = jax.jit(make_loss(cfg, self.dcfg, target.config), out_shardings=replicated)
        self.eval_sharding = NamedSharding(self.mesh, sharding.logical_spec(self.mesh, ("batch",), (cfg.data.rows,)))
        self.feature_cache = self._feature_cache(progress) if cfg.data.feature_cache else None
        os.makedirs(cfg.run.out_dir, exist_ok=True)
        self.manager = ocp.CheckpointManager(
            os.path.abspath(os.path.join(cfg.run.out_dir, "checkpoints")),
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.run.keep_checkpoints, create=True,
                                                 enable_async_checkpointing=True))

    def init_state(self, seed: int = 0) -> TrainState:
        def init(key):
            params = self._init_params(key)
            return TrainState(jnp.int32(0), params, self.optimizer.init(params))

        return jax.jit(init, out_shardings=self.state_shardings)(jax.random.key(seed))

    def save(self, state: TrainState) -> None:
        import grain
        import orbax.checkpoint as ocp

        self.manager.save(int(state.step), args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(self.data),
            config=ocp.args.JsonSave(json.loads(json.dumps(config_to_dict(self.cfg), default=str)))))

    def restore_latest(self) -> TrainState | None:
        import grain
        import orbax.checkpoint as ocp

        step = self.manager.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                jax.eval_shape(self.init_state), self.state_shardings)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(self.data)))
        return restored["state"]

    def _feature_cache(self, progress: bool):
        """Open data.feature_cache, checked against this run; build it first if it is not complete."""
        from dspark_jax.data import feature_cache

        cfg, path = self.cfg, self.cfg.data.feature_cache
        expected = feature_cache.cache_spec(self.target.name, self.target.config, self.dcfg.tap_layers,
                                            feature_cache.data_fingerprint(self.train_source), cfg.data.seq_len)
        if not feature_cache.is_complete(path):
            if jax.process_count() > 1:
                raise UserError(f"no complete feature cache in {path}: build it with a single-process run "
                                f"(it is one file for all processes), or train without data.feature_cache")
            print(f"building the feature cache of {cfg.data.train_dir} in {path} (once; later runs reuse it)",
                  file=sys.stderr, flush=True)
            # exactly what the online path runs the target with (make_loss)
            params, feature_cfg = target_feature_inputs(self.target_params, self.target.config, cfg.run.compute_dtype)
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

    def device_batch(self, batch: dict, batch_sharding: NamedSharding | None = None) -> dict:
        """This process's rows -> one global array per field (multi-host safe); token_index stays
        on the host."""
        batch_sharding = batch_sharding or self.batch_sharding
        return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
                for k, v in batch.items() if k != "token_index"}

    def evaluate(self, params) -> dict:
        """Mean metrics over the first run.eval_batches batches of data.eval_dir (the same batches
        every time: one epoch, fixed anchors), prefixed `eval_`; {} without eval data."""
        if not self.cfg.data.eval_dir:
            return {}
        batches = _packed_batches(self.cfg, self.dcfg, self.cfg.data.eval_dir, self.cfg.data.rows, 1)
        totals: dict = {}
        count = 0
        for batch, _ in zip(batches, range(self.cfg.run.eval_batches)):
            batch = self.device_batch(batch, self.eval_sharding)  # online target features
            _, metrics = self.eval_step(params, self.target_params, batch)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0) + np.asarray(v, np.float64)
            count += 1
        return {f"eval_{k}": (v / max(count, 1)).tolist() for k, v in totals.items()}

    def fit(self, resume: bool = False, stop_after: int | None = None, progress: bool = True) -> TrainState:
        """Train to optim.steps (or stop after `stop_after` more steps, as an interruption would)."""
        cfg = self.cfg
        state = self.restore_latest() if resume else None
        if state is None:
            state = self.init_state(cfg.data.seed)
        start = int(state.step)
        end = cfg.optim.steps if stop_after is None else min(cfg.optim.steps, start + stop_after)
        log_path = os.path.join(cfg.run.out_dir, "metrics.jsonl")
        if not resume and os.path.exists(log_path):
            os.remove(log_path)
        bar = tqdm(total=cfg.optim.steps, initial=start, disable=not progress, desc="train", unit="step")
        rows = cfg.data.rows * cfg.optim.grad_accum
        t_last, blocks = time.perf_counter(), 0
        with open(log_path, "a") as log:
            for _ in range(start, end):
                batch = self.device_batch(self.host_batch(next(self.data)))
                blocks += int(np.asarray(batch["block_valid"]).sum())
                state, metrics = self.train_step(state, self.target_params, batch)
                step = int(state.step)
                bar.update(1)
                if step % cfg.run.log_every == 0 or step == end:
                    now = time.perf_counter()
                    record = {"step": step, **{k: np.asarray(v).tolist() for k, v in metrics.items()},
                              "blocks_per_s": blocks / (now - t_last), "rows": rows}
                    if (cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == cfg.optim.steps:
                        record.update(self.evaluate(state.params))  # held-out tau proxy, per-position acceptance
                    t_last, blocks = time.perf_counter(), 0
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record.get('expected_tau', 0):.2f}")
                if step % cfg.run.save_every == 0 or step == end:
                    self.save(state)
        bar.close()
        self.manager.wait_until_finished()
        return state

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
