"""The eager calls of a point beyond its timed new-routing round trips: the host time per ``cpu_sync=False`` call
(``host_us``) and the eager cached dispatch with ``cpu_sync=True`` (``dispatch_cached``; with ``--fp8`` also the
sender cast, ``dispatch_cast``)."""
from __future__ import annotations

import cProfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.bench.measure import Payload, PointSpec, Timer, new_dispatch, packed_received, sample_times
from ep_comm.testing import token_rows


class AsyncPair:
    """The cached ``cpu_sync=False`` dispatch of ``payload`` replaying ``handle``, and its combine: the path that
    never waits on the host. With FP8 the combine input is made once here (:meth:`Payload.combine_input`; the
    handle's layout does not change), so the pair's combine takes rows in the payload dtype."""

    def __init__(self, buf: Any, payload: Payload, handle: Any):
        self.buf, self.payload, self.handle = buf, payload, handle
        self.fixed = None if payload.pair is None else payload.combine_input(buf, self.dispatch(), cpu_sync=False)

    def dispatch(self) -> Any:
        """The cached dispatch (collective); its ``DispatchOutput``."""
        return self.buf.dispatch(self.payload.sent, handle=self.handle, cpu_sync=False)

    def combine(self, out: Any) -> Any:
        """The combine of ``out`` (collective); the combined ``x``."""
        return self.buf.combine(out.recv_x if self.fixed is None else self.fixed, out.handle).x


def host_call_times(comm: MPI.Comm, buf: Any, payload: Payload, didx: Any, handle: Any, timer: Timer,
                    spec: PointSpec, profiler: Optional[cProfile.Profile] = None) -> Dict[str, Any]:
    """Host seconds per ``cpu_sync=False`` call, until the call returns: the cached dispatch of ``payload``
    (:class:`AsyncPair`), its combine, then a dispatch of the routing ``didx`` as new, ``spec.warmup +
    spec.iters`` rounds. Each round runs inside ``timer``, which waits for the device afterwards, so rounds do
    not pile up; ``profiler`` (cProfile) records the cached pair's two calls of each round, not the wait. Returns
    ``{"dispatch_cached_async": [...], "combine": [...], "dispatch_new_async": [...], "result": the last cached
    combine's x}``."""
    pair = AsyncPair(buf, payload, handle)
    last: Dict[str, Any] = {}

    def calls() -> Tuple[float, float, float]:
        if profiler is not None:
            profiler.enable()
        t0 = time.perf_counter()
        out = pair.dispatch()
        t1 = time.perf_counter()
        last["x"] = pair.combine(out)
        t2 = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        t3 = time.perf_counter()
        new_dispatch(buf, payload, didx, spec, cpu_sync=False)
        return t1 - t0, t2 - t1, time.perf_counter() - t3

    rows = sample_times(comm, lambda: timer(calls)[0], spec.warmup, spec.iters)
    names = ("dispatch_cached_async", "combine", "dispatch_new_async")
    return {**{name: rows[:, i].tolist() for i, name in enumerate(names)}, "result": last["x"]}


def cached_times(comm: MPI.Comm, buf: Any, payload: Payload, handle: Any, timer: Timer,
                 spec: PointSpec) -> Dict[str, Any]:
    """Seconds per eager cached dispatch (``cpu_sync=True``) of ``payload`` replaying ``handle``
    (``dispatch_cached``), ``spec.warmup + spec.iters`` rounds. With FP8 each round also dispatches ``x`` with
    ``use_fp8=True`` (``dispatch_cast``: the sender's quantize, then the same send), and ``failures`` says
    whether the last two dispatches received the same bytes. Returns those lists and ``failures``."""
    last: Dict[str, Any] = {}

    def body() -> List[float]:
        last["pair"], t_cached = timer(lambda: buf.dispatch(payload.sent, handle=handle))
        if payload.pair is None:
            return [t_cached]
        last["cast"], t_cast = timer(lambda: buf.dispatch(payload.x, handle=handle, use_fp8=True))
        return [t_cached, t_cast]

    rows = sample_times(comm, body, spec.warmup, spec.iters)
    times = {name: rows[:, i].tolist() for i, name in enumerate(("dispatch_cached", "dispatch_cast")[:rows.shape[1]])}
    return {**times, "failures": _cast_failures(last)}


def _cast_failures(last: Dict[str, Any]) -> List[str]:
    """With ``--fp8`` (``last`` holds ``"cast"``): the FP8 rows of the ``use_fp8=True`` dispatch against those of
    the prepared pair, on the rows that hold a token."""
    if "cast" not in last:
        return []
    real = token_rows(last["pair"])
    if np.array_equal(packed_received(last["pair"], real), packed_received(last["cast"], real)):
        return []
    return ["FP8 rows of the use_fp8=True dispatch differ from those of the prepared pair"]
