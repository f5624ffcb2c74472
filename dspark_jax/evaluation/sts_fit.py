"""Calibrating a drafter's confidence head (`python -m dspark_jax.calibrate`): record full-length
rounds on held-out prompts, fit Sequential Temperature Scaling (DESIGN.md 2.6), report, store.

In a multi-process run every process records its share of the batches (`rounds.collect_rounds`:
batch b on process b % processes, gathered back in batch order, so the rounds are a one-process
run's); process 0 alone fits, writes the report and stores the drafter.
"""

from __future__ import annotations

import os

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather
from dspark_jax.evaluation.rounds import collect_rounds


def calibrate_drafter(args) -> dict:
    """What `python -m dspark_jax.calibrate` does (args: its settings): full-length rounds on the
    eval split's last --limit prompts per set, STS fitted on half and measured on the other half
    (the report), then fitted on all rounds and stored in the drafter (or --save-to) under this
    decoding temperature, beside its calibrations at other temperatures. Writes
    OUT/report.json and OUT/reliability.png; returns the summary the command prints.

    Several processes each call this with the same settings; all return the same summary, and a
    UserError on any process is raised on every one."""
    prompts, loaded, target = gather.everywhere(lambda: prepare(args))
    rounds = collect_rounds(target, loaded, prompts, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, batch_size=args.batch_size, seed=args.seed,
                            progress=not args.no_progress)
    return gather.on_primary(lambda: fit_and_store(args, prompts, loaded, target, rounds))


def prepare(args):
    """(prompts, loaded drafter, target), everything checkable without the target checked before it loads."""
    from dspark_jax.checkpoints import registry
    from dspark_jax.data.splits import get_split, parse_sets
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config

    if not read_drafter_config(args.drafter).confidence:  # the drafter's JSON only
        raise UserError("this drafter has no confidence head: nothing to calibrate")
    prompts = [q for name in parse_sets(args.sets) for q in get_split(name, "eval")[-args.limit:]]
    loaded = load_drafter(args.drafter)
    target = registry.load_target(args.target or loaded.config.target_name)
    loaded.config.check_target(target.config, target.name)
    return prompts, loaded, target


def fit_and_store(args, prompts, loaded, target, rounds) -> dict:
    """Fit STS on the recorded rounds, write the report and plot, store the temperatures; the summary.
    A file that cannot be written is a UserError (in a multi-process run every process reports it)."""
    from dspark_jax.drafters.checkpoint import save_drafter
    from dspark_jax.evaluation.calibration import (
        calibration_report,
        fit_sts,
        to_jsonable,
    )
    from dspark_jax.evaluation.plots import reliability_diagram

    logits, accepted = rounds.confidence_logits, rounds.accepted
    if len(accepted) < 20:
        raise UserError(f"only {len(accepted)} decoding rounds were recorded: use more prompts or tokens")
    order = np.random.default_rng(args.seed).permutation(len(accepted))
    fit_idx, test_idx = order[: len(order) // 2], order[len(order) // 2:]
    held_out_temps = fit_sts(logits[fit_idx], accepted[fit_idx])
    report = calibration_report(logits[test_idx], accepted[test_idx], held_out_temps)
    temperatures = fit_sts(logits, accepted)  # the stored temperatures use every round
    out = args.out or os.path.join(args.drafter, "calibration")
    summary = {"drafter": args.drafter, "target": target.name, "rounds": len(accepted),
               "prompts": len(prompts), "sets": args.sets, "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "temperatures": temperatures, "held_out_report": report}
    # Calibrations at other decoding temperatures stay; one at this temperature is replaced.
    by_temperature = dict(loaded.sts_by_temperature)
    if not by_temperature and loaded.sts_temperatures is not None:  # a drafter calibrated before there were several
        earlier = (loaded.metadata.get("calibration") or {}).get("temperature")
        if earlier is not None:
            by_temperature[float(earlier)] = loaded.sts_temperatures
    by_temperature[float(args.temperature)] = tuple(temperatures)
    calibration = to_jsonable({k: summary[k] for k in ("rounds", "prompts", "sets", "temperature", "max_new_tokens")})
    calibrations = {**(loaded.metadata.get("calibrations") or {}), f"{float(args.temperature):g}": calibration}
    metadata = dict(loaded.metadata, calibration=calibration, calibrations=calibrations)
    try:
        files.makedirs(out)
        files.atomic_write_json(os.path.join(out, "report.json"), to_jsonable(summary))
        png = reliability_diagram(report, os.path.join(out, "reliability.png"),
                                  title=f"STS calibration ({len(test_idx)} held-out rounds)")
        save_drafter(args.save_to or args.drafter, loaded.config, loaded.params, sts_temperatures=temperatures,
                     sts_by_temperature=by_temperature, metadata=metadata, dtype=args.storage_dtype or loaded.storage_dtype)
    except OSError as e:
        raise UserError(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    return to_jsonable({"rounds": len(accepted), "temperatures": temperatures, "ece_raw": report["ece_raw"],
                        "ece_sts": report["ece_sts"], "auc_sts": report["auc_sts"],
                        "report": os.path.join(out, "report.json"), "plot": png})
