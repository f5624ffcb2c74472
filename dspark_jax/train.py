"""Train a drafter: `python -m dspark_jax.train --config configs/dspark_smollm2-135m.yaml [key=value ...]`.

Overrides use dotted keys into the config sections, e.g. `optim.steps=200 run.out_dir=runs/try`.
A run folder (run.out_dir) belongs to one run: a new run needs an empty or new folder (`--overwrite`
replaces the run in it), and `--resume` continues from the latest checkpoint there (bit-for-bit the
same run as an uninterrupted one) with the config the run started with (run.json; a changed
schedule, e.g. more optim.steps, needs `--allow-schedule-change` and is recorded in resumes.jsonl).
At the end the drafter is exported to run.out_dir/drafter (safetensors + JSON); `--export-latest`
writes the drafter of the latest checkpoint to run.out_dir/drafter-step-N instead, without training
(a run that is still going, or was stopped, gives a drafter to calibrate, evaluate or ship).
Several processes (`--coordinator-address/--num-processes/--process-id`, or `--distributed`) train
one run together: each runs this same command; the global batches, and so the run, do not depend on
how many processes there are, and a run resumes on another number of processes.
"""

from __future__ import annotations

import contextlib
import os
import sys

from dspark_jax.core import files
from dspark_jax.core.cli import ArgumentParser, add_settings, flag, run_cli, settings_from
from dspark_jax.distributed import gather, runtime


@run_cli
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m dspark_jax.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=3e-4")
    p.add_argument("--resume", action="store_true", help="continue the run in run.out_dir from its latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run in run.out_dir (removes what a run writes there, nothing else)")
    p.add_argument("--allow-schedule-change", action="store_true",
                   help="on --resume, accept changed optim.steps / run.* settings (recorded in resumes.jsonl)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--export-latest", action="store_true",
                   help="write the latest checkpoint's drafter to run.out_dir/drafter-step-N and exit (nothing trains)")
    plan = p.add_argument_group("--plan: memory per device and FLOPs per step, from shapes alone (nothing trains)")
    plan.add_argument("--plan", action="store_true", help="print the plan of this config and exit")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--devices", type=flag(int, ge=1), help="plan for N devices (default: the devices here)")
    where.add_argument("--accelerator-type", help="plan for a Cloud TPU slice, e.g. v5p-8 (4 chips) or v6e-8 (8 chips)")
    plan.add_argument("--accelerator", help="chip for HBM and step time (a serving.hardware.ACCELERATORS key, e.g. "
                                            "tpu-v5p; default: from --accelerator-type)")
    plan.add_argument("--target-config", help="the target's config.json, when the target is not on this machine")
    plan.add_argument("--mfu", type=flag(float, gt=0, le=1), default=None,
                      help="assumed model FLOP utilisation for the step time (default 0.4)")
    plan.add_argument("--compile", action="store_true",
                      help="with --accelerator-type: also compile the train and eval steps with the TPU compiler for "
                           "that slice, from shapes alone, and print its memory per chip (needs libtpu: pip install "
                           "'jax[tpu]'; nothing runs on a TPU)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    add_settings(p, runtime.ProcessSettings)
    args = p.parse_args(argv)
    if args.allow_schedule_change and not args.resume:
        p.error("--allow-schedule-change only applies with --resume")
    if args.export_latest and (args.resume or args.overwrite or args.plan):
        p.error("--export-latest trains nothing: it takes no --resume, --overwrite or --plan")
    plan_only = [f for f in ("devices", "accelerator_type", "accelerator", "target_config", "mfu") if
                 getattr(args, f) is not None] + (["json"] if args.json else []) + (["compile"] if args.compile else [])
    if plan_only and not args.plan:
        p.error(f"--{plan_only[0].replace('_', '-')} only applies with --plan")

    from dspark_jax.training.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.plan:
        import json

        from dspark_jax.training import plan as training_plan

        if args.compile and "JAX_PLATFORMS" not in os.environ:
            import jax

            # this process's own devices stay the CPU: with libtpu installed, JAX would otherwise try
            # (and on a machine without a TPU fail, noisily) to start a TPU backend
            jax.config.update("jax_platforms", "cpu")

        found = training_plan.plan_for(cfg, devices=args.devices, accelerator_type=args.accelerator_type,
                                       accelerator=args.accelerator, target_config=args.target_config,
                                       mfu=args.mfu or training_plan.DEFAULT_MFU, compile=args.compile)
        print(json.dumps(found, indent=1) if args.json else training_plan.format_plan(found))
        return 0
    runtime.initialize(settings_from(runtime.ProcessSettings, args))  # before anything touches devices
    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.training.trainer import Trainer, check_run_folder

    if args.export_latest:
        return export_latest(cfg)
    folder = dict(resume=args.resume, overwrite=args.overwrite, allow_schedule_change=args.allow_schedule_change)
    check_run_folder(cfg, **folder)  # before loading anything: fit checks again, then writes
    with contextlib.ExitStack() as held:
        # One run at a time in a folder: a second `--resume` beside a live one would interleave
        # checkpoints and log lines. Process 0 holds the lock; its refusal stops every process.
        busy = (f"run folder {cfg.run.out_dir} is in use by another training process: wait for it to end or "
                f"stop it first (a killed one releases it)")
        gather.everywhere(lambda: gather.is_primary() and held.enter_context(files.folder_lock(cfg.run.out_dir, busy)))
        target = load_target(cfg.target)
        trainer = Trainer(cfg, target)
        state = trainer.fit(progress=not args.no_progress, **folder)
        trainer.close()
        write_drafter(cfg, trainer, state, os.path.join(cfg.run.out_dir, "drafter"))
    return 0


def export_latest(cfg) -> int:
    """The latest checkpoint's drafter, written beside the run's checkpoints; the run is untouched."""
    import dataclasses

    from dspark_jax.checkpoints.registry import load_target
    from dspark_jax.core.errors import UserError
    from dspark_jax.training.trainer import Trainer, check_run_folder

    check_run_folder(cfg, resume=True, allow_schedule_change=True)  # the run's own config, schedule aside
    # The feature cache feeds training steps only: an export neither builds nor opens it.
    without_cache = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, feature_cache=None))
    trainer = Trainer(without_cache, load_target(cfg.target), progress=False)
    state = trainer.latest_state()
    trainer.close()
    if state is None:
        raise UserError(f"no checkpoint to export in {cfg.run.out_dir}")
    write_drafter(cfg, trainer, state, os.path.join(cfg.run.out_dir, f"drafter-step-{int(state.step)}"))
    return 0


def write_drafter(cfg, trainer, state, out: str) -> None:
    """Export `state`'s drafter to `out` (every process takes part; process 0 writes). A drafter
    already exported there from the same step (a finished run resumed) is kept as it is: same
    weights, and a calibration `calibrate` stored in it since would otherwise be lost."""
    from dspark_jax.drafters.checkpoint import exported_step, save_drafter
    from dspark_jax.training.config import config_to_dict

    params = trainer.host_params(state)  # every process, whatever process 0 decides below
    if gather.is_primary() and exported_step(out) == int(state.step):
        print(f"drafter at {out} is already step {int(state.step)}'s: kept as it is")
    elif gather.is_primary():
        save_drafter(out, trainer.dcfg, params,
                     metadata={"train_config": config_to_dict(cfg), "steps": int(state.step),
                               **({"draft_vocab_coverage": {"train": trainer.draft_vocab_coverage,
                                                            "eval": trainer.draft_vocab_eval_coverage}}
                                  if trainer.draft_vocab_coverage is not None else {})})
        print(f"drafter written to {out}")
    gather.barrier("dspark-drafter-written")  # the run is over on every process once its drafter exists


if __name__ == "__main__":
    sys.exit(main())
