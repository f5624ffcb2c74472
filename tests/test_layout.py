"""The package layout: the top level holds the `python -m dspark_jax.<command>` entry points only,
each thin and cheap to import, every concern has its room, the rooms stand in one order and every
import points down it (docs/DESIGN.md section 6), and no module imports itself back."""

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
# The rooms, lowest first: a module may import its own room and the levels below its own, never a
# level above nor another room of its level (the entry points, above them all, import any room).
ROOM_LEVELS = (
    ("core",),  # errors, files, config checks, the command line's shared flags, the platform
    ("models",),  # the decoder, its kernels, sampling
    ("checkpoints", "distributed"),  # loading targets; meshes, shardings, processes
    ("drafters", "data"),  # drafter models and checkpoints; prompt sets, shards, the training pipeline
    ("engine",),  # plain and speculative decoding, schedulers, the offline runner
    ("evaluation",),  # eval, calibration (STS), reports and plots
    ("serving",),  # what-if serving simulation, hardware rooflines, TPU compile checks
    ("training",),  # datagen (a client of the engine), the trainer, its plan
)


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


def upward_imports(graph: dict[str, set[str]], levels=ROOM_LEVELS) -> list[str]:
    """Every import from a room into another room at its own level or above ("a -> b" lines)."""
    level = {room: k for k, rooms in enumerate(levels) for room in rooms}

    def room_of(module: str) -> str | None:  # dspark_jax.engine.offline -> engine; an entry point -> None
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in level else None

    return [f"{module} -> {dep}" for module, deps in sorted(graph.items()) if room_of(module)
            for dep in sorted(deps) if room_of(dep) not in (None, room_of(module))
            and level[room_of(dep)] >= level[room_of(module)]]


def test_every_module_lives_in_a_known_room():
    rooms = {room for level in ROOM_LEVELS for room in level}
    on_disk = {d for d in os.listdir(PACKAGE) if os.path.isfile(os.path.join(PACKAGE, d, "__init__.py"))}
    assert on_disk == rooms


def test_every_import_points_down():
    assert upward_imports(import_graph()) == []


def test_the_order_check_finds_an_upward_import():
    graph = {"dspark_jax.drafters.dspark": {"dspark_jax.models.sampling", "dspark_jax.engine.sampling"},
             "dspark_jax.data.datagen": {"dspark_jax.drafters.checkpoint"},  # same level, another room
             "dspark_jax.engine.offline": {"dspark_jax.engine.sampling", "dspark_jax.data.prompt_files"},
             "dspark_jax.decode": {"dspark_jax.training.trainer"}}  # an entry point imports any room
    assert upward_imports(graph) == ["dspark_jax.data.datagen -> dspark_jax.drafters.checkpoint",
                                     "dspark_jax.drafters.dspark -> dspark_jax.engine.sampling"]


def namespace_readers(path: str) -> list[str]:
    """Functions of a file that import argparse or read attributes of a parameter named like a parsed
    command line (`args`, `ns`, `namespace`, `opts` or annotated `argparse.Namespace`):
    "function(param.attr)" lines."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = [f"import argparse (line {node.lineno})" for node in ast.walk(tree)
             if isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
             or isinstance(node, ast.ImportFrom) and node.module == "argparse"]
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs
                  if a.arg in ("args", "ns", "namespace", "opts") or "Namespace" in ast.unparse(a.annotation or ast.Constant(""))}
        reads = sorted({f"{p.value.id}.{p.attr}" for p in ast.walk(fn) if isinstance(p, ast.Attribute)
                        and isinstance(p.value, ast.Name) and p.value.id in params})
        if reads:
            found.append(f"{getattr(fn, 'name', 'lambda')}({', '.join(reads[:3])})")
    return found


def test_settings_are_values_below_the_entry_points():
    """Entry points parse flags into settings dataclasses; below them nothing reads a namespace (core.cli,
    which builds the settings from the parsed flags, excepted)."""
    offenders = {name: found for name, path in modules().items()
                 if name.count(".") >= 2 and not name.startswith("dspark_jax.core.")
                 for found in [namespace_readers(path)] if found}
    assert offenders == {}


def test_the_namespace_check_finds_a_reader(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import argparse\n\ndef run(args, n):\n    return args.limit + n\n\n"
                      "def fine(args: tuple):\n    return args[0]\n")
    assert namespace_readers(str(source)) == ["import argparse (line 1)", "run(args.limit)"]
