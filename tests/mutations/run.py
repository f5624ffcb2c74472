"""Mutation check of the project's core promises (stdlib only).

Each entry of mutations.json (next to this file) replaces one snippet (`old`, which must occur exactly
once in `file`) by a plausible bug (`new`) and names the tests that must catch it. This script copies
the repository (tracked + untracked-not-ignored files, `git ls-files -co --exclude-standard`) into a
scratch folder once, then for each mutation: applies it, runs
`python -m pytest -x -q -p no:cacheprovider -n 0 <tests>` there (the package imported from the scratch
copy), restores the file and classifies the result:

  caught    pytest exit code 1 (a test failed)
  SURVIVED  pytest exit code 0 (every test passed with the bug in place)
  error     any other exit code (collection/import error, no tests, ...) or a timeout
  stale     `old` no longer occurs exactly once in `file` (the catalogue needs updating)

Exit status 0 only if every mutation was caught.

  python tests/mutations/run.py                     # every mutation
  python tests/mutations/run.py --only a,b          # some of them
  python tests/mutations/run.py --list              # names, files and tests
  python tests/mutations/run.py --check             # only check the catalogue (no tests run)
  python tests/mutations/run.py --baseline --only a # the tests unmutated (they must pass)
  python tests/mutations/run.py --jobs 2            # two scratch copies, two mutations at a time
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CATALOG = HERE / "mutations.json"
FIELDS = ("name", "promise", "file", "old", "new", "tests")


def load(path: Path = CATALOG) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def test_file(node: str) -> str:
    return node.split("::", 1)[0]


def problems(entries: list[dict], root: Path = REPO) -> list[str]:
    """Everything wrong with the catalogue against the tree at `root` (empty: all good)."""
    out, names = [], set()
    for i, m in enumerate(entries):
        label = m.get("name", f"entry {i}") if isinstance(m, dict) else f"entry {i}"
        if not isinstance(m, dict):
            out.append(f"{label}: not an object")
            continue
        missing = [k for k in FIELDS if k not in m]
        if missing:
            out.append(f"{label}: missing fields {missing}")
            continue
        if not all(isinstance(m[k], str) and m[k] for k in FIELDS[:5]):
            out.append(f"{label}: name, promise, file, old and new must be non-empty strings")
            continue
        if m["name"] in names:
            out.append(f"{label}: duplicate name")
        names.add(m["name"])
        if m["new"] == m["old"]:
            out.append(f"{label}: new == old")
        path = root / m["file"]
        if not path.is_file():
            out.append(f"{label}: file {m['file']} not found")
        else:
            count = path.read_text().count(m["old"])
            if count != 1:
                out.append(f"{label}: stale: `old` occurs {count} times in {m['file']} (expected once)")
        tests = m["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
            out.append(f"{label}: tests must be a non-empty list of strings")
            continue
        for node in tests:
            file = root / test_file(node)
            if not (test_file(node).startswith("tests/") and file.is_file()):
                out.append(f"{label}: test file {test_file(node)} not found under tests/")
                continue
            if "::" in node:  # the test function (before any [params]) must still exist
                func = node.split("::")[-1].split("[", 1)[0]
                if not re.search(rf"^\s*(async\s+)?def {re.escape(func)}\(", file.read_text(), re.M):
                    out.append(f"{label}: no test function {func} in {test_file(node)}")
    return out


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def make_scratch(root: Path, files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def clean_extras(dest: Path, manifest: set[str]) -> None:
    """Remove what a test run left in the scratch tree (caches, outputs), keeping the copied files."""
    for dirpath, dirnames, filenames in os.walk(dest, topdown=False):
        d = Path(dirpath)
        for name in filenames:
            rel = (d / name).relative_to(dest).as_posix()
            if rel not in manifest:
                (d / name).unlink(missing_ok=True)
        for name in dirnames:
            sub = d / name
            if sub.is_symlink():
                sub.unlink()
            elif sub.is_dir() and not any(sub.iterdir()):
                sub.rmdir()


def environment(scratch: Path, kernel_cache: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutated module outlives its mutation
    env["DSPARK_KERNEL_CACHE"] = str(kernel_cache)  # mutated C++ kernels stay out of ~/.cache
    return env


def imported_from(scratch: Path, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", "import dspark_jax; print(dspark_jax.__file__)"], cwd=scratch, env=env,
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"cannot import dspark_jax in the scratch copy:\n{out.stderr[-2000:]}")
    return out.stdout.strip()


def run_tests(scratch: Path, env: dict, tests: list[str], timeout: float) -> tuple[int | None, str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", *tests]
    try:
        out = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, text + f"\n[timed out after {timeout:.0f} s]"
    return out.returncode, out.stdout + out.stderr


def reason(output: str) -> str:
    """pytest's first FAILED / ERROR summary line (what caught the mutation), shortened."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line if len(line) <= 110 else line[:107] + "..."
    return ""


def verdict(code: int | None, baseline: bool) -> str:
    if baseline:
        return "ok" if code == 0 else ("FAILED" if code == 1 else "error")
    return {0: "SURVIVED", 1: "caught"}.get(code, "error")


def mutate_and_run(m: dict, scratch: Path, env: dict, manifest: set[str], timeout: float, baseline: bool):
    path = scratch / m["file"]
    original = path.read_bytes()
    text = original.decode()
    if text.count(m["old"]) != 1:
        return "stale", 0.0, f"`old` occurs {text.count(m['old'])} times in {m['file']}"
    t0 = time.monotonic()
    try:
        if not baseline:
            path.write_text(text.replace(m["old"], m["new"], 1))
        code, output = run_tests(scratch, env, m["tests"], timeout)
    finally:
        path.write_bytes(original)
        clean_extras(scratch, manifest)
    return verdict(code, baseline), time.monotonic() - t0, output


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutation names")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--check", action="store_true", help="only check the catalogue against the tree (no tests)")
    p.add_argument("--baseline", action="store_true", help="run the tests WITHOUT mutating (they must all pass)")
    p.add_argument("--jobs", type=int, default=1, help="mutations run at a time (one scratch copy each)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per mutation's pytest run")
    p.add_argument("--verbose", action="store_true", help="print pytest's output tail for every non-caught result")
    p.add_argument("--catalog", default=str(CATALOG), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    entries = load(Path(args.catalog))
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {m.get("name") for m in entries})
        if unknown:
            print(f"unknown mutation names: {', '.join(unknown)}", file=sys.stderr)
            return 2
        entries = [m for m in entries if m.get("name") in wanted]
    if args.list:
        for m in entries:
            print(f"{m['name']}: {m['file']} -> {' '.join(m['tests'])}")
        return 0
    bad = problems(entries)
    if args.check:
        for line in bad:
            print(line)
        print(f"{len(entries)} mutations, {len(bad)} problems")
        return 1 if bad else 0
    broken = {line.split(":", 1)[0] for line in bad if ": stale:" not in line}
    if broken:  # stale entries are reported per mutation below; malformed ones stop the run
        for line in bad:
            print(line, file=sys.stderr)
        return 2

    files = tracked_files(REPO)
    manifest = set(files)
    jobs = max(1, min(args.jobs, len(entries)))
    work = Path(tempfile.mkdtemp(prefix="dspark-mutations-"))
    try:
        kernel_cache = work / "kernel-cache"
        copies = queue.Queue()
        for j in range(jobs):
            scratch = work / f"tree{j}"
            make_scratch(REPO, files, scratch)
            env = environment(scratch, kernel_cache)
            if j == 0:
                where = imported_from(scratch, env)
                print(f"dspark_jax imported from {where}")
                if not Path(where).resolve().is_relative_to(scratch.resolve()):
                    print(f"error: the package is not imported from the scratch copy {scratch}", file=sys.stderr)
                    return 2
            copies.put((scratch, env))
        print(f"{len(files)} files copied to {work} ({jobs} cop{'y' if jobs == 1 else 'ies'}); "
              f"{'baseline (unmutated)' if args.baseline else 'mutations'}: {len(entries)}", flush=True)

        results: dict[str, tuple[str, float]] = {}
        lock = threading.Lock()

        def one(m):
            scratch, env = copies.get()
            try:
                v, secs, output = mutate_and_run(m, scratch, env, manifest, args.timeout, args.baseline)
            finally:
                copies.put((scratch, env))
            with lock:
                results[m["name"]] = (v, secs)
                why = reason(output)
                if not why and v in ("stale", "error"):
                    why = (output.strip().splitlines() or [""])[-1][:110]
                print(f"{m['name']:<48} {v:<9} {secs:7.1f} s  {why}".rstrip(), flush=True)
                if args.verbose and v not in ("caught", "ok"):
                    tail = "\n".join(output.strip().splitlines()[-15:])
                    print("    " + tail.replace("\n", "\n    "), flush=True)

        if jobs == 1:
            for m in entries:
                one(m)
        else:
            pending = queue.Queue()
            for m in entries:
                pending.put(m)

            def worker():
                while True:
                    try:
                        m = pending.get_nowait()
                    except queue.Empty:
                        return
                    one(m)

            threads = [threading.Thread(target=worker) for _ in range(jobs)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    counts = {}
    for v, _ in results.values():
        counts[v] = counts.get(v, 0) + 1
    if args.baseline:
        print(f"{counts.get('ok', 0)} ok, {counts.get('FAILED', 0)} failed"
              + "".join(f", {counts[k]} {k}" for k in ("error", "stale") if counts.get(k)))
        return 0 if counts.get("ok", 0) == len(entries) else 1
    print(f"{counts.get('caught', 0)} caught, {counts.get('SURVIVED', 0)} survived"
          + "".join(f", {counts[k]} {k}" for k in ("error", "stale") if counts.get(k)))
    return 0 if counts.get("caught", 0) == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
