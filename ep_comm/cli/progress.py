"""Rank 0's progress line on stderr, shared by ``ep_comm.bench`` and ``ep_comm.soak`` (no heavy imports)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """One progress line per stretch of ``total`` steps (``start``), on ``stream``.

    ``live`` redraws the line in place (a TTY, or ``--progress``), at most every ``redraw_s`` seconds
    and always on the last step; off live, ``periodic`` prints a line per 10 % of the steps.
    ``final``: ``finish`` prints one closing line (a live line is then cleared rather than kept).
    All off is ``--quiet``. A line is ``[tag] `` and ``template`` formatted with ``label``, ``done``,
    ``total``, ``rate`` (steps per second since ``start``) and ``detail`` (given to ``tick``).
    """

    def __init__(self, tag: str, template: str, live: bool, periodic: bool = False, final: bool = False,
                 redraw_s: float = 0.0, stream: TextIO = sys.stderr):
        self.tag, self.template, self.stream = tag, template, stream
        self.live, self.periodic, self.final, self.redraw_s = live, periodic, final, redraw_s
        self.label, self.total, self.begun, self.last = "", 0, 0.0, -1.0

    def start(self, label: str, total: int) -> None:
        self.label, self.total, self.begun, self.last = label, total, time.perf_counter(), -1.0

    def tick(self, done: int, detail: str = "") -> None:
        if not (self.live or self.periodic) or not self.total:
            return
        now = time.perf_counter()
        if self.live:
            if now - self.last < self.redraw_s and done != self.total:
                return
        elif not (done == self.total or done * 10 // self.total != (done - 1) * 10 // self.total):
            return
        self.last = now
        line = f"[{self.tag}] " + self.template.format(label=self.label, done=done, total=self.total, detail=detail,
                                                       rate=done / max(now - self.begun, 1e-9))
        self.stream.write(f"\r\033[K{line}" if self.live else f"{line}\n")
        if self.live and done == self.total and not self.final:
            self.stream.write("\n")
        self.stream.flush()

    def finish(self, message: str) -> None:
        if self.live:
            self.stream.write("\r\033[K")
        if self.final:
            self.stream.write(f"[{self.tag}] {self.label}: {message}\n")
        self.stream.flush()
