"""What a compiled program costs per execution, read from its optimized HLO with loop trip counts.

`compiled.cost_analysis()` counts the body of a while loop once. Our programs keep the layers, the
micro-batches and the attention's key chunks in loops, so its figures are a fraction of a step's
(a batch-1 Qwen3-8B decode step "accesses" 0.36 GB per chip where its weights alone are 2 GB).
`program_cost(hlo_text)` walks the program's computations instead, multiplying each loop body by
its trip count, and counts:

* matmul flops: every `dot` and `convolution` (the TPU compiler writes matmuls as convolutions),
  2 x output elements x the contracted elements that meet real input (padding excluded), in
  fused computations too. Elementwise work is left out: next to the matmuls it is noise.
* HBM bytes: per top-level op (a fusion, a copy, a collective...), the bytes of its operands and
  results that live in HBM (memory space 0: an array the compiler placed in on-chip memory, `S(n)`
  with n > 0, costs no HBM traffic), where a fusion operand that is only sliced counts the slice and
  an in-place update (`dynamic-update-slice`, `scatter`) counts the update, not the buffer.

A loop whose trip count the compiler recorded, or whose condition compares its counter with a
constant, runs that many times; any other loop
(a data-dependent bound: a run of plain steps that ends at a finished row, attention that visits
only the chunks the context holds) is counted once and listed in `dynamic_loops`, so a reader
knows which figures are per iteration.
"""

from __future__ import annotations

import dataclasses
import math
import re

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
          "c64": 8, "c128": 16}
# dtype[dims]{layout}: the layout (optional) may name a memory space S(n)
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # ops that update operand 0 in place: the update's operand
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "add-dependency", "copy-done", "slice-done", "all-gather-done",
               "all-reduce-done", "collective-permute-done", "send-done", "recv-done", "async-done",
               "async-update", "while", "conditional", "call"}


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    space: int  # memory space: 0 = HBM

    @property
    def bytes(self) -> float:
        return _BYTES[self.dtype] * math.prod(self.dims)

    @property
    def hbm_bytes(self) -> float:
        return self.bytes if self.space == 0 else 0.0


@dataclasses.dataclass
class Instruction:
    name: str
    arrays: list[Array]  # the result's arrays (a tuple's elements in order)
    opcode: str
    operands: list[str]
    attrs: str
    args: str  # the raw text between the opcode's parentheses: a parameter's number, a constant's value


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    flops: float  # matmul flops of one execution, loop bodies times their trip counts
    hbm_bytes: float  # HBM bytes read and written by one execution (see the module's doc)
    loops: tuple[int | None, ...]  # every while loop's trip count (None: data-dependent, counted once)

    @property
    def dynamic_loops(self) -> int:
        return sum(n is None for n in self.loops)


def _arrays(type_text: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(type_text):
        space = _SPACE.search(layout or "")
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), int(space[1]) if space else 0))
    return out


def _split_type(rest: str) -> tuple[str, str]:
    """'TYPE opcode(...)...' -> (TYPE, 'opcode(...)...'): the type ends at the first space outside
    brackets (a tuple type is parenthesised; layouts hold parentheses inside braces)."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def _call(text: str) -> tuple[str, list[str], str, str]:
    """'opcode(%a, %b), attrs' -> (opcode, [a, b], attrs, '%a, %b')."""
    opcode, _, rest = text.partition("(")
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return opcode.strip(), re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1:], rest[:end]


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """The module's computations (name -> instructions in order) and the entry's name."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header[1], [])
            if line.startswith("ENTRY "):
                entry = header[1]
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            type_text, rest = _split_type(m[2])
            opcode, operands, attrs, args = _call(rest)
            current.append(Instruction(m[1], _arrays(type_text), opcode, operands, attrs, args))
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _attr(attrs: str, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\{{[^{{}}]*\}}|[^,\s]+)", attrs)
    return m[1] if m else None


def _callees(attrs: str, key: str) -> list[str]:
    value = _attr(attrs, key)
    return re.findall(r"%([\w.\-]+)", value) if value else []


def _valid_pairs(out: int, window: int, size: int, pad_lo: int, stride: int, rhs_dilate: int, lhs_dilate: int) -> int:
    """(output position, window position) pairs of one spatial dimension that read a real input
    element (not padding, not a hole of lhs dilation)."""
    extent = (size - 1) * lhs_dilate + 1
    if lhs_dilate == 1:
        total = 0
        for j in range(window):
            shift = j * rhs_dilate - pad_lo  # input index = o * stride + shift, wanted in [0, extent)
            lo = max(0, -(-(-shift) // stride))
            hi = min(out - 1, (extent - 1 - shift) // stride)
            total += max(0, hi - lo + 1)
        return total
    return sum(1 for o in range(out) for j in range(window)
               if 0 <= (i := o * stride + j * rhs_dilate - pad_lo) < extent and i % lhs_dilate == 0)


def _conv_flops(ins: Instruction, types: dict[str, list[Array]]) -> float:
    lhs, rhs = types[ins.operands[0]][0], types[ins.operands[1]][0]
    labels = _attr(ins.attrs, "dim_labels")
    lhs_l, rest = labels.split("_", 1)
    rhs_l, out_l = rest.split("->")
    out = ins.arrays[0].dims
    spatial = [c for c in out_l if c.isdigit()]
    window = _attr(ins.attrs, "window") or "{}"
    field = lambda key, n, default: ([default] * n if not (m := re.search(rf"\b{key}=([\dx_]+)", window))  # noqa: E731
                                     else m[1].split("x"))
    n = len(spatial)
    sizes = [int(s) for s in field("size", n, 1)]
    pads = [int(p.split("_")[0]) for p in field("pad", n, "0_0")]
    strides = [int(s) for s in field("stride", n, 1)]
    lhs_dil = [int(s) for s in field("lhs_dilate", n, 1)]
    rhs_dil = [int(s) for s in field("rhs_dilate", n, 1)]
    pairs = 1
    for k, d in enumerate(spatial):
        pairs *= _valid_pairs(out[out_l.index(d)], sizes[k], lhs.dims[lhs_l.index(d)], pads[k], strides[k],
                              rhs_dil[k], lhs_dil[k])
    batch = out[out_l.index("b")]
    groups = int(_attr(ins.attrs, "batch_group_count") or 1)
    return 2.0 * batch * out[out_l.index("f")] * rhs.dims[rhs_l.index("i")] * pairs / groups


def _dot_flops(ins: Instruction, types: dict[str, list[Array]]) -> float:
    lhs = types[ins.operands[0]][0]
    contracting = _attr(ins.attrs, "lhs_contracting_dims") or "{}"
    k = math.prod(lhs.dims[int(i)] for i in re.findall(r"\d+", contracting))
    return 2.0 * math.prod(ins.arrays[0].dims) * k


class _Walker:
    def __init__(self, computations: dict[str, list[Instruction]]):
        self.computations = computations
        self.types = {c: {i.name: i.arrays for i in body} for c, body in computations.items()}
        self.loops: list[int | None] = []
        self._flops: dict[str, float] = {}

    # ---- flops: every matmul in a computation and what it calls, loops times their trip counts
    def flops(self, comp: str) -> float:
        if comp not in self._flops:
            total, types = 0.0, self.types[comp]
            for ins in self.computations[comp]:
                if ins.opcode == "convolution":
                    total += _conv_flops(ins, types)
                elif ins.opcode == "dot":
                    total += _dot_flops(ins, types)
                elif ins.opcode == "while":
                    trips = self.trip_count(ins) or 1
                    total += trips * sum(self.flops(c) for c in _callees(ins.attrs, "body"))
                elif ins.opcode == "conditional":
                    total += max((self.flops(c) for c in _callees(ins.attrs, "branch_computations")), default=0.0)
                else:
                    # a fusion's computation ("calls"), a call's ("to_apply"; a reduce's to_apply is no matmul)
                    called = _callees(ins.attrs, "to_apply" if ins.opcode == "call" else "calls")
                    total += sum(self.flops(c) for c in called)
            self._flops[comp] = total
        return self._flops[comp]

    # ---- trip counts
    def trip_count(self, loop: Instruction) -> int | None:
        """The compiler's known trip count where it records one (XLA:CPU and GPU do), else N where the
        condition is `counter < N` for a constant N (a scan or a static fori_loop counting from 0, as
        the TPU compiler leaves it), else None."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
        if known:
            return int(known[1])
        cond = _callees(loop.attrs, "condition")
        body = self.computations.get(cond[0], []) if cond else []
        by_name = {i.name: i for i in body}
        root = body[-1] if body else None
        if root is None or root.opcode != "compare" or _attr(root.attrs, "direction") != "LT":
            return None
        bound = by_name.get(root.operands[1])
        if bound is None or bound.opcode != "constant" or not re.fullmatch(r"-?\d+", bound.args.strip()):
            return None
        return int(bound.args)

    # ---- HBM bytes of the top-level ops
    def hbm_bytes(self, comp: str) -> float:
        total, types = 0.0, self.types[comp]
        for ins in self.computations[comp]:
            if ins.opcode == "while":
                trips = self.trip_count(ins)
                self.loops.append(trips)
                total += (trips or 1) * sum(self.hbm_bytes(c) for c in _callees(ins.attrs, "body"))
            elif ins.opcode == "conditional":
                total += max((self.hbm_bytes(c) for c in _callees(ins.attrs, "branch_computations")), default=0.0)
            elif ins.opcode == "call":
                total += sum(self.hbm_bytes(c) for c in _callees(ins.attrs, "to_apply"))
            elif ins.opcode not in _NO_TRAFFIC:
                total += self._op_bytes(ins, types)
        return total

    def _op_bytes(self, ins: Instruction, types: dict[str, list[Array]]) -> float:
        hbm = lambda name: sum(a.hbm_bytes for a in types.get(name, []))  # noqa: E731
        written = sum(a.hbm_bytes for a in ins.arrays)
        if ins.opcode == "fusion":
            callee = _callees(ins.attrs, "calls")[0]
            reads = sum(min(hbm(op), self._param_read(callee, k, hbm(op))) for k, op in enumerate(ins.operands))
            return reads + self._fusion_written(callee, ins)
        if ins.opcode in ("dynamic-slice", "slice", "gather"):
            return written + min(written, hbm(ins.operands[0]))  # the slice read (where its source is in HBM)
        if ins.opcode in _IN_PLACE:
            return 2 * hbm(ins.operands[_IN_PLACE[ins.opcode]])
        if ins.opcode in ("copy-start", "slice-start"):  # an asynchronous copy: its source and destination
            return hbm(ins.operands[0]) + (ins.arrays[0].hbm_bytes if ins.arrays else 0.0)
        return sum(hbm(op) for op in ins.operands) + written

    def _uses(self, comp: str, name: str) -> list[tuple[Instruction, int]]:
        return [(i, k) for i in self.computations[comp] for k, op in enumerate(i.operands) if op == name]

    def _param_read(self, comp: str, index: int, full: float, depth: int = 0) -> float:
        """Bytes a fused computation reads of its parameter `index` (full: the whole array's)."""
        param = next((i.name for i in self.computations[comp] if i.opcode == "parameter"
                      and i.args.strip() == str(index)), None)
        return full if param is None or depth > 8 else self._value_read(comp, param, full, depth)

    def _value_read(self, comp: str, name: str, full: float, depth: int) -> float:
        total = 0.0
        for user, k in self._uses(comp, name):
            if user.opcode in ("dynamic-slice", "slice", "gather") and k == 0:
                total += sum(a.bytes for a in user.arrays)
            elif user.opcode in _IN_PLACE and k == 0:
                continue  # written in place: the buffer is not read
            elif user.opcode in ("bitcast", "reshape"):
                total += self._value_read(comp, user.name, full, depth)
            elif user.opcode == "fusion":
                total += self._param_read(_callees(user.attrs, "calls")[0], k, full, depth + 1)
            else:
                return full
        return min(total, full)

    def _fusion_written(self, callee: str, ins: Instruction) -> float:
        """A fusion's HBM writes: an in-place update (a root dynamic-update-slice or scatter) writes its update."""
        body = self.computations[callee]
        by_name = {i.name: i for i in body}
        root = body[-1]
        roots = [by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
        total = 0.0
        for r, out in zip(roots, ins.arrays):
            while r.opcode == "bitcast" and r.operands[0] in by_name:
                r = by_name[r.operands[0]]
            if out.space != 0:
                continue
            total += (sum(a.bytes for a in self.types[callee].get(r.operands[_IN_PLACE[r.opcode]], []))
                      if r.opcode in _IN_PLACE else out.bytes)
        return total


def program_cost(hlo_text: str) -> ProgramCost:
    """Flops, HBM bytes and loops of one execution of the compiled program whose optimized HLO is
    `hlo_text` (`compiled.as_text()`)."""
    computations, entry = parse_module(hlo_text)
    walker = _Walker(computations)
    hbm = walker.hbm_bytes(entry)
    return ProgramCost(flops=walker.flops(entry), hbm_bytes=hbm, loops=tuple(walker.loops))
