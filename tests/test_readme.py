"""The README's two set-up commands exist, and CI runs exactly the README's test command."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_start_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_two_setup_commands_and_ci_runs_the_test_one():
    main, tests = quick_start_commands()
    assert main.startswith("python3 -m venv .venv") and "python -m dspark_jax.decode" in main
    assert tests.startswith("python3 -m venv .venv") and tests.endswith("python -m pytest")
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert tests in ci.splitlines()
