"""Every reference the docs make resolves, so that they cannot drift from the code (issue 40).

Where: the docstrings of ``ep_comm/``, ``tests/``, ``examples/`` and ``tools/`` (modules, classes, functions), and
``README.md`` and ``docs/*.md``. What, and the rule for each:

- **Paths** of Python files under ``tests/``, ``tools/`` or ``examples/`` anywhere in the text: the file exists.
- **Fully qualified names** ``ep_comm.<module>.<name>`` anywhere in the text (strict): the longest prefix that
  is an ep_comm module is imported (``importlib``) and each further part is an attribute of the one before
  (``getattr``; on a class also an attribute its methods assign, ``self.x``). A module that cannot be imported
  here (it imports CuPy, nvshmem4py or ``cuda`` at its top) is read as source instead: the next part is a name it
  binds at its top and, for a class, the part after is one of the class's attributes.
- **Short names** in backticks (single or double), ``a.b`` (reasonable: such a name may be a variable's attribute):

  1. ``a`` is a class of ep_comm (``Buffer.dispatch``): ``b`` is an attribute of a class of that name;
  2. else ``a`` is the last part of an ep_comm module's name (``checks.routing_error``, ``transport.signals``):
     ``b`` is a name bound at the top of such a module, unless ``b`` is no function or class of ep_comm but an
     attribute of one of its classes (``a`` is then a variable: ``topology.num_ranks``);
  3. else, when ``a`` is a lower-case name and no module installed here nor one of ``FOREIGN`` (``request.y``;
     not ``numpy.bool_``, ``deep_ep.Buffer``, ``RawKernel.kernel``): ``b`` must not be a function or class defined
     at the top of an ep_comm module, whose reference names its module or class (the removed ``validate``
     module's ``routing_error`` written with a dot fails: no ep_comm module of that name holds it).

  Only the first two parts are checked; a name whose last part is a file suffix (``check.py``) is a file name.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Iterator, List, Optional, Set, Tuple

import pytest
from helpers.package_source import REPO, class_attributes, classes, modules, top_names, tree

SOURCE_DIRS = ("ep_comm", "tests", "examples", "tools")
GPU_PACKAGES = {"cupy", "cupy_backends", "nvshmem", "cuda"}  # not importable without the GPU stack
FOREIGN = {"deep_ep", "torch", "pplx_kernels", "cupy", "cupyx", "nvshmem", "cuda"}  # named, not installed here
FILE_SUFFIXES = {"py", "json", "csv", "toml", "md", "sh", "err", "txt", "cu", "ptx", "so"}
PATH = re.compile(r"(?<![\w./-])(?:tests|tools|examples)/(?:\w+/)*\w+\.py\b")
FULL = re.compile(r"(?<![\w./-])ep_comm(?:\.[A-Za-z_]\w*)+")
SHORT = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")


def docstrings(path: Path) -> Iterator[str]:
    """The docstrings of a Python file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                yield text


def documents() -> Iterator[Tuple[str, str]]:
    """``(where, text)`` of every docstring and Markdown page checked."""
    for folder in SOURCE_DIRS:
        for path in sorted((REPO / folder).rglob("*.py")):
            yield from ((str(path.relative_to(REPO)), text) for text in docstrings(path))
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        yield str(path.relative_to(REPO)), path.read_text()


@lru_cache(maxsize=None)
def importable(module: str) -> Optional[ModuleType]:
    """Module ``module`` imported, or None when it needs the GPU stack, which is not installed here."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if (exc.name or "").split(".")[0] in GPU_PACKAGES:
            return None
        raise


@lru_cache(maxsize=None)
def top_definitions() -> Set[str]:
    """The functions and classes defined at the top of the ep_comm modules."""
    return {node.name for name in modules() for node in tree(name).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@lru_cache(maxsize=None)
def all_class_attributes() -> Set[str]:
    """Every attribute of every ep_comm class."""
    return {attribute for name in classes() for attribute in class_attributes(name)}


def _by_source(module: str, rest: List[str]) -> Optional[str]:
    """Why ``rest`` does not resolve in ``module`` read as source, or None."""
    if rest[0] not in top_names(module):
        return f"{module} binds no {rest[0]!r}"
    if len(rest) > 1 and rest[0] in classes() and rest[1] not in class_attributes(rest[0]):
        return f"class {rest[0]} has no attribute {rest[1]!r}"
    return None


def _by_getattr(obj: object, rest: List[str]) -> Optional[str]:
    """Why ``rest`` is not an attribute chain of ``obj``, or None."""
    for part in rest:
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and part in class_attributes(obj.__name__):
            return None  # an attribute the class's methods assign: nothing further to follow
        else:
            return f"{getattr(obj, '__name__', obj)!s} has no attribute {part!r}"
    return None


def full_name_problem(name: str) -> Optional[str]:
    """Why fully qualified ``name`` (``ep_comm.<module>.<name>``) does not resolve, or None."""
    parts = name.split(".")
    cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules())
    module, rest = ".".join(parts[:cut]), parts[cut:]
    if not rest:
        return None
    loaded = importable(module)
    return _by_source(module, rest) if loaded is None else _by_getattr(loaded, rest)


def _module_like(first: str) -> bool:
    """Whether ``first`` reads as a module name that is none of another project's (rule 3)."""
    return first[0].islower() and first not in FOREIGN and importlib.util.find_spec(first) is None


def short_name_problem(name: str) -> Optional[str]:
    """Why short ``name`` (``a.b``) does not resolve by the rules of this module's docstring, or None."""
    first, second = name.split(".")[:2]
    homes = [m for m in modules() if m.rpartition(".")[2] == first]
    if first in classes():
        return None if second in class_attributes(first) else f"no class {first} has an attribute {second!r}"
    if homes:
        if any(second in top_names(home) for home in homes):
            return None
        if second not in top_definitions() and second in all_class_attributes():
            return None
        return f"{' / '.join(homes)} binds no {second!r}"
    if second in top_definitions() and _module_like(first):
        return f"{second!r} is ep_comm's, but {first!r} names no ep_comm module or class"
    return None


def reference_problems(where: str, text: str) -> Iterator[str]:
    """``where: reference: why`` for each reference of ``text`` that does not resolve."""
    for path in PATH.findall(text):
        if not (REPO / path).is_file():
            yield f"{where}: {path}: no such file"
    for name in set(FULL.findall(text)):
        problem = full_name_problem(name)
        if problem:
            yield f"{where}: {name}: {problem}"
    for name in set(SHORT.findall(text)):
        if name.split(".")[0] != "ep_comm" and name.rpartition(".")[2] not in FILE_SUFFIXES:
            problem = short_name_problem(name)
            if problem:
                yield f"{where}: {name}: {problem}"


def test_every_reference_resolves():
    problems = [problem for where, text in documents() for problem in reference_problems(where, text)]
    assert not problems, "references that do not resolve:\n" + "\n".join(problems)


@pytest.mark.parametrize("text, why", [
    ("``ep_comm.validate.routing_error``", "has no attribute 'validate'"),
    ("``ep_comm.contract.checks.routing_eror``", "has no attribute 'routing_eror'"),
    ("``ep_comm.backends.nvshmem.NvshmemBackend.no_such``", "no attribute 'no_such'"),
    ("``validate.routing_error``", "'validate' names no ep_comm module or class"),
    ("``checks.no_such_rule``", "binds no 'no_such_rule'"),
    ("``Buffer.no_such``", "no class Buffer has an attribute 'no_such'"),
    ("see tests/test_nvshmem_host.py", "no such file"),
])
def test_a_stale_reference_fails(text, why):
    problems = list(reference_problems("doc", text))
    assert len(problems) == 1 and why in problems[0], problems


@pytest.mark.parametrize("text", [
    "``ep_comm.contract.checks.routing_error``", "``ep_comm.TimeoutError``", "``Buffer.num_sms``",
    "``checks.routing_error``", "``transport.signals``", "``topology.num_ranks``", "``numpy.bool_``",
    "``ep_comm.backends.nvshmem``", "``check.py``", "tests/helpers/fake_gpu.py",
])
def test_a_live_reference_passes(text):
    assert not list(reference_problems("doc", text))
