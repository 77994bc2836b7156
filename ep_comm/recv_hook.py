"""``RecvHook``: the receive half of a ``Buffer.dispatch`` or ``Buffer.combine`` called with ``return_recv_hook=True``."""
from __future__ import annotations

from typing import Callable, Generic, Optional

from ep_comm.backends.interface import Output, ReceiveHalf

_PENDING, _CALLED, _CLOSED = "pending", "called", "closed"


class RecvHook(Generic[Output]):
    """The receive half of one dispatch or combine whose send half is enqueued: call it (``hook()``, no
    arguments) to enqueue the bounded wait for every rank's signal and the receive, and get the
    ``DispatchOutput`` / ``CombineOutput`` the plain call returns, bit for bit. Nothing is received before:
    the outputs do not exist until the hook returns them.

    Rules (RuntimeError naming the step otherwise, e.g. ``"dispatch #3"``):

    * a hook is called once;
    * while it is pending its Buffer takes no other ``dispatch`` or ``combine`` (other Buffers' calls
      interleave freely); ``Buffer.close()`` invalidates it;
    * it is called on the stream the send was enqueued on, or on one ordered after it (``nvshmem``: outside a
      CUDA-graph capture a different current stream is made to wait for the send); a send captured into a
      CUDA graph needs its hook captured too (into a graph replayed after the send's), and one enqueued
      eagerly needs an eager hook.

    The call's inputs (``x``, ``y``, weights, bias) must stay unchanged until the hook has run (the receive half
    reads the bias, and on ``nvshmem`` a compact combine's own rows of ``y``).

    The wait is bounded by the Buffer's ``timeout_s`` from the hook's call: a rank that did not send raises
    ``ep_comm.TimeoutError`` naming it, and a failure in the receive makes the Buffer unusable as a failing
    plain call does. Attribute: ``step``, the call by kind and number among its kind (``"dispatch #3"``).
    """

    __slots__ = ("step", "_half", "_state", "_done")

    def __init__(self, half: ReceiveHalf[Output], done: Callable[["RecvHook"], None]):
        """``half``: the backend's receive part; ``done(hook)``: tells the Buffer the hook is no longer pending."""
        self.step = half.step
        self._half: Optional[ReceiveHalf[Output]] = half
        self._state = _PENDING
        self._done = done

    @property
    def pending(self) -> bool:
        """Whether the hook is still to be called (not called yet, its Buffer still open)."""
        return self._state == _PENDING

    def __call__(self) -> Output:
        """Enqueue the receive half and return the call's output (``DispatchOutput`` / ``CombineOutput``).

        Raises:
            RuntimeError: the hook was already called, its Buffer was closed since the send, or (``nvshmem``) the
                current stream's capture state is not the send's (the hook stays pending then).
            ep_comm.TimeoutError, ep_comm.PeerAbortedError: as the plain call raises them.
        """
        if self._state == _CALLED:
            raise RuntimeError(f"{self.step}'s receive hook was already called: a hook receives once (keep the "
                               "output its first call returned)")
        if self._state == _CLOSED:
            raise RuntimeError(f"{self.step}'s receive hook belongs to a Buffer that was closed after the send: "
                               "nothing can be received; call the hook before Buffer.close()")
        half = self._half
        half.prepare()
        self._state, self._half = _CALLED, None
        self._done(self)
        return half.receive()

    def invalidate(self) -> None:
        """Its Buffer closes: a later call raises RuntimeError."""
        self._state, self._half = _CLOSED, None

    def __repr__(self) -> str:
        return f"<RecvHook of {self.step}: {self._state}>"
