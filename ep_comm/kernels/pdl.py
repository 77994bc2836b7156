"""Programmatic dependent launch (PDL), device side: ``griddepcontrol`` at the start of every ``@kernel``.

Off unless ``EP_COMM_KERNEL_PDL=1`` (``ep_comm.kernels.switches.PDL``, read once, a compile-time constant and part of
the kernel cache key): then :func:`pdl_enter`, the first statement of every kernel of this package, lets the next
kernel in the stream launch as soon as every block of this one has started (PTX ``griddepcontrol``, its
``launch_dependents`` form),
and waits until the kernels this one depends on have finished and their writes are visible
(``griddepcontrol.wait``) before any memory access. The host side launches such kernels with the programmatic
stream serialization attribute (``ep_comm._launcher.raw``), so that the launch latency and prologue of each kernel
of a chain (count, scatter, receive count, copy, ...) overlap the kernel before it. A kernel launched without the
attribute passes both instructions at once. Off, :func:`pdl_enter` compiles to nothing.

The Python bodies are what the CUDA simulator runs (no-ops: it runs launches one after another).
"""
from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic, overload

from ep_comm.kernels.switches import PDL


def launch_dependents():
    """PTX ``griddepcontrol`` (``launch_dependents``): the next kernel may launch once every block of this one got
    here."""


def wait_for_prerequisites():
    """``griddepcontrol.wait``: block until the prerequisite grids finished and their memory is visible."""


def _asm_intrinsic(text: str):
    @intrinsic
    def emit(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return emit


_launch_dependents = _asm_intrinsic("griddepcontrol.launch_dependents;")
_wait = _asm_intrinsic("griddepcontrol.wait;")


@overload(launch_dependents, target="cuda")
def _launch_dependents_cuda():
    return lambda: _launch_dependents()


@overload(wait_for_prerequisites, target="cuda")
def _wait_cuda():
    return lambda: _wait()


@cuda.jit(device=True)
def pdl_enter():
    """First statement of every kernel: with ``EP_COMM_KERNEL_PDL=1``, let dependents launch, then wait for the
    prerequisites (see the module); otherwise nothing."""
    if PDL:
        launch_dependents()
        wait_for_prerequisites()
