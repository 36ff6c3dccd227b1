"""A griffe extension for the API reference (``mkdocs.yml``; ``make docs``): reads the source
statically, imports nothing (no torch).

* **Settings.** A dataclass field declared as ``Setting(kind, "help", ...).field(default)`` or
  ``SETTINGS["name"].field(default)`` (``simsd.config.fields``; :class:`EngineArgs`,
  :class:`SamplingParams`) gets its ``help`` as its docstring, its choices appended, and its
  default as its value, so the reference lists every field with the command line's ``--help``
  text from the one declaration instead of restating it.
* **Roles.** The docstrings are written with Sphinx roles (``:class:`~simsd.LLM```); Markdown
  has none, so each becomes a code span (the last component when the target starts with ``~``).
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const|py:\w+):`(~?)([^`]+)`")


def _role(m: re.Match) -> str:
    target = m.group(2)
    if m.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


@lru_cache(maxsize=None)
def _module(path: Path) -> tuple:
    """``(tree, {name: value node}, {name: (module path, name)})`` of a module: its top-level
    assignments and what it imports, by name."""
    tree = ast.parse(path.read_text())
    assigned, imported = {}, {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    assigned[t.id] = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            assigned[stmt.target.id] = stmt.value
        elif isinstance(stmt, ast.ImportFrom) and stmt.level:
            base = path.parent
            for _ in range(stmt.level - 1):
                base = base.parent
            target = base.joinpath(*(stmt.module or "").split("."))
            target = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
            for alias in stmt.names:
                imported[alias.asname or alias.name] = (target, alias.name)
    return tree, assigned, imported


def _lookup(path: Path, name: str, depth: int = 0):
    """``(module path, value node)`` of a top-level name, following relative imports; None if unknown."""
    if depth > 5 or not path.is_file():
        return None
    _, assigned, imported = _module(path)
    if name in assigned:
        return path, assigned[name]
    if name in imported:
        return _lookup(*imported[name], depth + 1)
    return None


def _const(path: Path, node):
    """The value of a constant expression (strings, their ``+``, tuples, names bound to them); None if not one."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _const(path, node.left), _const(path, node.right)
        return a + b if isinstance(a, str) and isinstance(b, str) else None
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_const(path, e) for e in node.elts]
        return None if any(i is None for i in items) else tuple(items)
    if isinstance(node, ast.Name):
        found = _lookup(path, node.id)
        return _const(*found) if found else None
    return None


def _setting(path: Path, node):
    """``(module path, Setting(...) call)`` a field's value declares: ``Setting(...).field(d)`` or
    ``NAME["key"].field(d)`` with ``NAME`` a dict literal of ``Setting(...)`` calls."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Setting":
        return path, node
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        found = _lookup(path, node.value.id)
        key = _const(path, node.slice)
        if found and isinstance(found[1], ast.Dict) and isinstance(key, str):
            for k, v in zip(found[1].keys, found[1].values):
                if k is not None and _const(found[0], k) == key:
                    return _setting(found[0], v)
    return None


def setting_doc(path: Path, value) -> tuple | None:
    """``(help text, default source)`` of a field declared through a ``Setting``; None otherwise."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "field"):
        return None
    found = _setting(path, value.func.value)
    if not found:
        return None
    where, call = found
    text = _const(where, call.args[1]) if len(call.args) > 1 else None
    if not isinstance(text, str):
        return None
    choices = next((_const(where, kw.value) for kw in call.keywords if kw.arg == "choices"), None)
    if choices:
        text += ". One of " + ", ".join(f"`{c}`" for c in choices) + "."
    default = ast.unparse(value.args[0]) if value.args else next(
        (ast.unparse(kw.value) for kw in value.keywords if kw.arg == "default"), "")
    return text, default


class SimsdDocs(griffe.Extension):
    def on_class_members(self, *, node, cls, **kwargs) -> None:
        if not isinstance(node, ast.ClassDef) or cls.filepath is None or isinstance(cls.filepath, list):
            return
        path = Path(cls.filepath)
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value):
                continue
            member = cls.members.get(stmt.target.id)
            doc = setting_doc(path, stmt.value)
            if member is None or member.is_alias or doc is None:
                continue
            text, default = doc
            member.docstring = griffe.Docstring(text, parent=member)
            member.value = default

    def on_package(self, *, pkg, **kwargs) -> None:
        seen = set()

        def walk(obj):
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(_role, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)
        walk(pkg)
