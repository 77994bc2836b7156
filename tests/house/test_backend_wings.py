"""The two backends are wings of ``ep_comm/backends/``: ``backends/mpi/`` and ``backends/nvshmem/`` never import each
other, and the modules both share (``backends/*.py``) import neither. The package itself (``ep_comm.backends``,
``make_backend``) is where a Buffer's backend is chosen, so it alone imports both (read with ``ast`` from the source,
nothing imported; docs/design.md, "The house: layers", row 6)."""
from __future__ import annotations

from typing import Callable, Dict, List, Set

from helpers.package_source import imports, modules

BACKENDS = "ep_comm.backends"
WINGS = (f"{BACKENDS}.mpi", f"{BACKENDS}.nvshmem")


def wing_of(module: str) -> str:
    """The wing holding ``module`` (``ep_comm.backends.mpi`` ...), ``"shared"`` for the other modules of
    ``ep_comm/backends/``, ``""`` outside it."""
    held = [wing for wing in WINGS if module == wing or module.startswith(wing + ".")]
    if held:
        return held[0]
    return "shared" if module.startswith(BACKENDS + ".") else ""


def wing_imports(imports_of: Callable[[str], Set[str]] = imports) -> Dict[str, List[str]]:
    """``module -> the modules of another wing it imports`` (``imports_of(module)``), for the wings and the shared
    modules."""
    found: Dict[str, List[str]] = {}
    for module in modules():
        own = wing_of(module)
        if not own:
            continue
        crossing = sorted(imported for imported in imports_of(module)
                          if wing_of(imported) in WINGS and wing_of(imported) != own)
        if crossing:
            found[module] = crossing
    return found


def test_both_wings_exist_with_their_backend_class():
    for wing, cls in zip(WINGS, ("MpiBackend", "NvshmemBackend")):
        assert f"{wing}.backend" in modules(), f"{wing}.backend is missing"
        assert f"{wing}.backend" in imports(wing), f"{wing} does not export {cls} from its backend module"


def test_no_wing_imports_the_other_and_the_shared_modules_import_neither():
    assert not wing_imports(), f"imports across the backends' wings: {wing_imports()}"


def test_the_package_chooses_between_the_wings():
    assert set(WINGS) <= {wing_of(m) for m in imports(BACKENDS)}, imports(BACKENDS)


def test_the_rule_catches_a_crossing():
    """The check itself: a shared module that imported a wing would be reported."""
    crossing = f"{BACKENDS}.nvshmem.steps"
    planted = lambda name: imports(name) | ({crossing} if name == f"{BACKENDS}.profile" else set())  # noqa: E731
    assert wing_imports(planted) == {f"{BACKENDS}.profile": [crossing]}
