"""The package layout: imports only go downwards through the rooms, and never in a circle.

Read from the source (every ``import`` statement, module-level or inside a function), so a lazy
import that goes upwards is caught too. The order, lowest first::

    triton_ops < simsd_kernels < simsd.config < simsd.assets < simsd.models < simsd.engine < simsd.decoding
               < simsd.speculative < simsd.entrypoints < simsd.testing

``simsd/__init__.py`` (the public re-exports) and ``simsd/__main__.py`` (``python -m simsd``)
sit above every room.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ["triton_ops", "simsd_kernels", "simsd.config", "simsd.assets", "simsd.models", "simsd.engine",
         "simsd.decoding", "simsd.speculative", "simsd.entrypoints", "simsd.testing"]
PACKAGES = ("simsd", "simsd_kernels", "triton_ops")
ROOT_MODULES = ("simsd", "simsd.__main__")  # above every room


def module_files() -> dict:
    """``{dotted module name: path}`` of every Python module of the three packages."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set) -> set:
    """Modules of the project that ``name`` imports anywhere in its source (relative imports
    resolved; ``from pkg import sub`` counts ``pkg.sub`` when it is a module)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` names the deepest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def room(module: str) -> str | None:
    """The room of a module (the longest entry of ORDER that contains it); None for ``simsd``."""
    rooms = [r for r in ORDER if module == r or module.startswith(r + ".")]
    return max(rooms, key=len) if rooms else None


@pytest.fixture(scope="module")
def graph() -> dict:
    files = module_files()
    known = set(files)
    return {m: imported_modules(m, p, known) for m, p in files.items()}


def test_every_module_has_a_room(graph):
    homeless = [m for m in graph if m not in ROOT_MODULES and room(m) is None]
    assert not homeless, f"modules outside the rooms {ORDER}: {homeless}"


def test_imports_go_downwards(graph):
    upwards = []
    for mod, deps in graph.items():
        r = room(mod)
        if r is None:  # the package root re-exports from every room
            continue
        for dep in deps:
            d = room(dep)
            if d is None or (d != r and ORDER.index(d) > ORDER.index(r)):
                upwards.append(f"{mod} ({r}) imports {dep} ({d or 'the simsd root'})")
    assert not upwards, "imports that go upwards:\n" + "\n".join(upwards)


def find_cycles(graph: dict) -> list:
    """Import cycles of ``graph`` (depth-first search for back edges), as ``a -> b -> a`` strings."""
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d == "simsd":  # the root's re-exports are not a dependency of the rooms
                continue
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_upward_and_circular_imports(tmp_path):
    """The rules above can fail: an upward lazy import and a two-module circle are found."""
    pkg = tmp_path / "simsd" / "models"
    pkg.mkdir(parents=True)
    (tmp_path / "simsd" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from ..speculative.decoder import SpecConfig\nfrom .b import x\n")
    (pkg / "b.py").write_text("from .a import f\nx = 1\n")
    known = {"simsd", "simsd.models", "simsd.models.a", "simsd.models.b", "simsd.speculative",
             "simsd.speculative.decoder"}
    deps = imported_modules("simsd.models.a", pkg / "a.py", known)
    assert deps == {"simsd.speculative.decoder", "simsd.models.b"}
    assert ORDER.index(room("simsd.speculative.decoder")) > ORDER.index(room("simsd.models.a"))
    graph = {m: imported_modules(m, pkg / (m.rpartition(".")[2] + ".py"), known) for m in ("simsd.models.a",
                                                                                         "simsd.models.b")}
    assert find_cycles(graph) == ["simsd.models.a -> simsd.models.b -> simsd.models.a"]


@pytest.mark.parametrize("package", ["simsd", "simsd.decoding"])
def test_lazy_reexports_resolve(package):
    """The re-exports load on first use (PEP 562, so option checks run before torch loads): each
    name of ``__all__`` is its module's object, ``from ... import *`` takes them all, and a
    missing name is an ``AttributeError``."""
    import importlib
    pkg = importlib.import_module(package)
    assert pkg.__all__ == list(pkg.EXPORTS)
    for name, module in pkg.EXPORTS.items():
        assert getattr(pkg, name) is getattr(importlib.import_module(f"{package}.{module}"), name), name
    space = {}
    exec(f"from {package} import *", space)
    assert set(pkg.__all__) <= set(space)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        pkg.nope  # noqa: B018


#: the longest file an entry point may be (issue 35: the entry points are thin surfaces)
ENTRYPOINT_MAX_LINES = 400


def test_the_entry_points_are_thin_surfaces():
    """No file of ``simsd/entrypoints/`` (the command line, the API, the server) is over
    :data:`ENTRYPOINT_MAX_LINES` lines: what is longer holds rules that belong to a room below."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "simsd" / "entrypoints").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > ENTRYPOINT_MAX_LINES}
    assert not long, long
