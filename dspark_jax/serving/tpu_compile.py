"""The TPU compiler's verdict on a program, on any machine: compiled for a Cloud TPU slice from shapes.

With libtpu installed (`pip install 'jax[tpu]==<jax's version>'`), `jax.experimental.topologies`
describes a slice's chips without any being present; a program jitted with shardings over those
devices and lowered from `ShapeDtypeStruct`s compiles with the TPU compiler on this CPU. Its
`memory_analysis()` is what one chip needs (arguments, outputs, temporaries, generated code, less
what outputs reuse of donated arguments), its text names the collectives the partitioner inserted,
and `cost_analysis()` its flops and bytes (a while loop's body counted once, so with the layers or
the micro-batches in a scan these are a fraction of the program's: `while_loops` says whether). The
program must be traced with the TPU's choices (`core.platform.tracing_for("tpu")`), not this CPU
process's.

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
    # Without these libtpu looks for the TPU VM's metadata server and prints warnings on stderr.
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                        ("TPU_ACCELERATOR_TYPE", tpu.accelerator_type)):
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
    hbm_bytes: float
    collectives: dict  # kind -> count in the compiled program's text
    while_loops: int  # scans left as loops: cost_analysis counts each body once
    flops: float  # cost_analysis, bodies of while loops once
    bytes_accessed: float

    @property
    def per_chip_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes

    @property
    def fits(self) -> bool:
        """Within the chip's HBM less HBM_MARGIN."""
        return self.per_chip_bytes <= (1 - HBM_MARGIN) * self.hbm_bytes

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "per_chip_bytes": self.per_chip_bytes, "fits": self.fits}


def program_report(name: str, compiled, tpu: TpuSlice) -> ProgramReport:
    """The per-chip figures of a program compiled for `tpu`'s devices."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    found = _COLLECTIVE.findall(text)
    return ProgramReport(
        name=name, argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes), hbm_bytes=tpu.chip.hbm_bytes,
        collectives={kind: found.count(kind) for kind in COLLECTIVES if kind in found},
        while_loops=text.count(" while("),
        flops=float(cost.get("flops", 0.0)), bytes_accessed=float(cost.get("bytes accessed", 0.0)))


def format_reports(reports: list[ProgramReport], tpu: TpuSlice) -> str:
    """A table: per program and chip, the compiler's memory against the chip's HBM, and its collectives."""
    gb = lambda n: f"{n / 1e9:,.2f}"  # noqa: E731
    lines = [f"compiled by the TPU compiler for {tpu.accelerator_type} ({tpu.topology}: {tpu.chips} chips of "
             f"{gb(tpu.chip.hbm_bytes)} GB HBM; fits = within {1 - HBM_MARGIN:.0%} of it), per chip:",
             f"  {'program':<24} {'args GB':>9} {'temps GB':>9} {'outs GB':>8} {'total GB':>9}  fits  collectives"]
    for r in reports:
        collectives = ", ".join(f"{n} {kind}" for kind, n in r.collectives.items()) or "none"
        out = r.output_bytes - r.alias_bytes
        lines.append(f"  {r.name:<24} {gb(r.argument_bytes):>9} {gb(r.temp_bytes):>9} {gb(out):>8} "
                     f"{gb(r.per_chip_bytes):>9}  {'yes' if r.fits else 'NO':>4}  {collectives}")
    return "\n".join(lines)
