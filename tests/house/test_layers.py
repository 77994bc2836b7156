"""The layer table of ``docs/design.md`` ("The house: layers") holds: every ep_comm module has one layer, and no
module imports a module of a higher layer (read with ``ast`` from ``ep_comm/**/*.py``, nothing imported).

In a row's package cell a dotted name (```ep_comm.errors```) is that module, a folder (```ep_comm/contract/```)
its package and every module under it.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from helpers.package_source import REPO, imports, modules

SECTION = "## The house: layers"
ROW = re.compile(r"^\| (\d+) \| (.+?) \|", re.MULTILINE)
KERNELS_HOST_IMPORT = "ep_comm.contract.protocol"  # the kernels' one host import, by layer 2's row


def table_rows(text: str) -> List[Tuple[int, List[str]]]:
    """``(layer, the package cell's backticked names)`` of each row of the layer table in ``text``."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else len(text)]
    return [(int(number), re.findall(r"`([^`]+)`", cell)) for number, cell in ROW.findall(section)]


@lru_cache(maxsize=None)
def layers() -> Tuple[Tuple[str, int], ...]:
    """``(entry, layer)`` of the table: a module name, or a package name ending in ``.`` (its modules; a folder
    without ``__init__.py``, ``ep_comm/kernels/``, is no module itself)."""
    rows = table_rows((REPO / "docs" / "design.md").read_text())
    return tuple((name.rstrip("/").replace("/", ".") + ("." if name.endswith("/") else ""), number)
                 for number, names in rows for name in names)


def layer_of(module: str) -> Optional[int]:
    """The layer of ``module``: its own row, else the row of the innermost listed package holding it."""
    exact = [number for entry, number in layers() if entry == module]
    held = sorted(((len(entry), number) for entry, number in layers()
                   if entry.endswith(".") and (module + ".").startswith(entry)), reverse=True)
    return exact[0] if exact else (held[0][1] if held else None)


def test_the_table_parses_into_its_layers():
    numbers = [number for _, number in layers()]
    assert numbers == sorted(numbers) and set(numbers) == set(range(1, max(numbers) + 1)), layers()


def test_every_entry_of_the_table_is_a_module_or_package():
    unknown = [entry for entry, _ in layers() if not any(module == entry or module.startswith(entry)
                                                         for module in modules())]
    assert not unknown, f"docs/design.md's layer table names modules that do not exist: {unknown}"


def test_every_module_has_a_layer():
    missing = [module for module in modules() if layer_of(module) is None]
    assert not missing, f"modules without a row in docs/design.md's layer table: {missing}"


def upward_imports() -> Dict[str, List[str]]:
    """``module (layer n) -> imported (layer m > n)`` for each import up a layer."""
    found: Dict[str, List[str]] = {}
    for module in modules():
        own = layer_of(module) or 0
        for imported in sorted(imports(module)):
            theirs = layer_of(imported) or 0
            if theirs > own:
                found.setdefault(f"{module} (layer {own})", []).append(f"{imported} (layer {theirs})")
    return found


def test_no_module_imports_a_higher_layer():
    assert not upward_imports(), f"imports up a layer of docs/design.md's table: {upward_imports()}"


def test_the_kernels_import_of_the_host_side_only_the_protocol_constants():
    host = {imported for module in modules() if layer_of(module) == layer_of("ep_comm.kernels.jit")
            for imported in imports(module) if layer_of(imported) != layer_of("ep_comm.kernels.jit")}
    assert host <= {KERNELS_HOST_IMPORT}, f"the kernels import host modules: {sorted(host)}"


def test_an_import_up_a_layer_is_found(monkeypatch):
    """A contract module importing the Buffer would be reported, with both layers."""
    real = imports
    monkeypatch.setitem(globals(), "imports", lambda module: real(module) | (
        {"ep_comm.buffer"} if module == "ep_comm.contract.checks" else set()))
    assert upward_imports() == {
        f"ep_comm.contract.checks (layer {layer_of('ep_comm.contract.checks')})":
            [f"ep_comm.buffer (layer {layer_of('ep_comm.buffer')})"]}
