"""The package layout: the top level holds the `python -m dspark_jax.<command>` entry points only,
each thin and cheap to import, every concern has its room, and no module imports itself back."""

import ast
import os
import subprocess
import sys
import tomllib

import pytest

import dspark_jax

PACKAGE = os.path.dirname(dspark_jax.__file__)
ROOT = os.path.dirname(PACKAGE)
ENTRY_POINT_MAX_LINES = 200  # parse, call, print: anything longer has library logic in it


def modules() -> dict[str, str]:
    """Every module of the package: dotted name -> path."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                found[name.removesuffix(".__init__")] = path
    return found


def imports(path: str, known: dict[str, str]) -> set[str]:
    """The package modules a file imports anywhere (deferred imports inside functions included)."""
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dspark_jax"):
            out |= {node.module} & set(known)
            out |= {f"{node.module}.{a.name}" for a in node.names} & set(known)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    # a package's own __init__ is not an edge: importing a.b always runs a/__init__ first
    return {m: {d for d in imports(p, known) if d != m and not m.startswith(d + ".")} for m, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def top_level_modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py")


def console_scripts() -> dict[str, str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_top_level_holds_only_entry_points():
    scripts = {target.split(":")[0].split(".")[-1] for target in console_scripts().values()}
    assert set(top_level_modules()) == scripts  # every module a command, every command a module
    for name in top_level_modules():
        source = open(os.path.join(PACKAGE, f"{name}.py"), encoding="utf-8").read()
        assert "\ndef main(" in source and '\nif __name__ == "__main__":' in source, name
        assert source.count("\n") <= ENTRY_POINT_MAX_LINES, f"{name}.py is not thin (move its logic into a room)"


def test_entry_points_import_no_other_entry_point():
    graph, entry = import_graph(), {f"dspark_jax.{m}" for m in top_level_modules()}
    for name in entry:
        assert not graph[name] & entry, f"{name} imports {graph[name] & entry}: shared code belongs in a room"


@pytest.mark.parametrize("command", top_level_modules())
def test_importing_a_command_is_cheap(command):
    """`--help` and a bad flag answer at once: no command imports JAX before it parses."""
    code = (f"import sys, dspark_jax.{command}; heavy = [m for m in ('jax', 'tokenizers', 'matplotlib', 'grain', "
            f"'orbax') if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing dspark_jax.{command} loads {out}"
