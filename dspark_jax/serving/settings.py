"""The settings of `python -m dspark_jax.simulate`, as values: one frozen dataclass per command
(`RunSettings`, `RecordSettings`, `ValidateSettings`), the drafter statistics (`StatsSettings`) and
the hardware curve (`CurveSettings`) shared by composition. Each field's type, range, default and
meaning is declared here once: the entry point makes its flags from them (`core.cli.add_setting`)
and the runs (`runs.py`) take the values, never the parsed flags.

Cheap to import (no jax): the entry point imports it before it parses. The accelerator and target
names, the policies, the bucket specs are checked where they are defined (`hardware`, `simulator`).
"""

from __future__ import annotations

import dataclasses

from dspark_jax.core.config_checks import setting, validate

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_POLICIES = ("fixed", "mtp1", "threshold", "dspark", "dspark-async")  # simulator.POLICIES


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatsSettings:
    """Where the drafter's rounds come from: exactly one of a rounds file, an eval.json, rates."""

    rounds_file: str | None = setting(None, doc="round records from `simulate record` (resampled)")
    eval_stats: str | None = setting(None, doc="eval.json of `python -m dspark_jax.eval` (synthetic rounds)")
    acceptance_rates: tuple[float, ...] = setting(
        (), ge=0, le=1, doc="what-if: per-position conditional acceptance rates, comma-separated (Beta confidences)")
    eval_drafter: str | None = setting(None, doc="drafter label inside eval.json (default: the first)")
    eval_group: str = setting("overall", doc="overall, domain:NAME or bench:NAME")
    eval_model: str = setting("reliability", choices=("reliability", "beta"),
                              doc="synthetic model for eval.json: reliability diagrams + copula, or Beta confidences")
    kappa: float | None = setting(None, gt=0, doc="Beta concentration of the confidences (beta model; default: "
                                                  "fitted to eval's threshold sweep, 2.0 for --acceptance-rates)")
    pool_size: int = setting(20000, ge=100, doc="synthetic rounds to draw")

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurveSettings:
    """The hardware curve: measured SPS tables, a bench_serving run's round times, or a roofline."""

    sps_table: tuple[str, ...] = setting((), doc="measured SPS table JSON (sps.py format), one per concurrency; "
                                                 "repeatable")
    bench_curve: str | None = setting(None, doc="round times reconstructed from a bench_serving JSON")
    accelerator: str = setting("h200", doc="roofline: a named accelerator (serving.hardware.ACCELERATORS)")
    target: str = setting("qwen3-8b", doc="roofline: a named target (serving.hardware.TARGETS)")
    target_config: str | None = setting(None, doc="Hugging Face config.json of the target (instead of --target)")
    kv_len: int = setting(1024, ge=0, doc="mean context length per request (tokens)")
    chips: int = setting(1, ge=1, doc="chips (ideal tensor parallelism, no communication cost)")
    verify_overhead_ms: float = setting(0.5, ge=0, doc="fixed cost per target pass (assumed)")
    draft_overhead_ms: float = setting(0.5, ge=0, doc="fixed cost per drafter pass (assumed)")
    bandwidth_efficiency: float = setting(1.0, gt=0, le=1, doc="fraction of the peak HBM bandwidth reached")
    flops_efficiency: float = setting(1.0, gt=0, le=1, doc="fraction of the peak FLOP/s reached")
    drafter_layers: int = setting(5, ge=1, doc="roofline drafter: decoder layers")
    markov_rank: int = setting(256, ge=0, doc="roofline drafter: rank of the Markov head (0: none)")
    taps: int = setting(5, ge=1, doc="roofline drafter: tapped target layers it fuses")
    buckets: str = setting("pow2", doc="verify token buckets: pow2 (the engine's) or step:N")

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """`simulate run`: every policy at every concurrency against a hardware curve."""

    stats: StatsSettings = setting(StatsSettings(), doc="the drafter statistics")
    curve: CurveSettings = setting(CurveSettings(), doc="the hardware curve")
    seed: int = setting(0, ge=0, doc="random seed of the synthetic rounds and of the simulation")
    concurrency: tuple[int, ...] = setting(
        (), ge=1, doc=f"comma-separated (default {','.join(map(str, DEFAULT_CONCURRENCY))}; a measured curve: its own)")
    policies: tuple[str, ...] = setting(DEFAULT_POLICIES, doc=f"comma-separated (default {','.join(DEFAULT_POLICIES)})")
    threshold: float = setting(0.5, ge=0, le=1, doc="prefix-survival threshold of the threshold policy")
    gamma: int | None = setting(None, ge=1, doc="draft tokens per round (default: the statistics')")
    slot_rounds: int = setting(32768, ge=1, doc="slot-rounds simulated per concurrency")
    warmup: int = setting(4, ge=0, doc="rounds simulated before measuring")
    request_rounds: int = setting(24, ge=1, doc="rounds a slot serves one request (refill period)")
    label: str = setting("", doc="suffix for plot titles")
    out: str = setting("benchmarks/results/simulate.md", doc="results .md (.json and .png beside it)")
    quiet: bool = setting(False, doc="no progress line per concurrency")

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecordSettings:
    """`simulate record`: real decoding with full-length verification, on bench_serving's prompts."""

    drafter: str = setting("default", doc="drafter folder ('default' = the shipped one)")
    target: str = setting("smollm2-135m", doc="target model: a registry name or a checkpoint folder")
    prompts: int = setting(64, ge=1, doc="bench_serving prompts to decode (its first N)")
    max_new_tokens: int = setting(48, ge=2, doc="tokens generated per prompt")
    max_prompt_tokens: int = setting(128, ge=1, doc="prompts are cut to this many tokens")
    temperature: float = setting(0.0, ge=0, doc="sampling temperature (0: greedy)")
    batch_size: int = setting(16, ge=1, doc="prompts decoded together")
    seed: int = setting(0, doc="random seed of the sampling")
    out: str = setting(doc="round-records JSON to write")

    def __post_init__(self):
        validate(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValidateSettings:
    """`simulate validate`: the simulator against a measured bench_serving run."""

    stats: StatsSettings = setting(StatsSettings(), doc="the drafter statistics")
    seed: int = setting(0, ge=0, doc="random seed of the synthetic rounds and of the simulation")
    bench: str = setting(doc="bench_serving results JSON to compare with")
    sps_table: tuple[str, ...] = setting(
        (), doc="SPS tables profiled on the benchmark's machine (default: round times from the bench JSON)")
    episodes: int = setting(200, ge=2, doc="simulated bench-length runs per cell")
    timing_noise: float | None = setting(None, ge=0, doc="relative timing noise of a cell (0.10)")
    out: str = setting("benchmarks/results/simulate_validation.md", doc="results .md (.json beside it)")

    def __post_init__(self):
        validate(self)
