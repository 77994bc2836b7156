"""The bench's straggler (``--straggler RANK:US``) and its per-point wait statistics.

With ``--straggler RANK:US`` rank ``RANK`` sleeps ``US`` microseconds on the host before each of its calls: every
dispatch and combine (a :class:`LateBuffer` stands for its Buffer) and every CUDA-graph replay launch. Every point
reads each rank's ``Buffer.wait_stats()`` (reset when the point starts: eager calls, then graph replays apart) and
rank 0 merges them (``ep_comm.transport.wait_stats.summary``) into the point's ``wait_stats``: ``late_share`` (per
rank, the fraction of the other ranks' measured waits in which it arrived last), ``wait_us_p50`` (per rank, the
median of how long the others waited for it), ``wait_us_total``, and ``by_part`` (the same for ``eager`` and
``graphs``).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from ep_comm.transport.wait_stats import merge, straggler_line, summary


class Straggler(NamedTuple):
    """``--straggler RANK:US``: rank ``rank`` sleeps ``us`` microseconds before each of its calls."""

    rank: int
    us: float

    def pause_for(self, rank: int) -> Optional[Callable[[], None]]:
        """The sleep rank ``rank`` takes before each call, or None for the others."""
        if rank != self.rank:
            return None
        seconds = self.us / 1e6
        return lambda: time.sleep(seconds)


def straggler(text: str) -> Straggler:
    """argparse type of ``--straggler``: ``RANK:US``, a rank >= 0 and microseconds >= 0 (``"2:3000"``)."""
    rank, _, us = text.partition(":")
    try:
        value = Straggler(int(rank), float(us))
    except ValueError:
        value = Straggler(-1, -1.0)
    if value.rank < 0 or not value.us >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be RANK:US, a rank >= 0 and microseconds >= 0, e.g. 2:3000")
    return value


class LateBuffer:
    """A Buffer whose ``dispatch`` and ``combine`` sleep first (``pause()``); everything else is the Buffer's."""

    def __init__(self, buf: Any, pause: Callable[[], None]):
        self._buf, self._pause = buf, pause

    def dispatch(self, *args: Any, **kwargs: Any) -> Any:
        self._pause()
        return self._buf.dispatch(*args, **kwargs)

    def combine(self, *args: Any, **kwargs: Any) -> Any:
        self._pause()
        return self._buf.combine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._buf, name)


def section(parts: Sequence[Dict[str, np.ndarray]]) -> Optional[Dict[str, Any]]:
    """The point's ``wait_stats`` from every rank's tables by part (``parts[r]``: ``{"eager": table, ...}``), or None
    when no rank measured anything."""
    if not parts or not parts[0]:
        return None
    names = list(parts[0])
    out = summary([merge([p[name] for name in names]) for p in parts])
    out["by_part"] = {name: summary([p[name] for p in parts]) for name in names}
    return out


def format_lines(point: Dict[str, Any]) -> List[str]:
    """The report's lines of a point's ``wait_stats``: who made the others wait most, overall and per part."""
    waits = point.get("wait_stats")
    if not waits:
        return []
    lines = [f"  {straggler_line(waits)}"]
    parts = waits.get("by_part", {})
    if len(parts) > 1:
        lines.append("    " + "; ".join(f"{name}: {straggler_line(part).removeprefix('waits: ')}"
                                        for name, part in parts.items()))
    lines.append("    late_share per rank " + ", ".join(f"{s:.2f}" for s in waits["late_share"])
                 + "; wait_us_p50 per rank " + ", ".join(f"{v:.1f}" for v in waits["wait_us_p50"]))
    return lines
