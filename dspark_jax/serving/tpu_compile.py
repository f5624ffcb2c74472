"""The TPU compiler's verdict on a program, on any machine: compiled for a Cloud TPU slice from shapes.

With libtpu installed (`pip install 'jax[tpu]==<jax's version>'`), `jax.experimental.topologies`
describes a slice's chips without any being present; a program jitted with shardings over those
devices and lowered from `ShapeDtypeStruct`s compiles with the TPU compiler on this CPU. Its
`memory_analysis()` is what one chip needs (arguments, outputs, temporaries, generated code, less
what outputs reuse of donated arguments), its text names the collectives the partitioner inserted,
and `serving.hlo_cost` reads from that text its matmul flops and HBM bytes per execution with every
loop's trip count (`cost_analysis()` counts a loop's body once), hence the time the program takes
at the chip's roofline. The program must be traced with the TPU's choices
(`core.platform.tracing_for("tpu")`), not this CPU process's.

`tpu_slice("v5p-8")` parses a slice; `slice_devices(slice)` gives its devices; `program_report(name,
compiled, slice)` the per-chip figures; `format_reports` a table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import warnings
from collections.abc import Iterator

from dspark_jax.core.errors import UserError
from dspark_jax.serving.hardware import ACCELERATORS, Accelerator
from dspark_jax.serving.hlo_cost import program_cost

# accelerator-type prefix -> (family of the topology name, hardware.ACCELERATORS key, TensorCores a
# chip counts for in the type's number: v4 and v5p names count cores, v5e and v6e names chips)
_FAMILIES = {"v4": ("v4", "tpu-v4", 2), "v5p": ("v5p", "tpu-v5p", 2), "v5litepod": ("v5e", "tpu-v5e", 1),
             "v5e": ("v5e", "tpu-v5e", 1), "v6e": ("v6e", "tpu-v6e", 1)}
HBM_MARGIN = 0.10  # what a program may not use of a chip's HBM: the runtime's own buffers, fragmentation


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    accelerator_type: str  # as Cloud TPU names it: v5p-8, v5litepod-16, v6e-8
    chips: int
    chip: Accelerator
    topology: str  # as jax.experimental.topologies names it: v5p:2x2x1, v5e:4x4

    @property
    def key(self) -> str:
        return next(k for k, a in ACCELERATORS.items() if a is self.chip)


def _torus_shape(chips: int) -> str:
    """v4 / v5p slices are 3D tori grown from 2x2x1 (v5p-8 = 2x2x1, -16 = 2x2x2, -32 = 2x2x4,
    -64 = 2x4x4, -128 = 4x4x4, -256 = 4x4x8)."""
    dims = [2, 2, 1]
    if chips < 4 or chips & (chips - 1):
        raise UserError(f"a v4 / v5p slice has 4, 8, 16, ... chips (a power of two), not {chips}")
    while math.prod(dims) < chips:  # double the smallest axis, the last of equals
        dims[max(i for i in range(3) if dims[i] == min(dims))] *= 2
    return "x".join(map(str, dims))


def _grid_shape(chips: int) -> str:
    """v5e / v6e slices are 2D grids: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16."""
    if chips not in (1, 4) and (chips < 8 or chips & (chips - 1)):
        raise UserError(f"a v5e / v6e slice has 1, 4, 8, 16, ... 256 chips, not {chips}")
    x = 1 << (int(math.log2(chips)) // 2)
    return f"{x}x{chips // x}"


def tpu_slice(accelerator_type: str) -> TpuSlice:
    """The slice an accelerator type names, e.g. v5p-8 (4 chips: v5p names count TensorCores, two a
    chip) or v6e-8 (8 chips)."""
    m = re.fullmatch(r"(v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator_type.strip().lower())
    if not m:
        raise UserError(f"unknown TPU accelerator type {accelerator_type!r} (e.g. v5p-8, v6e-8, v5litepod-16, v4-32)")
    family, key, per_chip = _FAMILIES[m[1]]
    count = int(m[2])
    if count % per_chip or count == 0:
        raise UserError(f"{accelerator_type}: {m[1]} slices come in multiples of {per_chip}")
    chips = count // per_chip
    shape = _torus_shape(chips) if family in ("v4", "v5p") else _grid_shape(chips)
    return TpuSlice(accelerator_type, chips, ACCELERATORS[key], f"{family}:{shape}")


def libtpu_missing() -> str | None:
    """One line saying how to install libtpu, or None where it is installed."""
    if importlib.util.find_spec("libtpu") is not None:
        return None
    import jax

    return (f"compiling for a TPU needs libtpu on this machine: pip install 'jax[tpu]=={jax.__version__}' "
            "(it runs nothing on a TPU; set JAX_PLATFORMS=cpu so that this process's own devices stay the CPU)")


def slice_devices(tpu: TpuSlice) -> list:
    """The slice's devices (every process's, as a multi-controller run would see them), for meshes and
    shardings of programs to compile; none of them runs anything here."""
    missing = libtpu_missing()
    if missing:
        raise UserError(missing)
    # Without these libtpu looks for the TPU VM's metadata server and prints warnings on stderr, and
    # takes a lock that lets one process at a time load it (a second compile check, or a test worker
    # beside another, would fail): with no TPU behind it, several processes may.
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                        ("TPU_ACCELERATOR_TYPE", tpu.accelerator_type), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(name, value)
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=tpu.topology).devices)


@contextlib.contextmanager
def quiet_cache() -> Iterator[None]:
    """Programs compiled for a topology (no TPU client behind it) cannot be read back from JAX's
    persistent compilation cache, where one is set: JAX warns and compiles again, which is right;
    the warning says nothing to a user of the compile check."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Error (reading|writing) persistent compilation cache entry")
        yield


# ------------------------------------------------------------------------------------------------
# What the compiler says about one program

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")  # an op, not its -done half


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments
    temp_bytes: int
    code_bytes: int
    hbm_bytes: float  # the chip's
    collectives: dict  # kind -> count in the compiled program's text
    while_loops: int  # loops left in the program
    dynamic_loops: int  # of which of a data-dependent length: counted once in the cost below
    flops: float  # matmul flops per chip and execution, every loop body times its trip count (hlo_cost)
    bytes_accessed: float  # HBM bytes read and written per chip and execution (hlo_cost)
    peak_flops: float = 0.0  # the chip's
    hbm_bytes_per_s: float = 0.0

    @property
    def per_chip_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        """Within the chip's HBM less HBM_MARGIN."""
        return self.per_chip_bytes <= (1 - HBM_MARGIN) * self.hbm_bytes

    @property
    def roofline_s(self) -> float:
        """The execution's time at the chip's roofline: its flops at peak or its bytes at full HBM
        bandwidth, whichever takes longer."""
        return max(self.flops / self.peak_flops, self.bytes_accessed / self.hbm_bytes_per_s)

    @property
    def bound(self) -> str:
        return "compute" if self.flops / self.peak_flops >= self.bytes_accessed / self.hbm_bytes_per_s else "memory"

    @property
    def roofline_mfu(self) -> float:
        """The model-flops utilisation a step taking `roofline_s` reaches: the most it can."""
        return self.flops / (self.roofline_s * self.peak_flops) if self.roofline_s else 0.0

    @property
    def bytes_per_argument_byte(self) -> float:
        """HBM bytes an execution moves per byte of its arguments (weights, caches, state): near 1
        for a decode step that reads each weight and its caches once, above 1 where it copies them."""
        return self.bytes_accessed / self.argument_bytes if self.argument_bytes else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "per_chip_bytes": self.per_chip_bytes, "fits": self.fits,
                "roofline_s": self.roofline_s, "bound": self.bound, "roofline_mfu": self.roofline_mfu}


def program_report(name: str, compiled, tpu: TpuSlice) -> ProgramReport:
    """The per-chip figures of a program compiled for `tpu`'s devices."""
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    found = _COLLECTIVE.findall(text)
    cost = program_cost(text)
    return ProgramReport(
        name=name, argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes), hbm_bytes=tpu.chip.hbm_bytes,
        collectives={kind: found.count(kind) for kind in COLLECTIVES if kind in found},
        while_loops=len(cost.loops), dynamic_loops=cost.dynamic_loops, flops=cost.flops,
        bytes_accessed=cost.hbm_bytes, peak_flops=tpu.chip.peak_flops, hbm_bytes_per_s=tpu.chip.hbm_bytes_per_s)


def format_reports(reports: list[ProgramReport], tpu: TpuSlice) -> str:
    """Two tables, per program and chip: the compiler's memory against the chip's HBM and the
    collectives; the execution's flops and HBM bytes (loops times their trip counts) and its time
    at the roofline."""
    gb = lambda n: f"{n / 1e9:,.2f}"  # noqa: E731
    lines = [f"compiled by the TPU compiler for {tpu.accelerator_type} ({tpu.topology}: {tpu.chips} chips of "
             f"{gb(tpu.chip.hbm_bytes)} GB HBM; fits = within {1 - HBM_MARGIN:.0%} of it), per chip:",
             f"  {'program':<24} {'args GB':>9} {'temps GB':>9} {'outs GB':>8} {'total GB':>9}  fits  collectives"]
    for r in reports:
        collectives = ", ".join(f"{n} {kind}" for kind, n in r.collectives.items()) or "none"
        out = r.output_bytes - r.alias_bytes
        lines.append(f"  {r.name:<24} {gb(r.argument_bytes):>9} {gb(r.temp_bytes):>9} {gb(out):>8} "
                     f"{gb(r.per_chip_bytes):>9}  {'yes' if r.fits else 'NO':>4}  {collectives}")
    lines += [f"per execution and chip ({tpu.chip.peak_flops / 1e12:.0f} TFLOP/s, {tpu.chip.hbm_bytes_per_s / 1e9:,.0f} "
              "GB/s; matmul flops and HBM bytes with every loop's trip count; bytes/args: HBM bytes moved per "
              "argument byte):",
              f"  {'program':<24} {'GFLOP':>10} {'HBM GB':>8} {'bytes/args':>10} {'roofline ms':>12}  {'bound':<7} "
              f"{'MFU max':>7}"]
    for r in reports:
        note = f"  ({r.dynamic_loops} loop{'s' * (r.dynamic_loops > 1)} of data-dependent length counted once)" \
            if r.dynamic_loops else ""
        lines.append(f"  {r.name:<24} {r.flops / 1e9:>10,.1f} {gb(r.bytes_accessed):>8} {r.bytes_per_argument_byte:>10.2f} "
                     f"{1e3 * r.roofline_s:>12,.2f}  {r.bound:<7} {r.roofline_mfu:>7.0%}{note}")
    return "\n".join(lines)
