"""Hardware curves for the serving simulator: what one speculative round costs.

A *hardware curve* answers two questions for a concurrency C (request slots decoding together):

* `round_seconds(tokens, C)`: the wall time of one round (drafter pass + target verify pass) whose
  verify pass runs `tokens` tokens, AFTER padding to the engine's token bucket (anchors included);
* `sps_table(C)`: the SPS table the dspark schedulers plan with (DESIGN.md 3.1), i.e. what
  `decode` would have profiled on that hardware: SPS(b) = 1 / round_seconds(b, C) per bucket b.

Three curves:

* `SPSTableCurve`: SPS tables measured on a device (`dspark_jax/engine/sps.py` JSON, as `decode`
  profiles into `.dspark_cache/`), one per concurrency (a table for batch C covers the token
  buckets 1, 2, 4, ... up to C x (gamma + 1)). A table made by `decode` times a whole round (draft
  + verify), so the round time is 1 / SPS.
* `RooflineCurve`: a documented roofline of a named accelerator serving a named target with a
  DSpark drafter: each pass costs max(bytes / HBM bandwidth, FLOPs / peak FLOP/s) + a fixed
  per-pass overhead; see `verify_pass` and `draft_pass` for what is counted.
* `MeasuredRoundCurve`: per-C round times reconstructed from a `benchmarks/bench_serving.py`
  JSON (steady seconds / steady rounds of the cells whose verify token count is known exactly:
  `fixed` = C x (gamma + 1), `mtp1` = 2C, a `dspark` cell that verified nothing = C), linearly
  interpolated in the padded token count. This is the validation curve: the same machine, the same
  run as the measurement it is compared with.

Every hardware constant below names its source. The roofline is a lower bound on real step
time: no kernel reaches peak bandwidth or FLOP/s (efficiency factors default to 1.0 and can be
set), activations, sampling and communication are not counted, and the fixed overhead is an
assumption, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from dspark_jax.engine.sps import SPSTable, sps_of, token_buckets
from dspark_jax.core.errors import UserError

# ------------------------------------------------------------------------------------------------
# Accelerators (one chip). Dense (non-sparse) bf16 peak; HBM bandwidth and capacity per chip.


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    hbm_bytes_per_s: float  # peak HBM bandwidth of one chip
    peak_flops: float  # dense bf16 matmul peak of one chip, FLOP/s
    hbm_bytes: float  # HBM capacity of one chip
    source: str


ACCELERATORS: dict[str, Accelerator] = {
    "h200": Accelerator(
        "NVIDIA H200 SXM", 4.8e12, 989e12, 141e9,
        "NVIDIA H200 Tensor Core GPU datasheet: 141 GB HBM3e at 4.8 TB/s; BF16 tensor core 1,979 TFLOP/s "
        "with 2:4 sparsity, i.e. ~989 TFLOP/s dense (same SXM compute as H100)"),
    "h100": Accelerator(
        "NVIDIA H100 SXM", 3.35e12, 989e12, 80e9,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM): 80 GB HBM3 at 3.35 TB/s; BF16 1,979 TFLOP/s with "
        "sparsity, ~989 TFLOP/s dense"),
    "tpu-v5p": Accelerator(
        "Google TPU v5p (one chip)", 2.765e12, 459e12, 95e9,
        "Google Cloud TPU v5p documentation: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s per chip"),
    "tpu-v6e": Accelerator(
        "Google TPU v6e / Trillium (one chip)", 1.64e12, 918e12, 32e9,
        "Google Cloud TPU v6e documentation: 918 TFLOP/s bf16, 32 GB HBM at 1,640 GB/s per chip"),
    "tpu-v5e": Accelerator(
        "Google TPU v5e (one chip)", 819e9, 197e12, 16e9,
        "Google Cloud TPU v5e documentation: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s per chip"),
    "tpu-v4": Accelerator(
        "Google TPU v4 (one chip)", 1.2e12, 275e12, 32e9,
        "Google Cloud TPU v4 documentation: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s per chip"),
}


# ------------------------------------------------------------------------------------------------
# Target and drafter shapes


@dataclasses.dataclass(frozen=True)
class TargetShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    source: str = ""

    @property
    def attn_params(self) -> int:
        """q, k, v, o projections of one layer (q/k norms and biases are negligible)."""
        d, hd = self.hidden_size, self.head_dim
        return d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # SwiGLU: gate, up, down

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies with: all layers + the LM head (the embedding is a gather)."""
        return self.num_layers * self.layer_params + self.lm_head_params

    @property
    def total_params(self) -> int:
        return self.matmul_params + (0 if self.tie_word_embeddings else self.lm_head_params)

    def kv_elements_per_token(self, layers: int | None = None) -> int:
        """K and V elements cached per token over `layers` (default: all) layers."""
        return 2 * (self.num_layers if layers is None else layers) * self.num_kv_heads * self.head_dim


# Shapes from each model's Hugging Face config.json.
TARGETS: dict[str, TargetShape] = {
    "qwen3-4b": TargetShape("Qwen3-4B", 36, 2560, 9728, 32, 8, 128, 151936, True,
                            "huggingface.co/Qwen/Qwen3-4B config.json"),
    "qwen3-8b": TargetShape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936, False,
                            "huggingface.co/Qwen/Qwen3-8B config.json"),
    "qwen3-14b": TargetShape("Qwen3-14B", 40, 5120, 17408, 40, 8, 128, 151936, False,
                             "huggingface.co/Qwen/Qwen3-14B config.json"),
    "smollm2-135m": TargetShape("SmolLM2-135M-Instruct", 30, 576, 1536, 9, 3, 64, 49152, True,
                                "huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
}


def target_from_hf_config(path: str) -> TargetShape:
    """A TargetShape from a Hugging Face config.json (parsed by the decoder's own config reader)."""
    from dspark_jax.core.files import read_json_object
    from dspark_jax.models.config import config_from_hf

    hf = read_json_object(path, "target config")
    try:
        cfg = config_from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"target config {path}: {e}") from None
    return TargetShape(str(hf.get("_name_or_path") or path), cfg.num_layers, cfg.hidden_size, cfg.intermediate_size,
                       cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, bool(cfg.tie_word_embeddings),
                       f"{path}")


@dataclasses.dataclass(frozen=True)
class DrafterShape:
    """A DSpark drafter (DESIGN.md 2): `num_layers` decoder layers shaped like the target's, the
    target's frozen embedding and LM head (shared, not stored twice), a Markov head of rank
    `markov_rank`, fusion of `taps` tapped target layers. Defaults: configs/dspark_qwen3-8b.yaml
    (DeepSpec recipe: 5 layers, rank 256, 5 taps)."""

    num_layers: int = 5
    markov_rank: int = 256
    taps: int = 5

    def own_params(self, t: TargetShape) -> int:
        """Parameters the drafter stores on top of the target's (embedding / LM head are shared)."""
        d = t.hidden_size
        markov = 2 * t.vocab_size * self.markov_rank  # W_1 [V, r] and W_2 [r, V]
        return self.num_layers * t.layer_params + self.taps * d * d + markov


# ------------------------------------------------------------------------------------------------
# The roofline


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Step time = max(bytes / (bandwidth x eff), FLOPs / (peak x eff)) + overhead, per pass.

    kv_len: mean context length of a request (tokens in its KV cache during a round); in a steady
    refilled server this is the mean over each request's life (prompt + half its output).
    chips: ideal tensor parallelism (bandwidth, FLOP/s and HBM scale by `chips`; no communication
    cost is modelled, so more than one chip is optimistic).
    """

    accelerator: Accelerator
    target: TargetShape
    drafter: DrafterShape = DrafterShape()
    gamma: int = 7
    kv_len: int = 1024
    chips: int = 1
    weight_bytes: int = 2  # bf16 weights
    kv_bytes: int = 2  # bf16 KV cache
    verify_overhead_s: float = 5e-4  # ASSUMPTION: launch + sampling + host scheduling per target pass
    draft_overhead_s: float = 5e-4  # ASSUMPTION: the same for the drafter pass
    bandwidth_efficiency: float = 1.0  # fraction of peak HBM bandwidth reached (1.0 = pure roofline)
    flops_efficiency: float = 1.0  # fraction of peak FLOP/s reached (1.0 = pure roofline)

    def __post_init__(self):
        if self.gamma < 1 or self.kv_len < 0 or self.chips < 1:
            raise UserError("the roofline needs gamma >= 1, kv_len >= 0 and chips >= 1")
        if not (0 < self.bandwidth_efficiency <= 1 and 0 < self.flops_efficiency <= 1):
            raise UserError("efficiencies must be in (0, 1]")
        if self.verify_overhead_s < 0 or self.draft_overhead_s < 0:
            raise UserError("per-pass overheads must be >= 0")

    def _time(self, bytes_, flops, overhead):
        bw = self.accelerator.hbm_bytes_per_s * self.bandwidth_efficiency * self.chips
        peak = self.accelerator.peak_flops * self.flops_efficiency * self.chips
        return np.maximum(np.asarray(bytes_, np.float64) / bw, np.asarray(flops, np.float64) / peak) + overhead

    def verify_pass(self, tokens, concurrency: int) -> dict[str, np.ndarray]:
        """The target pass over `tokens` (padded) tokens of `concurrency` requests.

        bytes = every matmul weight once (layers + LM head) + every request's KV cache once
                (C x kv_len x 2 x layers x kv_heads x head_dim) + the new tokens' K/V written;
        FLOPs = 2 x tokens x matmul params (incl. the LM head: verification needs logits at every
                position) + attention 4 x tokens x layers x heads x head_dim x kv_len (QK^T and PV).
        """
        t, n = self.target, np.asarray(tokens, np.float64)
        kv_tok = t.kv_elements_per_token() * self.kv_bytes
        bytes_ = t.matmul_params * self.weight_bytes + concurrency * self.kv_len * kv_tok + n * kv_tok
        flops = 2.0 * n * t.matmul_params + 4.0 * n * t.num_layers * t.num_heads * t.head_dim * self.kv_len
        return {"bytes": bytes_, "flops": flops, "seconds": self._time(bytes_, flops, self.verify_overhead_s)}

    def draft_pass(self, concurrency: int) -> dict[str, float]:
        """The drafter pass of one round for `concurrency` requests (paid whatever is verified).

        Block tokens C x gamma go through the drafter's layers, the shared LM head and the Markov
        head (W_2 is read once per sequential step: gamma times); the newly committed tokens'
        target features are fused and projected into the drafter's context cache (counted for
        C x (gamma + 1) tokens, the most a round commits); block queries attend to the drafter's
        context cache (C x kv_len x 2 x drafter layers x kv_heads x head_dim) and the block.
        """
        t, dr, g, C = self.target, self.drafter, self.gamma, concurrency
        d, r, V = t.hidden_size, dr.markov_rank, t.vocab_size
        block, ctx = C * g, C * (g + 1)
        ctx_update = dr.taps * d * d + dr.num_layers * 2 * d * t.num_kv_heads * t.head_dim
        weights = (dr.num_layers * t.layer_params + dr.taps * d * d + t.lm_head_params) * self.weight_bytes
        weights += g * r * V * self.weight_bytes  # W_2, read at every sequential step
        kv = C * self.kv_len * t.kv_elements_per_token(dr.num_layers) * self.kv_bytes
        flops = (2.0 * block * (dr.num_layers * t.layer_params + t.lm_head_params + r * V)
                 + 2.0 * ctx * ctx_update
                 + 4.0 * block * dr.num_layers * t.num_heads * t.head_dim * (self.kv_len + g))
        bytes_ = weights + kv
        return {"bytes": float(bytes_), "flops": float(flops),
                "seconds": float(self._time(bytes_, flops, self.draft_overhead_s))}

    def hbm_needed(self, concurrency: int) -> float:
        """Bytes resident: target + drafter weights and both KV caches at kv_len per request."""
        t = self.target
        weights = (t.total_params + self.drafter.own_params(t)) * self.weight_bytes
        kv = concurrency * self.kv_len * (t.kv_elements_per_token() + t.kv_elements_per_token(self.drafter.num_layers))
        return float(weights + kv * self.kv_bytes)

    def fits(self, concurrency: int) -> bool:
        return self.hbm_needed(concurrency) <= self.accelerator.hbm_bytes * self.chips

    def round_seconds(self, tokens, concurrency: int) -> np.ndarray:
        return self.verify_pass(tokens, concurrency)["seconds"] + self.draft_pass(concurrency)["seconds"]

    def describe(self) -> dict[str, Any]:
        a, t = self.accelerator, self.target
        return {"accelerator": dataclasses.asdict(a), "target": dataclasses.asdict(t),
                "drafter": dataclasses.asdict(self.drafter),
                **{k: getattr(self, k) for k in ("gamma", "kv_len", "chips", "weight_bytes", "kv_bytes",
                                                 "verify_overhead_s", "draft_overhead_s", "bandwidth_efficiency",
                                                 "flops_efficiency")},
                "target_matmul_params": t.matmul_params, "drafter_own_params": self.drafter.own_params(t),
                "target_kv_bytes_per_token": t.kv_elements_per_token() * self.kv_bytes}


# ------------------------------------------------------------------------------------------------
# Curves: what the simulator asks


def bucket_sizes(max_tokens: int, spec: str = "pow2") -> tuple[int, ...]:
    """Verify token buckets: "pow2" = the engine's `token_buckets` (1, 2, 4, ... , max_tokens);
    "step:N" = the powers of two below N, then every multiple of N, then max_tokens (a finer
    ladder, like the CUDA-graph batch sizes of GPU servers); "step:1" = no padding at all."""
    if spec == "pow2":
        return token_buckets(max_tokens)
    if spec.startswith("step:"):
        try:
            step = int(spec[5:])
        except ValueError:
            step = 0
        if step < 1:
            raise UserError(f"bad bucket spec {spec!r}: use pow2 or step:N with N >= 1")
        small = [b for b in token_buckets(max_tokens) if b < step]
        return tuple(sorted(set(small + list(range(step, max_tokens, step)) + [max_tokens])))
    raise UserError(f"bad bucket spec {spec!r}: use pow2 or step:N")


class HardwareCurve:
    """Interface: `buckets(C)`, `round_seconds(padded_tokens, C)`, `sps_table(C)`, `describe()`,
    `concurrencies` (None: any C), `extras(C)` (per-C facts for the results rows)."""

    kind = "abstract"
    concurrencies: tuple[int, ...] | None = None

    def __init__(self, gamma: int):
        self.gamma = int(gamma)

    def buckets(self, concurrency: int) -> tuple[int, ...]:
        return token_buckets(concurrency * (self.gamma + 1))

    def round_seconds(self, tokens, concurrency: int) -> np.ndarray:
        raise NotImplementedError

    def sps_table(self, concurrency: int) -> SPSTable:
        b = self.buckets(concurrency)
        secs = np.asarray(self.round_seconds(np.asarray(b), concurrency), np.float64)
        return SPSTable(b, tuple(float(1.0 / s) for s in secs), device=self.kind, model=self.describe_short())

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def describe_short(self) -> str:
        return self.kind

    def extras(self, concurrency: int) -> dict[str, Any]:
        return {}

    def check(self, concurrency: int) -> None:
        if self.concurrencies is not None and concurrency not in self.concurrencies:
            raise UserError(f"the {self.kind} hardware curve has no data for concurrency {concurrency} "
                            f"(it covers {', '.join(map(str, self.concurrencies))})")


class RooflineCurve(HardwareCurve):
    kind = "roofline"

    def __init__(self, roofline: Roofline, buckets: str = "pow2"):
        super().__init__(roofline.gamma)
        self.roofline, self.bucket_spec = roofline, buckets
        bucket_sizes(8, buckets)  # validate the spec early

    def buckets(self, concurrency: int) -> tuple[int, ...]:
        return bucket_sizes(concurrency * (self.gamma + 1), self.bucket_spec)

    def round_seconds(self, tokens, concurrency: int) -> np.ndarray:
        return self.roofline.round_seconds(tokens, concurrency)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "buckets": self.bucket_spec, **self.roofline.describe()}

    def describe_short(self) -> str:
        r = self.roofline
        return f"roofline:{r.target.name}@{r.accelerator.name}x{r.chips}:kv{r.kv_len}"

    def extras(self, concurrency: int) -> dict[str, Any]:
        r = self.roofline
        return {"draft_ms": 1e3 * r.draft_pass(concurrency)["seconds"],
                "hbm_gb_needed": r.hbm_needed(concurrency) / 1e9, "fits_hbm": r.fits(concurrency)}


class SPSTableCurve(HardwareCurve):
    """Measured SPS tables, one per concurrency: round time = 1 / SPS(bucket)."""

    kind = "sps-table"

    def __init__(self, tables: Mapping[int, SPSTable], gamma: int, paths: Mapping[int, str] | None = None):
        super().__init__(gamma)
        self.tables = dict(sorted(tables.items()))
        self.paths = dict(paths or {})
        self.concurrencies = tuple(self.tables)

    @classmethod
    def from_files(cls, paths: Sequence[str], gamma: int) -> SPSTableCurve:
        from dspark_jax.engine.sps import load_sps_table

        tables, where = {}, {}
        for p in paths:
            t = load_sps_table(p)
            if t.max_tokens % (gamma + 1):
                raise UserError(f"SPS table {p}: largest bucket {t.max_tokens} is not a multiple of gamma + 1 = "
                                f"{gamma + 1}, so it is not a table `decode` profiled for gamma {gamma}")
            c = t.max_tokens // (gamma + 1)
            if c in tables:
                raise UserError(f"SPS tables {where[c]} and {p} are both for concurrency {c}")
            if any(s <= 0 for s in t.sps):
                raise UserError(f"SPS table {p} has a zero entry: cannot time a round from it")
            tables[c], where[c] = t, p
        return cls(tables, gamma, where)

    def buckets(self, concurrency: int) -> tuple[int, ...]:
        self.check(concurrency)
        return self.tables[concurrency].buckets

    def round_seconds(self, tokens, concurrency: int) -> np.ndarray:
        self.check(concurrency)
        sps = np.asarray(sps_of(self.tables[concurrency], np.asarray(tokens)), np.float64)
        if np.any(sps <= 0):
            raise ValueError("a round beyond the SPS table's largest bucket")
        return 1.0 / sps

    def sps_table(self, concurrency: int) -> SPSTable:
        self.check(concurrency)
        return self.tables[concurrency]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "tables": {str(c): {"path": self.paths.get(c), **t.to_json()}
                                              for c, t in self.tables.items()}}

    def describe_short(self) -> str:
        devices = sorted({t.device for t in self.tables.values()})
        return f"sps-table:{','.join(devices)}"


class MeasuredRoundCurve(HardwareCurve):
    """Round time per padded verify token count, reconstructed from a bench_serving JSON.

    Per concurrency C, the anchor points are the cells whose verify pass size is known exactly:
    fixed (padded [C, gamma + 1] layout: C x (gamma + 1) tokens), mtp1 (2C, a bucket when C is a
    power of two) and dspark / dspark-async cells with a zero verify budget (C tokens). Round time =
    steady_s / steady_rounds of that cell (drafter + verify + the engine's host work: everything the
    benchmark timed). Between anchors: linear in the padded token count; outside: the nearest
    segment's line, extended (flat with a single anchor).
    """

    kind = "measured-rounds"

    def __init__(self, points: Mapping[int, Sequence[tuple[float, float, str]]], gamma: int, source: str = ""):
        super().__init__(gamma)
        self.points = {int(c): sorted(p) for c, p in sorted(points.items())}
        self.concurrencies = tuple(self.points)
        self.source = source

    @classmethod
    def from_bench(cls, bench: Mapping[str, Any], source: str = "") -> MeasuredRoundCurve:
        gamma = int(bench["settings"]["gamma"])
        points: dict[int, dict[float, tuple[float, float, str]]] = {}
        for row in bench["rows"]:
            c, s = int(row["concurrency"]), row["scheduler"]
            if "steady_s" not in row or "steady_rounds" not in row:
                raise UserError("this bench_serving JSON has no steady-state timings (steady_s, steady_rounds): "
                                "it predates the steady-state benchmark; re-run benchmarks/bench_serving.py")
            if s == "fixed":
                tokens = c * (gamma + 1)
            elif s == "mtp1" and token_buckets(c * (gamma + 1)).count(2 * c):
                tokens = 2 * c
            elif s.startswith("dspark") and row["verify_budget"] == 0 and c in token_buckets(c * (gamma + 1)):
                tokens = c
            else:
                continue
            points.setdefault(c, {})[float(tokens)] = (float(tokens), row["steady_s"] / row["steady_rounds"], s)
        if not points:
            raise UserError("no bench_serving cell with a known verify size (fixed, mtp1) to build a curve from")
        return cls({c: list(p.values()) for c, p in points.items()}, gamma, source)

    def anchor_cells(self, concurrency: int) -> set[str]:
        return {s for _, _, s in self.points.get(concurrency, [])}

    def round_seconds(self, tokens, concurrency: int) -> np.ndarray:
        self.check(concurrency)
        pts = self.points[concurrency]
        x = np.asarray([p[0] for p in pts])
        y = np.asarray([p[1] for p in pts])
        n = np.asarray(tokens, np.float64)
        if len(x) == 1:
            return np.full(n.shape, y[0])
        # piecewise linear, extended with the end segments' slopes
        i = np.clip(np.searchsorted(x, n, side="right") - 1, 0, len(x) - 2)
        slope = (y[i + 1] - y[i]) / (x[i + 1] - x[i])
        return np.maximum(y[i] + slope * (n - x[i]), 1e-9)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source,
                "points": {str(c): [{"tokens": t, "round_s": s, "cell": cell} for t, s, cell in p]
                           for c, p in self.points.items()}}

    def describe_short(self) -> str:
        return f"measured-rounds:{self.source}"


def roofline_by_name(accelerator: str, target: str | TargetShape, **kw) -> Roofline:
    if accelerator not in ACCELERATORS:
        raise UserError(f"unknown accelerator {accelerator!r} (known: {', '.join(ACCELERATORS)})")
    if isinstance(target, str):
        if target not in TARGETS:
            raise UserError(f"unknown target {target!r} (known: {', '.join(TARGETS)}; or give --target-config)")
        target = TARGETS[target]
    return Roofline(ACCELERATORS[accelerator], target, **kw)


def crossover_tokens(roofline: Roofline, concurrency: int) -> float:
    """Verify tokens at which the target pass turns compute-bound (bytes/bw == flops/peak)."""
    t = roofline.target
    kv_tok = t.kv_elements_per_token() * roofline.kv_bytes
    bw = roofline.accelerator.hbm_bytes_per_s * roofline.bandwidth_efficiency
    peak = roofline.accelerator.peak_flops * roofline.flops_efficiency
    fixed = t.matmul_params * roofline.weight_bytes + concurrency * roofline.kv_len * kv_tok
    per_tok_flops = 2.0 * t.matmul_params + 4.0 * t.num_layers * t.num_heads * t.head_dim * roofline.kv_len
    # fixed/bw + n*kv_tok/bw = n*per_tok/peak
    denom = per_tok_flops / peak - kv_tok / bw
    return math.inf if denom <= 0 else (fixed / bw) / denom
