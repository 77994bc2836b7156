"""Abort records: how a rank that gives up on a Buffer tells every peer, and how the peers read it.

A rank whose step times out or fails midway writes one record into its slot ``abort[me]`` of every
peer's symmetric buffer (``SymmetricLayout.abort_at``) before it raises, with a one-sided put or a
host store that never waits for the peer. Every rank reads the records peers posted into its own
buffer on entering a call (a GPU call that does not wait on the host: as its last finished wait saw
them) and while it waits (after a GPU wait that every rank arrived at: as that wait saw them), and
raises ``PeerAbortedError`` naming them.

A record is ``ABORT_WORDS`` int64 words: ``[posted (1), kind (STEP_KINDS, 0 before any step), the
kind's call number, reason length in bytes, reason (UTF-8, cut to REASON_BYTES)]``. The posting rank
writes word 0 last, so a reader that sees it set sees the rest.
"""
from __future__ import annotations

from typing import List, Protocol, Tuple

import numpy as np

from ep_comm.contract.symmetric import ABORT_WORDS, STEP_KINDS
from ep_comm.errors import PeerAbortedError

HEADER_WORDS = 4
REASON_BYTES = 8 * (ABORT_WORDS - HEADER_WORDS)
_KIND_NAMES = {code: name for name, code in STEP_KINDS.items()}

Record = Tuple[int, str, str]  # (rank, step such as "dispatch #2", reason)


class AbortBoard(Protocol):
    """Where a transport keeps the abort records of one Buffer (the MPI window, the NVSHMEM heap)."""

    def post_abort(self, record: np.ndarray) -> None:
        """Write ``record`` (int64 ``[ABORT_WORDS]``) into this rank's slot of every peer's buffer, word 0
        last, without waiting for any peer (best effort: a peer that is gone is skipped)."""

    def abort_table(self) -> np.ndarray:
        """The int64 ``[R, ABORT_WORDS]`` records the peers posted into this rank's buffer (current values)."""


def encode(kind: str, number: int, reason: str) -> np.ndarray:
    """The record of a rank giving up at call ``number`` of ``kind`` (``"dispatch"``, ... or ``""`` before
    any step) for ``reason``.

    Args:
        kind: a key of ``STEP_KINDS``, or ``""``.
        number: the call number among the calls of ``kind`` (``dispatch #2``: 2).
        reason: why, in a few words; cut to ``REASON_BYTES`` bytes of UTF-8.

    Returns:
        int64 ``[ABORT_WORDS]`` with word 0 (posted) set.
    """
    text = reason.encode("utf-8")[:REASON_BYTES]
    words = np.zeros(ABORT_WORDS, dtype=np.int64)
    words[:HEADER_WORDS] = (1, STEP_KINDS.get(kind, 0), number, len(text))
    words.view(np.uint8)[8 * HEADER_WORDS: 8 * HEADER_WORDS + len(text)] = np.frombuffer(text, dtype=np.uint8)
    return words


def decode(table: np.ndarray) -> List[Record]:
    """The posted records of an int64 ``[R, ABORT_WORDS]`` table, by rank.

    Args:
        table: as ``AbortBoard.abort_table`` returns it.

    Returns:
        ``(rank, step, reason)`` for every rank whose word 0 is set, ascending rank.
    """
    records = []
    for rank in np.nonzero(table[:, 0])[0].tolist():
        words = np.array(table[rank])
        kind, number, length = (int(w) for w in words[1:HEADER_WORDS])
        step = f"{_KIND_NAMES[kind]} #{number}" if kind in _KIND_NAMES else "construction"
        raw = words.view(np.uint8)[8 * HEADER_WORDS: 8 * HEADER_WORDS + min(max(length, 0), REASON_BYTES)]
        records.append((rank, step, raw.tobytes().decode("utf-8", errors="replace")))
    return records


def peer_aborted(me: int, doing: str, records: List[Record]) -> PeerAbortedError:
    """The error rank ``me`` raises in ``doing`` (``"dispatch #3"``, ``"cannot dispatch"``) on finding ``records``.

    Args:
        me: this rank.
        doing: what this rank was doing.
        records: the peers' records (``decode``), non-empty.

    Returns:
        A ``PeerAbortedError`` naming each rank, the step it gave up at and its reason.
    """
    told = "; ".join(f"rank {r} gave up at {step} ({reason})" for r, step, reason in records)
    return PeerAbortedError(f"rank {me}: {doing}: {told}; this Buffer is out of step with its peers: "
                            "close it (local release) and create a new one", records)
