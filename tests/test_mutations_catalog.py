"""The mutation catalogue (tests/mutations/mutations.json) still matches the code: each snippet it
mutates occurs exactly once where it says, and the tests it names exist. Running the mutations
themselves is `python tests/mutations/run.py` (not part of the default suite)."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "tests" / "mutations"


def load_runner():
    spec = importlib.util.spec_from_file_location("mutation_runner", FOLDER / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_once_and_names_existing_tests():
    entries = json.loads((FOLDER / "mutations.json").read_text())
    assert isinstance(entries, list) and entries
    for m in entries:
        assert set(m) >= {"name", "promise", "file", "old", "new", "tests"}, m
        source = ROOT / m["file"]
        assert source.is_file(), m["name"]
        assert source.read_text().count(m["old"]) == 1, f"{m['name']}: `old` must occur exactly once in {m['file']}"
        assert m["new"] != m["old"], m["name"]
        assert m["tests"], m["name"]
        for node in m["tests"]:
            assert node.startswith("tests/") and (ROOT / node.split("::", 1)[0]).is_file(), (m["name"], node)
    assert len({m["name"] for m in entries}) == len(entries)
    assert load_runner().problems(entries, ROOT) == []  # what `run.py --check` reports
