"""The ep_comm package read as source (``ast``, nothing imported): its modules, the names each binds at its top,
the attributes of its classes and the ep_comm modules each imports. Shared by the tests that check the docs'
references (``test_references``) and the layer table (``test_layers``) against the code."""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "ep_comm"


def module_name(path: Path) -> str:
    """``ep_comm.contract.checks`` of ``REPO/ep_comm/contract/checks.py`` (a package: its ``__init__``)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@lru_cache(maxsize=None)
def modules() -> Dict[str, Path]:
    """Every module of ep_comm: dotted name -> file."""
    return {module_name(path): path for path in sorted((REPO / PACKAGE).rglob("*.py"))}


@lru_cache(maxsize=None)
def tree(name: str) -> ast.Module:
    """The parsed source of module ``name``."""
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _bound_by(statement: ast.stmt) -> Iterator[str]:
    """The names one top-level statement binds (definitions, assignments, imports)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield statement.name
    elif isinstance(statement, (ast.Import, ast.ImportFrom)):
        yield from ((alias.asname or alias.name).split(".")[0] for alias in statement.names)
    elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        yield from (node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name))
    elif isinstance(statement, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, optional imports
        for inner in statement.body + getattr(statement, "orelse", []):
            yield from _bound_by(inner)


@lru_cache(maxsize=None)
def top_names(name: str) -> Set[str]:
    """The names module ``name`` binds at its top, and for a package its submodules."""
    names = {bound for statement in tree(name).body for bound in _bound_by(statement)}
    return names | {sub[len(name) + 1:] for sub in modules() if sub.rpartition(".")[0] == name}


@lru_cache(maxsize=None)
def classes() -> Dict[str, List[Tuple[str, ast.ClassDef]]]:
    """Every top-level class of ep_comm: class name -> ``(module, definition)`` of each class of that name."""
    found: Dict[str, List[Tuple[str, ast.ClassDef]]] = {}
    for name in modules():
        for statement in tree(name).body:
            if isinstance(statement, ast.ClassDef):
                found.setdefault(statement.name, []).append((name, statement))
    return found


def _self_attributes(method: ast.AST) -> Iterator[str]:
    """The ``self.x`` a method assigns."""
    for node in ast.walk(method):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                yield target.attr


def _base_names(definition: ast.ClassDef) -> Iterator[str]:
    """The names of a class's bases (``a.B`` -> ``B``)."""
    for base in definition.bases:
        if isinstance(base, ast.Subscript):  # Generic[T], NamedTuple-like subscripts
            base = base.value
        if isinstance(base, (ast.Name, ast.Attribute)):
            yield base.id if isinstance(base, ast.Name) else base.attr


def class_attributes(class_name: str, seen: Tuple[str, ...] = ()) -> Set[str]:
    """The attributes the ep_comm classes named ``class_name`` define: their body's names, the ``self.x`` their
    methods assign, and those of their ep_comm bases."""
    names: Set[str] = set()
    for _, definition in classes().get(class_name, []):
        names |= {bound for statement in definition.body for bound in _bound_by(statement)}
        names |= set(_self_attributes(definition))
        for base in _base_names(definition):
            if base not in seen:
                names |= class_attributes(base, seen + (class_name,))
    return names


def _absolute(name: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in module ``name`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if modules()[name].name == "__init__.py" else name.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(name: str) -> Set[str]:
    """The ep_comm modules module ``name`` imports anywhere in its source (``from a import b``: ``a.b`` where
    that is a module, else ``a``)."""
    found: Set[str] = set()
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(name, node)
            found |= {f"{source}.{a.name}" if f"{source}.{a.name}" in modules() else source for a in node.names}
    return {module for module in found if module == PACKAGE or module.startswith(PACKAGE + ".")}
