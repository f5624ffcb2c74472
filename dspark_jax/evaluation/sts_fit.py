"""Calibrating a drafter's confidence head (`python -m dspark_jax.calibrate`): record full-length
rounds on held-out prompts, fit Sequential Temperature Scaling (DESIGN.md 2.6), report, store.

In a multi-process run every process records its share of the batches (`rounds.collect_rounds`:
batch b on process b % processes, gathered back in batch order, so the rounds are a one-process
run's); process 0 alone fits, writes the report and stores the drafter.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from dspark_jax.core import files
from dspark_jax.core.config_checks import setting, validate
from dspark_jax.core.errors import UserError
from dspark_jax.distributed import gather
from dspark_jax.evaluation.rounds import collect_rounds


@dataclasses.dataclass(frozen=True)
class CalibrateSettings:
    """What `python -m dspark_jax.calibrate` fits and where it writes (each field's doc is its flag's help)."""

    drafter: str = setting(doc="drafter checkpoint folder (updated in place)")
    target: str | None = setting(None, doc="target (default: the one recorded in the drafter)")
    sets: str = setting("gsm8k,math500,humaneval,mbpp,arena-hard-v2", doc="prompt sets; their EVAL split is used")
    limit: int = setting(16, ge=1, doc="prompts per set: the LAST N of its eval split (`eval` takes the first N, so "
                                       "calibration and evaluation prompts stay disjoint while 2N <= the split size)")
    save_to: str | None = setting(None, doc="write the calibrated drafter to this folder instead of updating --drafter "
                                            "in place")
    storage_dtype: str | None = setting(None, choices=("float32", "bfloat16"),
                                        doc="weight storage of the written drafter (default: as loaded; bfloat16 "
                                            "halves the size)")
    max_new_tokens: int = setting(128, ge=2, doc="tokens to generate per prompt at most")
    temperature: float = setting(1.0, ge=0, doc="decoding temperature the temperatures are fitted for (0 = greedy)")
    batch_size: int = setting(8, ge=1, doc="prompts decoded together")
    seed: int = setting(0, ge=0, lt=2**32, doc="random seed of the sampling and of the fit / measure split")
    out: str | None = setting(None, doc="report folder (default: DRAFTER/calibration)")
    progress: bool = setting(True, flag="--no-progress", doc="no progress bars")

    def __post_init__(self):
        validate(self)


def calibrate_drafter(settings: CalibrateSettings) -> dict:
    """What `python -m dspark_jax.calibrate` does: full-length rounds on the eval split's last
    --limit prompts per set, STS fitted on half and measured on the other half
    (the report), then fitted on all rounds and stored in the drafter (or --save-to) under this
    decoding temperature, beside its calibrations at other temperatures. Writes
    OUT/report.json and OUT/reliability.png; returns the summary the command prints.

    Several processes each call this with the same settings; all return the same summary, and a
    UserError on any process is raised on every one."""
    prompts, loaded, target = gather.everywhere(lambda: prepare(settings))
    rounds = collect_rounds(target, loaded, prompts, max_new_tokens=settings.max_new_tokens,
                            temperature=settings.temperature, batch_size=settings.batch_size, seed=settings.seed,
                            progress=settings.progress)
    return gather.on_primary(lambda: fit_and_store(settings, prompts, loaded, target, rounds))


def prepare(settings: CalibrateSettings):
    """(prompts, loaded drafter, target), everything checkable without the target checked before it loads."""
    from dspark_jax.checkpoints import registry
    from dspark_jax.data.splits import get_split, parse_sets
    from dspark_jax.drafters.checkpoint import load_drafter, read_drafter_config

    if not read_drafter_config(settings.drafter).confidence:  # the drafter's JSON only
        raise UserError("this drafter has no confidence head: nothing to calibrate")
    prompts = [q for name in parse_sets(settings.sets) for q in get_split(name, "eval")[-settings.limit:]]
    loaded = load_drafter(settings.drafter)
    target = registry.load_target(settings.target or loaded.config.target_name)
    loaded.config.check_target(target.config, target.name)
    return prompts, loaded, target


def fit_and_store(settings: CalibrateSettings, prompts, loaded, target, rounds) -> dict:
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
    order = np.random.default_rng(settings.seed).permutation(len(accepted))
    fit_idx, test_idx = order[: len(order) // 2], order[len(order) // 2:]
    held_out_temps = fit_sts(logits[fit_idx], accepted[fit_idx])
    report = calibration_report(logits[test_idx], accepted[test_idx], held_out_temps)
    temperatures = fit_sts(logits, accepted)  # the stored temperatures use every round
    out = settings.out or os.path.join(settings.drafter, "calibration")
    summary = {"drafter": settings.drafter, "target": target.name, "rounds": len(accepted),
               "prompts": len(prompts), "sets": settings.sets, "temperature": settings.temperature,
               "max_new_tokens": settings.max_new_tokens, "temperatures": temperatures, "held_out_report": report}
    # Calibrations at other decoding temperatures stay; one at this temperature is replaced.
    by_temperature = dict(loaded.sts_by_temperature)
    if not by_temperature and loaded.sts_temperatures is not None:  # a drafter calibrated before there were several
        earlier = (loaded.metadata.get("calibration") or {}).get("temperature")
        if earlier is not None:
            by_temperature[float(earlier)] = loaded.sts_temperatures
    by_temperature[float(settings.temperature)] = tuple(temperatures)
    calibration = to_jsonable({k: summary[k] for k in ("rounds", "prompts", "sets", "temperature", "max_new_tokens")})
    calibrations = {**(loaded.metadata.get("calibrations") or {}), f"{float(settings.temperature):g}": calibration}
    metadata = dict(loaded.metadata, calibration=calibration, calibrations=calibrations)
    try:
        files.makedirs(out)
        files.atomic_write_json(os.path.join(out, "report.json"), to_jsonable(summary))
        png = reliability_diagram(report, os.path.join(out, "reliability.png"),
                                  title=f"STS calibration ({len(test_idx)} held-out rounds)")
        save_drafter(settings.save_to or settings.drafter, loaded.config, loaded.params, sts_temperatures=temperatures,
                     sts_by_temperature=by_temperature, metadata=metadata,
                     dtype=settings.storage_dtype or loaded.storage_dtype)
    except OSError as e:
        raise UserError(f"cannot write {e.filename or out}: {e.strerror or e}") from None
    return to_jsonable({"rounds": len(accepted), "temperatures": temperatures, "ece_raw": report["ece_raw"],
                        "ece_sts": report["ece_sts"], "auc_sts": report["auc_sts"],
                        "report": os.path.join(out, "report.json"), "plot": png})
