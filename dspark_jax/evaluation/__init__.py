"""Evaluation: confidence calibration, Sequential Temperature Scaling, threshold sweeps, plots.

`dspark_jax.evaluation.calibration` is numpy-only and re-exported here;
`dspark_jax.evaluation.plots` (matplotlib, Agg) is imported on demand so that importing this
package stays cheap.
"""

from dspark_jax.evaluation.calibration import (
    DEFAULT_BINS,
    DEFAULT_GRID,
    ReliabilityCurve,
    calibration_report,
    conditional_acceptance,
    expected_calibration_error,
    fit_sts,
    prefix_survival,
    reliability_curve,
    roc_auc,
    survival_events,
    threshold_sweep,
    to_jsonable,
    verified_lengths,
)

__all__ = [
    "DEFAULT_BINS",
    "DEFAULT_GRID",
    "ReliabilityCurve",
    "calibration_report",
    "conditional_acceptance",
    "expected_calibration_error",
    "fit_sts",
    "prefix_survival",
    "reliability_curve",
    "roc_auc",
    "survival_events",
    "threshold_sweep",
    "to_jsonable",
    "verified_lengths",
]
