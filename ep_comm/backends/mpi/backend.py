"""The ``mpi`` backend: the whole dispatch/combine protocol on CPU, NumPy arithmetic over MPI windows.

It runs the phases of the GPU path (count, prefix sums, count exchange, rank scatter, expert
scatter, combine) with ``ep_comm.contract.layout`` and ``ep_comm.contract.reduce`` doing the math, so it is both
the default where there is no GPU and the executable reference the GPU backend is checked against.

This module holds the class (its construction, inputs, close), which composes its parts and implements the
``Backend`` protocol by delegating to them: ``mpi.steps.MpiStepRunner`` (how a step runs: unsplit or split, signal
and bounded wait, the pending routing error), ``mpi.context.MpiContext`` (what the parts are given: geometry, layout,
topology, window, runner; the blocks a step puts and reads), ``mpi.protocol.MpiProtocol`` (dispatch and combine)
over a route: ``mpi.flat.FlatRoute``, or with ``Buffer(forwarding=True)`` and several nodes
``mpi.forwarding.ForwardedRoute`` (the sends to other nodes through their forwarders, and the relay).
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from ep_comm.backends.interface import (
    BackendSettings,
    OperationRows,
    Traffic,
)
from ep_comm.backends.mpi.context import MpiContext
from ep_comm.backends.mpi.flat import FlatRoute
from ep_comm.backends.mpi.forwarding import ForwardedRoute
from ep_comm.backends.mpi.protocol import MpiProtocol, Route
from ep_comm.backends.mpi.steps import MpiStepRunner
from ep_comm.backends.profile import Profile, ProfileRow
from ep_comm.contract import layout as lay
from ep_comm.contract.checks import topk_values
from ep_comm.contract.forward_inbox import ForwardInbox
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import SymmetricLayout
from ep_comm.contract.topology import Topology
from ep_comm.transport.mpi_window import MpiWindow

_LEAKED_COMMS: List[MPI.Comm] = []  # communicators of failed Buffers, never freed


class MpiBackend:
    """CPU backend. Arrays in and out are NumPy arrays.

    ``Buffer(profile=True)`` records host times (there are no GPU events) of every collective
    step's ``total`` and ``signal+wait``, a dispatch's ``scatter`` and ``receive``, and a combine's
    ``send`` and ``reduce``; a split step (``return_recv_hook=True``) records ``send part``, ``signal``,
    ``hook`` and ``wait`` instead of ``total`` and ``signal+wait``.

    A dispatch of a new routing checks this rank's ``topk_idx`` values in its count step and sends the verdict with
    its counts (``checks.verdict_words``); after the wait every rank reads every verdict, and when one is bad
    (``checks.routing_error``) no rank takes a row and every rank raises the same error, outside the guarded step
    (the ranks stayed in step: the Buffer stays usable): at once where the call returns on the host (``cpu_sync``;
    a hook's call), else from the next dispatch or combine, before it does anything (``close`` drops it).

    ``settings.scaleup_ranks`` groups the ranks in (virtual) nodes; ``settings.forwarding`` with more than one node
    sends to the other nodes through their forwarders (``mpi.forwarding.ForwardedRoute``; ``inbox`` is then the
    window's forwarding inbox, else None). ``scaleout_rows``: the payload rows this rank has put so far into ranks
    of other nodes (their inboxes included), per operation, ``{"dispatch": n, "combine": n}``.
    """

    name = "mpi"
    xp = np
    num_sms: Optional[int] = None  # no kernels: Buffer(num_sms=...) has no effect here
    transport_name: Optional[str] = None  # one transport, MPI windows: Buffer(transport=...) has no effect here

    def __init__(self, comm: MPI.Comm, geo: Geometry, settings: BackendSettings):
        self.comm = comm.Dup()
        self.geo = geo
        sym = SymmetricLayout(geo.num_ranks, geo.max_tokens, geo.hidden, geo.num_topk, geo.dtype.itemsize,
                              geo.experts_per_rank)
        topology = Topology.of(geo.num_ranks, settings.scaleup_ranks)
        forwarded = settings.forwarding and topology.num_nodes > 1
        self.inbox = ForwardInbox(sym, topology.scaleup_ranks) if forwarded else None
        self.scaleout_rows = {"dispatch": 0, "combine": 0}
        self.window: Optional[MpiWindow] = MpiWindow(self.comm, sym, self.inbox)
        self.runner = MpiStepRunner(self.comm.rank, geo.num_ranks, settings.timeout_s, self.window,
                                    Profile(settings.profile), settings.wait_stats)
        ctx = MpiContext(self.comm.rank, geo, sym, topology, self.window, self.runner, self.scaleout_rows)
        route: Route = FlatRoute(ctx) if self.inbox is None else ForwardedRoute(ctx, self.inbox)
        self.protocol = MpiProtocol(ctx, route, settings.deterministic)
        # the Backend interface's calls of the protocol, bound to it once
        p = self.protocol
        self.pack_fp8, self.dispatch, self.dispatch_send = p.pack_fp8, p.dispatch, p.dispatch_send
        self.combine, self.combine_send = p.combine, p.combine_send

    # ------------------------------------------------------------------ inputs
    def as_array(self, obj: Any, name: str) -> np.ndarray:
        """Accept NumPy arrays and anything NumPy can view without copying semantics surprises; a subclass of
        ``numpy.ndarray`` (``numpy.matrix``) as a plain view of its data, whose indexing is NumPy's."""
        if type(obj) is np.ndarray:
            return obj
        if hasattr(obj, "__array_interface__") or hasattr(obj, "__array__"):
            return np.asarray(obj)
        if hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(f"{name} is a GPU array: the mpi backend takes host (NumPy) arrays")
        raise TypeError(f"{name} must be an array, got {type(obj).__name__}")

    def capturing(self) -> bool:
        """Never: there are no CUDA graphs on CPU."""
        return False

    def routing_summary(self, topk_idx: np.ndarray) -> Tuple[int, int]:
        """``(largest id, first row naming an expert twice or -1)``: ``checks.topk_values`` in NumPy."""
        return topk_values(np, topk_idx)

    def dispatch_layout(self, topk_idx: np.ndarray) -> lay.DispatchLayout:
        """``ep_comm.contract.layout.dispatch_layout`` of ``topk_idx [T, K]``."""
        return lay.dispatch_layout(topk_idx, self.geo.num_experts, self.geo.num_ranks)

    # ---------------------------------------------------------------- reads
    def captured_memory(self) -> ContextManager[None]:
        """Nothing to hold: there are no CUDA graphs on CPU."""
        return contextlib.nullcontext()

    def profile_table(self) -> List[ProfileRow]:
        """Median host microseconds per (operation, phase) so far (``gpu_us_p50`` is None)."""
        return self.runner.profile.table()

    def traffic(self) -> Traffic:
        """``scaleout_rows``: the rows counted in :attr:`scaleout_rows` so far."""
        return Traffic(OperationRows(**self.scaleout_rows))

    def wait_table(self) -> np.ndarray:
        """A copy of the host wait statistics (``wait_stats.HostWaits``)."""
        return self.runner.waits.table

    def reset_waits(self) -> None:
        self.runner.waits.reset()

    # ------------------------------------------------------------------- close
    def close(self) -> None:
        """Collective close with a bounded wait (``Unlock_all``, ``Win.Free``, ``Comm.Free``) after a clean
        run; after any failure (this rank's, a peer's abort record, a close step that failed) a local
        release without MPI calls: the window and the communicator are leaked (``MpiWindow.free``).

        Raises:
            PeerAbortedError: a peer's abort record was here when this rank entered or waited in close.
            ep_comm.TimeoutError: a peer did not reach close within ``timeout_s``.
        """
        runner = self.runner
        runner.pending_routing_error = None  # a pending routing error goes with the Buffer, unraised
        if self.window is None:
            return
        try:
            if not runner.steps.unusable:
                runner.run_close()
        finally:
            clean = not runner.steps.unusable
            self.window.free(collective=clean)
            self.window = None
            if clean:
                self.comm.Free()
            else:
                _LEAKED_COMMS.append(self.comm)  # Comm.Free is collective
