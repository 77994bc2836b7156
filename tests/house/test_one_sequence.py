"""Issue 51: each operation's steps on ``nvshmem`` are written once, in the general path's modules
(``backends/nvshmem/dispatch.py``, ``combine.py``), and the prepared path (``prepared.py``) runs them: it imports no
private name of theirs (a helper of a step order of its own) and nothing above the backends (no way back into
``Buffer``). Read with ``ast`` from the source, nothing imported."""
from __future__ import annotations

import ast

from helpers.package_source import tree

PREPARED = "ep_comm.backends.nvshmem.prepared"


def _imported_names(module: str) -> list:
    """``(module imported from, name)`` of every ``from ... import`` at any depth of ``module``."""
    return [(node.module or "", alias.name) for node in ast.walk(tree(module)) if isinstance(node, ast.ImportFrom)
            for alias in node.names]


def test_the_prepared_path_imports_no_private_name_of_the_general_path():
    private = [f"{source}.{name}" for source, name in _imported_names(PREPARED)
               if source.startswith("ep_comm.backends.nvshmem.") and name.startswith("_")]
    assert not private, f"{PREPARED} imports {private}: the general path's steps are public to it, their helpers not"


def test_the_prepared_path_imports_nothing_above_the_backends():
    above = [source for source, _ in _imported_names(PREPARED) if source in ("ep_comm.buffer", "ep_comm")]
    assert not above, f"{PREPARED} imports {above}: the Buffer tells it what to learn, it never calls back"
