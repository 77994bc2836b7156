"""The CUDA C kernels of ``ep_comm.transport.signals`` compile for sm_90 with NVRTC, without a GPU (they run
only on a GPU: CuPy compiles them there; skipped where NVRTC is missing), their host wrappers size the
count blocks from the received count words, and their prepared launches pass the driver the bytes CuPy's
``RawKernel`` passed (a fake ``cuLaunchKernel`` records them)."""
from __future__ import annotations

import ast
import ctypes
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from ep_comm._launcher import raw
from ep_comm.contract.symmetric import STEP_KINDS
from ep_comm.kernels.signal_wait import CUDA_SOURCE as _SOURCE
from ep_comm.transport.inbox_signals import InboxSignals, inbox_peer_pointers, measured_wait
from ep_comm.transport.signals import MODULE_OPTIONS, PARAMS, SignalKernels, _count_words


def test_count_blocks_are_one_per_destination_of_the_received_width():
    received = np.zeros((2, 3, 5), np.int64)  # [2, R, 1 + L + 2]: R = 3, L = 2
    assert _count_words(np.zeros((3, 5), np.int32), received) == 5
    assert _count_words(None, received) == 5  # the wait alone zeroes a missing rank's 5 words
    assert _count_words(None, None) == 0
    with pytest.raises(ValueError, match=r"counts has shape \(3, 1\): must be \[R, 1 \+ L \+ 2\] = \(3, 5\)"):
        _count_words(np.zeros((3, 1), np.int32), received)
    with pytest.raises(ValueError, match="counts given without counts_by_parity"):
        _count_words(np.zeros((3, 5), np.int32), None)


def _ptx(source: str, module_options: tuple = MODULE_OPTIONS) -> str:
    """The PTX NVRTC makes of ``source`` for sm_90 with ``module_options`` (the transport's, by default)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"signals.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    options = [o.encode() for o in module_options] + [b"-arch=compute_90"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        pytest.fail(log.decode())
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.decode()


def test_signal_kernels_compile_with_acquire_release_at_system_scope():
    try:
        ptx = _ptx(_SOURCE)
    except RuntimeError as exc:  # the bindings without a libnvrtc to load
        pytest.skip(f"no NVRTC here: {exc}")
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx))
    assert entries == {"signal_and_wait", "send_signal", "wait_signals"}
    assert "ld.acquire.sys.global.b64" in ptx and "st.release.sys.global.b64" in ptx
    assert "globaltimer" in ptx and "nanosleep" in ptx
    assert "atom.shared.max.u64" in ptx  # the longest delay of a wait (the wait statistics)


def test_the_lineinfo_switch_compiles_the_signal_kernels_with_line_information():
    """``EP_COMM_KERNEL_LINEINFO=1`` (read at import) adds ``-lineinfo`` to the module's options, whose PTX then maps
    its instructions to lines of the source (``.loc``), as Nsight Compute's source page needs; off, it does not."""
    code = "from ep_comm.transport.signals import MODULE_OPTIONS; print(repr(MODULE_OPTIONS))"
    for value, want in (("1", ("--std=c++14", "-lineinfo")), ("", ("--std=c++14",))):
        env = dict(os.environ, EP_COMM_KERNEL_LINEINFO=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert ast.literal_eval(out.stdout.strip()) == want, (value, out.stdout)
    try:
        assert ".loc" in _ptx(_SOURCE, ("--std=c++14", "-lineinfo"))
    except RuntimeError as exc:  # the bindings without a libnvrtc to load
        pytest.skip(f"no NVRTC here: {exc}")
    assert ".loc" not in _ptx(_SOURCE, ("--std=c++14",))


_C_TYPES = {"int": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64}


def test_the_prepared_parameters_follow_the_cuda_c_signatures():
    """Every kernel's parameter names and widths in ``PARAMS`` are those of its signature in ``_SOURCE``
    (pointers as 8-byte addresses): the block the driver reads is laid out as the kernel expects."""
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', _SOURCE):
        found[name] = tuple((decl.split()[-1], ctypes.c_uint64 if "*" in decl else _C_TYPES[decl.split()[-2]])
                            for decl in (p.strip() for p in params.split(",")))
    assert found == PARAMS


class _DeviceArray:
    """A CuPy array as the launches see it: its device address (``data.ptr``) and shape."""

    def __init__(self, ptr: int, shape: tuple):
        self.data = SimpleNamespace(ptr=ptr)
        self.shape = shape


def _rawkernel_bytes(args: tuple) -> list:
    """The parameter bytes CuPy's ``RawKernel`` passed for ``args`` (``cupy/cuda/function.pyx``, ``_pointer``):
    an ndarray its data pointer, a NumPy scalar its own bytes."""
    return [np.uint64(a.data.ptr).tobytes() if hasattr(a, "data") and not isinstance(a, np.generic) else a.tobytes()
            for a in args]


@pytest.fixture
def launches(monkeypatch):
    """The launches a fake ``cuLaunchKernel`` saw: ``(function, grid, block, shared bytes, stream, parameter
    bytes)``, each parameter read at its address in the ``void*[]`` for its width in ``PARAMS``."""
    seen = []

    def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        name = FUNCTIONS_BY_HANDLE[int(f)]
        pointers = (ctypes.c_void_p * len(PARAMS[name])).from_address(params)
        got = [ctypes.string_at(ptr, ctypes.sizeof(ctype)) for ptr, (_, ctype) in zip(pointers, PARAMS[name])]
        seen.append((name, (gx, gy, gz), (bx, by, bz), shared, int(stream), got, extra))

    monkeypatch.setattr(raw, "driver_launch", launch)
    return seen


FUNCTIONS_BY_HANDLE = {0x7000 + i: name for i, name in enumerate(PARAMS)}


def _compiled(name: str, device: int) -> tuple:
    assert device == 3
    return next(h for h, n in FUNCTIONS_BY_HANDLE.items() if n == name), f"the module of {name}"


R, WORDS = 3, 5  # ranks, 1 + L + 2 count words
PEERS, STEP, SIGNALS, STATUS = (_DeviceArray(0x10000 * (i + 1), shape) for i, shape in
                                enumerate([(R,), (1,), (R,), (2 + 2 * R,)]))
RECEIVED, ABORTS = _DeviceArray(0x50000, (2, R, WORDS)), _DeviceArray(0x60008, (R, 64))
WAITS = _DeviceArray(0x80000, (R, 53))  # the wait statistics, int64 [R, WAIT_WORDS]
SEND = _DeviceArray(0x70000, (R, WORDS))


def _transport(peers) -> SignalKernels:
    """The launches of a transport at rank 1 of 3, device 3: signal words at byte 64, count words at 4096."""
    return SignalKernels(peers, R, 1, 64, 4096, STEP, SIGNALS, STATUS, RECEIVED, ABORTS, 3, function=_compiled,
                         waits=WAITS)


def test_signal_and_wait_passes_the_rawkernel_bytes_on_the_callers_stream(launches):
    stores = _transport(PEERS)
    stores.signal_and_wait(0xBEEF, 1, SEND, 2.5)
    stores.signal_and_wait(0xCAFE, 2, None, 0.25)  # a combine after a dispatch: the per-call slots are rewritten
    stores.signal_and_wait(0xCAFE, 3, None, 0.25, measured=False)  # a close: its wait adds no statistics
    for (name, grid, block, shared, stream, got, extra), (kind, counts, words, received, timeout_s, on, waits) in zip(
            launches, [(1, SEND, WORDS, RECEIVED, 2.5, 0xBEEF, WAITS), (2, None, 0, None, 0.25, 0xCAFE, WAITS),
                       (3, None, 0, None, 0.25, 0xCAFE, None)]):
        want = _rawkernel_bytes((PEERS, np.int32(R), np.int32(1), np.int64(64), STEP, np.int32(kind),
                                 counts or np.uint64(0), np.int64(4096), np.int32(words), SIGNALS,
                                 np.uint64(int(timeout_s * 1e9)), STATUS, received or np.uint64(0), ABORTS,
                                 np.int32(64), waits or np.uint64(0)))
        assert (name, grid, block, shared, stream, extra) == ("signal_and_wait", (1, 1, 1), (128, 1, 1), 0, on, 0)
        assert got == want


def test_wait_signals_alone_passes_its_rawkernel_bytes(launches):
    """The wait after a ``send_signal`` (a split step's hook, or a step that also signals through puts): its own
    parameters, the count words zeroed for a missing rank only when the step exchanged counts."""
    stores = _transport(PEERS)
    stores.wait_signals(7, 1, True, 1.0)
    stores.wait_signals(7, 3, False, 1.0)
    assert [(name, block[0], stream) for name, _, block, _, stream, _, _ in launches] == [
        ("wait_signals", 128, 7), ("wait_signals", 128, 7)]
    for (*_, got, _), (kind, received, words) in zip(launches, [(1, RECEIVED, WORDS), (3, None, 0)]):
        assert got == _rawkernel_bytes((SIGNALS, np.int32(R), np.int32(1), STEP, np.int32(kind), np.uint64(10 ** 9),
                                        STATUS, received or np.uint64(0), np.int32(words), ABORTS, np.int32(64),
                                        WAITS))


def test_a_split_step_on_peer_stores_signals_without_waiting_then_waits(launches):
    """The send half of a split step (``return_recv_hook=True``) launches ``send_signal``, which takes no wait
    parameter, with the bytes of ``signal_and_wait``'s signal part; the hook launches ``wait_signals``, zeroing a
    missing rank's count words when the step exchanged counts; the slots of one launch do not leak into another."""
    stores = _transport(PEERS)
    stores.send_signal(0xBEEF, 1, SEND)
    stores.wait_signals(0xCAFE, 1, True, 2.5)
    stores.send_signal(0xBEEF, 2, None)
    stores.signal_and_wait(0xBEEF, 3, None, 0.5)
    stores.wait_signals(0xCAFE, 2, False, 0.25)
    assert [(name, grid, block[0], stream) for name, grid, block, _, stream, _, _ in launches] == [
        ("send_signal", (1, 1, 1), 128, 0xBEEF), ("wait_signals", (1, 1, 1), 128, 0xCAFE),
        ("send_signal", (1, 1, 1), 128, 0xBEEF), ("signal_and_wait", (1, 1, 1), 128, 0xBEEF),
        ("wait_signals", (1, 1, 1), 128, 0xCAFE)]
    for i, (kind, counts, words) in zip((0, 2), [(1, SEND, WORDS), (2, None, 0)]):
        assert launches[i][5] == _rawkernel_bytes((PEERS, np.int32(R), np.int32(1), np.int64(64), STEP, np.int32(kind),
                                                   counts or np.uint64(0), np.int64(4096), np.int32(words)))
    for i, (kind, received, words, timeout_s) in zip((1, 4), [(1, RECEIVED, WORDS, 2.5), (2, None, 0, 0.25)]):
        assert launches[i][5] == _rawkernel_bytes((SIGNALS, np.int32(R), np.int32(1), STEP, np.int32(kind),
                                                   np.uint64(int(timeout_s * 1e9)), STATUS, received or np.uint64(0),
                                                   np.int32(words), ABORTS, np.int32(64), WAITS))
    assert launches[3][5][6:9] == _rawkernel_bytes((np.uint64(0), np.int64(4096), np.int32(0)))


def test_a_send_block_of_the_wrong_width_is_refused_before_the_launch(launches):
    with pytest.raises(ValueError, match=r"counts has shape \(3, 2\): must be \[R, 1 \+ L \+ 2\] = \(3, 5\)"):
        _transport(PEERS).signal_and_wait(0, 1, _DeviceArray(0x70000, (R, 2)), 1.0)
    assert launches == []


def test_a_failed_launch_names_the_kernel_and_the_result(monkeypatch):
    monkeypatch.setattr(raw, "driver_launch", raw._bindings_launch)  # cuda.bindings' launch, its result refused
    monkeypatch.setattr(raw, "cuLaunchKernel", lambda *args: (raw.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel of kernel send_signal \(grid=1, block=128, shared_bytes=0\) failed: returned .*INVALID_VALUE"):
        _transport(PEERS).send_signal(0, 1, None)


INBOX_STEP, INBOX_SIGNALS = _DeviceArray(0x90000, (1,)), _DeviceArray(0xA0000, (R,))


def test_the_inbox_signal_sends_the_step_word_without_advancing_the_step_counter(launches):
    """Forwarding's inbox signal (``InboxSignals``): the step counter copied into the inbox's own counter on the
    stream first, then ``send_signal`` over the inbox's signal offset with that counter (its ``step[0] += 1`` gives
    the step's number there, the Buffer's counter stays), no count words; the inbox wait: ``wait_signals`` over this
    rank's inbox signal words and the inbox counter, the Buffer's status record and abort records, no count words to
    zero; a measured inbox wait adds to the Buffer's wait statistics, an unmeasured one passes none."""
    inbox = InboxSignals(PEERS, R, 1, 8192, STEP, INBOX_STEP, INBOX_SIGNALS, STATUS, ABORTS, 3, waits=WAITS,
                         copy_step=lambda dst, src: launches.append(("copy", dst, src)), function=_compiled)
    inbox.signal(0xBEEF, 1)
    inbox.wait(0xBEEF, 1, 2.5, True)
    inbox.signal(0xCAFE, 2)
    inbox.wait(0xCAFE, 2, 2.5, False)
    assert [(e[0], e[4]) if e[0] != "copy" else e for e in launches] == [
        ("copy", INBOX_STEP, STEP), ("send_signal", 0xBEEF), ("wait_signals", 0xBEEF), ("copy", INBOX_STEP, STEP),
        ("send_signal", 0xCAFE), ("wait_signals", 0xCAFE)]
    for i, kind in ((1, 1), (4, 2)):
        assert launches[i][5] == _rawkernel_bytes((PEERS, np.int32(R), np.int32(1), np.int64(8192), INBOX_STEP,
                                                   np.int32(kind), np.uint64(0), np.int64(0), np.int32(0)))
    for i, kind, waits in ((2, 1, WAITS), (5, 2, np.uint64(0))):
        assert launches[i][5] == _rawkernel_bytes((INBOX_SIGNALS, np.int32(R), np.int32(1), INBOX_STEP, np.int32(kind),
                                                   np.uint64(int(2.5e9)), STATUS, np.uint64(0), np.int32(0), ABORTS,
                                                   np.int32(64), waits))


def test_a_forwarding_transport_measures_its_steps_at_the_inbox_wait():
    """Which waits add to the wait statistics (``measured_wait``): a dispatch's and a combine's, never the close
    step's nor any while not measuring; a flat transport's step waits; a forwarding one's inbox wait instead of its
    step's final wait (each peer once per step, at its inbox signal, as the mpi backend measures)."""
    kinds = {kind: STEP_KINDS[kind] for kind in ("dispatch", "combine")}
    for kind in kinds.values():
        assert measured_wait(True, kind, forwarding=False, inbox=False)
        assert not measured_wait(True, kind, forwarding=True, inbox=False)
        assert measured_wait(True, kind, forwarding=True, inbox=True)
        assert not measured_wait(False, kind, forwarding=True, inbox=True)
        assert not measured_wait(False, kind, forwarding=False, inbox=False)
    for forwarding in (False, True):
        assert not measured_wait(True, STEP_KINDS["close"], forwarding, inbox=False)


def test_the_inbox_reaches_ranks_through_peer_views_only():
    """The inbox's stores need a peer view of every rank signalled (the inbox's puts are not built): the addresses
    of those ranks, 0 for the others; a rank without a peer view is refused, named."""
    assert inbox_peer_pointers([0x100, 0x200, 0x300, 0x400], [0, 1, 3]) == [0x100, 0x200, 0, 0x400]
    assert inbox_peer_pointers([0x100, None, 0x300], [0, 2]) == [0x100, 0, 0x300]
    with pytest.raises(ValueError, match=r"^forwarding=True: ranks \[1, 3\] are not in load/store reach \(no peer "
                                         r"view\).*inbox's puts .* are not built"):
        inbox_peer_pointers([0x100, None, 0x300, None], [0, 1, 2, 3])
