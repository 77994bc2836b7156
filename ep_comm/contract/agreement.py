"""The construction check: every rank's Buffer arguments agree, or every rank raises before anything is allocated.

``Buffer`` validates its own arguments locally, then makes one small collective call, :func:`agree`,
the first it makes on ``comm``: an allgather of ``(error, fields)`` from every rank. A rank whose own
arguments are invalid still takes part (with its error and no fields), so its peers do not wait for
it: they raise ``ValueError`` naming it, and it raises its own error. Otherwise every field
(:data:`FIELDS`) must be equal on every rank; where one is not, every rank raises the same
``ValueError`` naming the field and which ranks passed which value. The check is bounded as long as
every rank constructs the Buffer (the contract: construction is collective).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from mpi4py import MPI

from ep_comm._version import __version__

# what must agree: the geometry, the payload dtype, the backend resolved, and the choices as given
FIELDS = ("num_experts", "hidden", "num_topk", "num_max_tokens_per_rank", "dtype", "backend", "transport",
          "scaleup_ranks", "forwarding", "deterministic", "num_sms", "version")


def construction_fields(*, num_experts: int, hidden: int, num_topk: int, num_max_tokens_per_rank: int, dtype: str,
                        backend: str, transport: str, scaleup_ranks: Optional[int], forwarding: bool,
                        deterministic: bool, num_sms: Optional[int]) -> Dict[str, Any]:
    """The :data:`FIELDS` of one rank's (validated) arguments, with this rank's ep_comm version.

    Args:
        num_experts, hidden, num_topk, num_max_tokens_per_rank: the geometry (ints).
        dtype: the payload dtype's name; backend: the backend resolved (``"mpi"``/``"nvshmem"``).
        transport, scaleup_ranks, forwarding, deterministic, num_sms: as given to ``Buffer``.

    Returns:
        ``{field: value}`` in :data:`FIELDS` order, plain Python values.
    """
    return dict(num_experts=int(num_experts), hidden=int(hidden), num_topk=int(num_topk),
                num_max_tokens_per_rank=int(num_max_tokens_per_rank), dtype=str(dtype), backend=str(backend),
                transport=str(transport),
                scaleup_ranks=None if scaleup_ranks is None else int(scaleup_ranks), forwarding=bool(forwarding),
                deterministic=bool(deterministic),
                num_sms=None if num_sms is None else int(num_sms), version=__version__)


def agree(comm: MPI.Comm, fields: Optional[Dict[str, Any]], error: Optional[Exception]) -> None:
    """Collective over ``comm``: raise on every rank unless every rank's arguments are valid and equal.

    Args:
        comm: the Buffer's communicator (a valid intra-communicator).
        fields: this rank's :func:`construction_fields`, or None when its arguments are invalid.
        error: the exception this rank's own validation raised, or None.

    Raises:
        The rank's own ``error`` on a rank with invalid arguments; ``ValueError`` on the other ranks
        naming those ranks and their errors; ``ValueError`` on every rank naming each field that
        differs, the ranks and their values.
    """
    gathered = comm.allgather((None if error is None else f"{type(error).__name__}: {error}", fields))
    if error is not None:
        raise error
    invalid = [f"rank {r}: {text}" for r, (text, _) in enumerate(gathered) if text is not None]
    if invalid:
        raise ValueError(f"Buffer: the arguments of {len(invalid)} rank(s) are invalid ({'; '.join(invalid)}); "
                         "no rank made the Buffer")
    differ = [_who_passed_what(name, [peer[name] for _, peer in gathered]) for name in FIELDS]
    differ = [d for d in differ if d]
    if differ:
        raise ValueError(f"Buffer: arguments differ between ranks ({'; '.join(differ)}): every rank must pass the "
                         "same; no rank made the Buffer")


def _who_passed_what(name: str, values: List[Any]) -> str:
    """``"hidden: 24 on ranks [0, 2], 25 on ranks [1]"`` when ``values`` (one per rank) differ, else ``""``."""
    ranks: Dict[str, List[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(repr(value), []).append(rank)
    if len(ranks) == 1:
        return ""
    return f"{name}: " + ", ".join(f"{value} on ranks {who}" for value, who in ranks.items())
