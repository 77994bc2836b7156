"""The backend under test in the collective suites of ``tests/mpi``: Buffers for a ``World`` and its inputs.

The backend and its transport are the session's ``--backend`` and ``--transport`` (``helpers.options``).
"""
from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np

import ep_comm
from helpers.options import current
from helpers.oracle import COMM, RANK, WORLD, World

TIMEOUT_S = 30.0


def to_device(a: Optional[np.ndarray]) -> Any:
    """``a`` where the backend under test wants its inputs: as is on mpi, a CuPy copy on nvshmem."""
    if a is None or current().backend == "mpi":
        return a
    import cupy  # only the nvshmem backend's runs have (and need) the GPU stack

    return cupy.asarray(a)


def forwarded() -> bool:
    """Whether the session's Buffers send to other nodes through their forwarders (``--forwarding`` with
    ``--scaleup-ranks`` below the rank count)."""
    return current().forwarded_nodes(COMM.size) is not None


def make_buffer(world: World, deterministic: bool = True, **kw: Any) -> ep_comm.Buffer:
    """A Buffer for ``world``'s geometry and dtype on the session's backend (and virtual nodes); ``kw`` goes to
    ``ep_comm.Buffer``, over the session's choices (``timeout_s`` defaults to ``TIMEOUT_S``)."""
    kwargs = dict(current().buffer_kwargs(), deterministic=deterministic, timeout_s=TIMEOUT_S)
    kwargs.update(kw)
    if current().backend == "nvshmem":
        kwargs["transport"] = transport_in_nodes(kwargs)
    return ep_comm.Buffer(num_experts=world.num_experts, hidden=world.hidden, num_topk=world.num_topk,
                          num_max_tokens_per_rank=world.max_tokens, dtype=world.dtype.name, **kwargs)


def transport_in_nodes(kwargs: Dict[str, Any]) -> str:
    """The nvshmem ``transport`` of a Buffer made with ``kwargs``: the session's, but ``"auto"`` where the Buffer's
    nodes split the job and the session's transport cannot serve them (``"stores"`` reach one node only; forwarding is
    built over peer stores in load/store reach, not over puts)."""
    transport = kwargs["transport"]
    nodes = kwargs.get("scaleup_ranks") is not None and kwargs["scaleup_ranks"] < COMM.size
    if transport == "stores" and nodes or transport == "puts" and nodes and kwargs.get("forwarding"):
        return "auto"
    return transport


def dispatch(buf: ep_comm.Buffer, world: World, **kw: Any) -> ep_comm.DispatchOutput:
    """This rank's tokens of ``world`` (payload, routing, weights) through ``buf.dispatch(..., **kw)``."""
    return buf.dispatch(to_device(world.x[RANK]), to_device(world.topk_idx[RANK]),
                        to_device(world.weights[RANK]), **kw)


@contextlib.contextmanager
def shared_buffers() -> Iterator[Callable[..., ep_comm.Buffer]]:
    """``get(world, deterministic=True)``: one Buffer per (dtype, experts, hidden, deterministic), made at its first
    request (collective: every rank asks in the same order) and shared; all closed when the context ends."""
    made: Dict[tuple, ep_comm.Buffer] = {}

    def get(world: World, deterministic: bool = True) -> ep_comm.Buffer:
        key = (world.dtype.name, world.num_experts, world.hidden, deterministic)
        if key not in made:
            made[key] = make_buffer(world, deterministic)
        return made[key]

    try:
        yield get
    finally:
        for buf in made.values():
            buf.close()


def fail_together(body: Callable[[], None]) -> None:
    """Run ``body`` on every rank; if it raised on any rank, raise AssertionError on every rank
    with each failing rank's error, so all ranks fail (and shrink) the same examples."""
    try:
        body()
        error = None
    except Exception as exc:  # any failure, reported collectively below
        error = f"rank {RANK}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    errors = [e for e in COMM.allgather(error) if e]
    if errors:
        raise AssertionError(f"{len(errors)} of {WORLD} ranks failed:\n" + "\n".join(errors))


def agree_on(drawn: Any) -> None:
    """Every rank must have drawn the same example ``drawn`` (compared by ``repr``): a divergence fails at once on
    every rank instead of hanging in a collective."""
    examples = COMM.allgather(repr(drawn))
    if len(set(examples)) != 1:
        raise AssertionError("hypothesis drew different examples on different ranks:\n" + "\n".join(examples))
