"""Shared by the benchmark scripts: machine description and results files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import jax

    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()]}


def write_results(name: str, results: dict, markdown: str) -> tuple[str, str]:
    """Write results/<name>.json and results/<name>.md with the command, machine and date."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    meta = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine()}
    json_path = os.path.join(RESULTS_DIR, f"{name}.json")
    md_path = os.path.join(RESULTS_DIR, f"{name}.md")
    with open(json_path + ".tmp", "w") as f:
        json.dump({**meta, **results}, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    m = meta["machine"]
    header = (f"Command: `{meta['command']}`  \nDate: {meta['date']}  \n"
              f"Machine: {m['cpu']}, {m['cores']} cores, JAX {m['jax']} ({m['jax_backend']})\n\n")
    with open(md_path + ".tmp", "w") as f:
        f.write(header + markdown)
    os.replace(md_path + ".tmp", md_path)
    return json_path, md_path
