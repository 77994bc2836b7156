"""Host-side logic of the nvshmem backend that runs without a GPU: heap sizing, device choice,
wait-status decoding, the error when the GPU stack is missing, and the backend's whole call
sequence (kernels in the Numba CUDA simulator, a loopback transport on one rank) against the
mpi backend, bit for bit, for peer stores and for the puts staging layout."""

import numpy as np
import pytest
from helpers.fake_gpu import simulated_backend
from mpi4py import MPI

from ep_comm.backends import make_backend
from ep_comm.backends.aborts import REASON_BYTES, decode, encode
from ep_comm.backends.collective_steps import STEP_KINDS, Steps, step_word
from ep_comm.backends.interface import Backend, BackendSettings, CombineRequest, DispatchRequest
from ep_comm.backends.mpi import MpiBackend
from ep_comm.backends.nvshmem import NvshmemBackend
from ep_comm.contract import layout as ref
from ep_comm.contract.checks import topk_values, verdict_words
from ep_comm.contract.choices import payload_dtype
from ep_comm.contract.geometry import Geometry
from ep_comm.contract.symmetric import ABORT_WORDS
from ep_comm.errors import BufferUnusableError, PeerAbortedError
from ep_comm.kernels.numba_internals import ENABLE_CUDASIM as SIMULATED
from ep_comm.testing.routing import mask_routing, uniform_routing
from ep_comm.transport.nvshmem_heap import HEAP_ENV, heap_size_for, parse_size, pick_device
from ep_comm.transport.signals import STATUS_FLAGS, read_status


@pytest.mark.parametrize("text, value", [("1024", 1024), ("20m", 20 << 20), ("2G", 2 << 30), ("0.5k", 512),
                                         ("3.1M", 3250586), (" 1t ", 1 << 40)])
def test_parse_size_follows_nvshmem_suffixes(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_garbage_naming_the_variable():
    with pytest.raises(ValueError, match=HEAP_ENV):
        parse_size("lots")


def test_heap_size_default_is_at_least_nvshmem_default_and_fits_the_buffer():
    size, export = heap_size_for(10 << 20, None)
    assert export and size == 1 << 30
    size, export = heap_size_for(3 << 30, None)
    assert export and size >= (3 << 30) + (64 << 20) and size % (2 << 20) == 0


def test_heap_size_keeps_a_user_value_that_fits_and_refuses_one_that_does_not():
    assert heap_size_for(100 << 20, "4g") == (4 << 30, False)
    with pytest.raises(ValueError, match=f"{HEAP_ENV}='200m'.*too small"):
        heap_size_for(300 << 20, "200m")


@pytest.mark.parametrize("local_rank, visible, device", [(0, 1, 0), (5, 1, 0), (3, 8, 3), (9, 8, 1), (1, 2, 1)])
def test_pick_device_by_local_rank_unless_one_device_is_visible(local_rank, visible, device):
    assert pick_device(local_rank, visible) == device


def test_pick_device_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        pick_device(0, 0)


def test_read_status_reports_sticky_missing_ranks_and_posted_abort_records():
    words = [13, 0, 0, 0, 0, 0, 0, 0]
    outcome = read_status(words, 3)
    assert outcome.missing_ranks == [] and outcome.last_seq == 13 and outcome.aborted_ranks == []
    words = [17, 2, 1, 0, 1, 0, 0, 1]
    assert read_status(words, 3).missing_ranks == [0, 2] and read_status(words, 3).aborted_ranks == [2]
    assert STATUS_FLAGS == 2


def test_nvshmem_backend_without_gpu_stack_names_what_is_missing():
    try:
        import cupy  # noqa: F401
        import nvshmem.core  # noqa: F401

        pytest.skip("the GPU stack is installed here")
    except ImportError:
        pass
    geo = Geometry(1, 2, 8, 1, 4, payload_dtype("float32"))
    with pytest.raises(RuntimeError, match="backend='nvshmem' needs CuPy and nvshmem4py"):
        make_backend("nvshmem", MPI.COMM_SELF, geo, BackendSettings(True, 1.0))


def test_open_refuses_indices_past_32_bits_before_allocating_anything():
    """The kernels index in 32 bits: a geometry past that is refused before the collective heap allocation."""
    def allocate(*args, **kwargs):
        raise AssertionError("the transport was built before the index range was checked")

    geo = Geometry(1024, 1024, 8, 6, 2**17, payload_dtype("bfloat16"))
    with pytest.raises(ValueError, match=r"= 1024 \* 131072 \* \(6 \+ 2\) = 1073741824: must be below 2\*\*30"):
        NvshmemBackend.open(MPI.COMM_SELF, geo, BackendSettings(True, 1.0), allocate, allocate)


def test_step_words_are_monotone_and_tell_kinds_apart():
    assert max(STEP_KINDS.values()) < 4 and len(set(STEP_KINDS.values())) == len(STEP_KINDS)
    words = [step_word(seq, kind) for seq in range(1, 5) for kind in STEP_KINDS]
    assert words == sorted(words) and len(set(words)) == len(words)
    assert all(step_word(seq, kind) < (seq + 1) << 2 for seq in range(1, 5) for kind in STEP_KINDS)


def test_abort_records_round_trip_and_cut_long_reasons():
    table = np.zeros((3, ABORT_WORDS), np.int64)
    assert decode(table) == []
    table[2] = encode("combine", 4, "timed out after 3 s waiting for ranks [0]")
    table[0] = encode("", 0, "x" * (REASON_BYTES + 10))
    assert decode(table) == [(0, "construction", "x" * REASON_BYTES),
                             (2, "combine #4", "timed out after 3 s waiting for ranks [0]")]


# ------------------------------------------------------------ the call sequence in the simulator
def dispatch(be, x, topk_idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync, stats):
    """``be.dispatch`` of the request ``Buffer.dispatch`` makes (a replay sends the handle's routing)."""
    idx = topk_idx if handle is None else handle.topk_idx
    return be.dispatch(DispatchRequest(x, idx, topk_weights, handle, expand, alignment, zero_padding, cpu_sync, stats))


def combine(be, y, handle, topk_weights, bias_terms):
    """``be.combine`` of the request ``Buffer.combine`` makes."""
    return be.combine(CombineRequest(y, handle, topk_weights, tuple(bias_terms)))


def _same(name, a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None, name
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{name}: shape {a.shape} (mpi) != {b.shape} (nvshmem)"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b.astype(a.dtype)).tobytes(), \
        f"{name}: differs\nmpi={a}\nnvshmem={b}"


def _defined_rows(out, handle):
    """recv_x rows the contract defines: the received (and zeroed padding) rows, not the worst-case tail."""
    rows = int(handle.num_expanded_tokens if handle.expand else handle.num_recv_tokens)
    return np.asarray(out.recv_x)[:rows]


def _compare(tag, om, on) -> None:
    _same(f"{tag} recv_x", _defined_rows(om, om.handle), _defined_rows(on, on.handle))
    _same(f"{tag} recv_topk_idx", om.recv_topk_idx, on.recv_topk_idx)
    _same(f"{tag} recv_topk_weights", om.recv_topk_weights, on.recv_topk_weights)
    hm, hn = om.handle, on.handle
    for field in ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                  "num_recv_tokens", "num_expanded_tokens", "num_out_rows", "is_token_in_rank"):
        _same(f"{tag} handle.{field}", getattr(hm, field), getattr(hn, field))
    _same(f"{tag} handle.num_recv_tokens_per_expert", np.asarray(hm.num_recv_tokens_per_expert),
          np.asarray(hn.num_recv_tokens_per_expert))
    assert isinstance(hn.num_recv_tokens_per_expert, list) == hm.cpu_sync


CASES = [  # dtype, expand, alignment, cpu_sync, weighted, bias terms, use_puts
    ("bfloat16", False, 1, True, True, 2, False),
    ("float32", True, 4, True, True, 0, False),
    ("float16", True, 2, False, False, 1, False),
    ("bfloat16", False, 1, False, False, 0, True),
    ("bfloat16", True, 3, True, True, 0, True),
]


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("dtype, expand, alignment, cpu_sync, weighted, bias, use_puts", CASES)
def test_call_sequence_matches_the_mpi_backend(dtype, expand, alignment, cpu_sync, weighted, bias, use_puts):
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype(dtype))
    rng = np.random.default_rng(hash((dtype, expand, alignment)) % 1000)
    tokens = 7
    idx = mask_routing(uniform_routing(tokens, geo.num_experts, geo.num_topk, seed=rng).topk_idx, rng,
                       entry_rate=0.25, first_tokens=1)
    x = rng.standard_normal((tokens, geo.hidden)).astype(geo.dtype)
    w = rng.random((tokens, geo.num_topk)).astype(np.float32) if weighted else None
    terms = tuple(rng.standard_normal((tokens, geo.hidden)).astype(np.float32) for _ in range(bias))
    mpi = MpiBackend(MPI.COMM_SELF, geo, BackendSettings(True, 5.0))
    nv = simulated_backend(geo, True, use_puts)
    stats_m, stats_n = np.zeros(6, np.int64), np.zeros(6, np.int64)
    for got, want in zip(nv.dispatch_layout(idx), mpi.dispatch_layout(idx)):
        _same("dispatch_layout", want, got)
    args = (expand, alignment, True, cpu_sync)
    om = dispatch(mpi, x, idx, w, None, *args, stats_m)
    on = dispatch(nv, x, idx, w, None, *args, stats_n)
    _compare("dispatch", om, on)
    x2 = (x.astype(np.float32) * 2 + 1).astype(x.dtype)
    for replay_sync in (True, False):  # a cached dispatch, with the same and the other cpu_sync
        rm = dispatch(mpi, x2, None, w, om.handle, *args[:3], replay_sync, stats_m)
        rn = dispatch(nv, x2, None, w, on.handle, *args[:3], replay_sync, stats_n)
        _compare(f"replay cpu_sync={replay_sync}", rm, rn)
    _same("stats", stats_m, stats_n)
    for om_, on_ in ((om, on), (rm, rn)):
        yw_m = om_.recv_topk_weights if weighted else None
        yw_n = on_.recv_topk_weights if weighted else None
        cm = combine(mpi, om_.recv_x, om_.handle, yw_m, terms)
        cn = combine(nv, on_.recv_x, on_.handle, yw_n, terms)
        _same("combine.x", cm.x, cn.x)
        _same("combine.topk_weights", cm.topk_weights, cn.topk_weights)
    nv.close()
    mpi.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_peer_abort_record_is_raised_by_the_next_call_and_close_releases_locally():
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))
    nv = simulated_backend(geo, True, False)
    transport = nv.transport
    x = np.ones((4, geo.hidden), np.float32)
    idx = uniform_routing(4, geo.num_experts, geo.num_topk, seed=1).topk_idx
    out = dispatch(nv, x, idx, None, None, False, 1, False, True, None)
    transport.aborts[0] = encode("dispatch", 2, "timed out after 3 s waiting for ranks [1]")  # as a peer posts it
    with pytest.raises(PeerAbortedError, match=r"rank 0: cannot dispatch: rank 0 gave up at dispatch #2 "
                                               r"\(timed out after 3 s waiting for ranks \[1\]\)") as info:
        dispatch(nv, x, idx, None, None, False, 1, False, True, None)
    assert info.value.records == ((0, "dispatch #2", "timed out after 3 s waiting for ranks [1]"),)
    with pytest.raises(BufferUnusableError, match="rank 0 gave up at dispatch #2"):
        combine(nv, out.recv_x, out.handle, None, ())
    nv.close()
    assert transport.closed_collectively is False and nv.transport is None


class _OnGpu1(np.ndarray):
    """A device array that says it lives on GPU 1 (as a CuPy array there would)."""

    device = type("Gpu1", (), {"id": 1})()


def test_arrays_on_another_gpu_are_refused_naming_both_gpus():
    be = simulated_backend(Geometry(1, 6, 12, 3, 9, payload_dtype("float32")), False, False)
    be.transport.device = 0
    with pytest.raises(ValueError, match=r"x is on GPU 1: this rank's Buffer works on GPU 0"):
        be.as_array(np.zeros((2, 12), np.float32).view(_OnGpu1), "x")
    mine = np.zeros((2, 12), np.float32)
    assert be.as_array(mine, "x") is mine


CAPTURE_GEO = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))
CAPTURE_IDX = np.array([[0, 1, -1], [2, -1, -1], [4, 5, 3]], np.int64)


def test_only_host_free_steps_may_be_captured_and_a_refusal_leaves_the_buffer_usable():
    be = simulated_backend(CAPTURE_GEO, False, False)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    out = dispatch(be, x, CAPTURE_IDX, None, None, False, 1, False, True, None)
    be.device.capturing_now = True
    with pytest.raises(RuntimeError, match="topk_idx has dtype uint8: a dispatch captured into a CUDA graph needs "
                                           "signed expert ids"):
        be.routing_summary(CAPTURE_IDX.astype(np.uint8))
    with pytest.raises(RuntimeError, match=r"captured into a CUDA graph, and it waits on the host \(cpu_sync=True"):
        dispatch(be, x, CAPTURE_IDX, None, None, False, 1, False, True, None)
    with pytest.raises(RuntimeError, match=r"captured into a CUDA graph, and it waits on the host \(cpu_sync=True"):
        dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    with pytest.raises(RuntimeError, match="combine was called while .* waits on the host"):
        combine(be, out.recv_x, out.handle, None, ())
    assert be.steps.seq == 1 and int(be.transport.step[0]) == 1 and not be.steps.unusable
    be.device.capturing_now = False
    again = dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    np.testing.assert_array_equal(again.recv_x, out.recv_x)
    puts = simulated_backend(CAPTURE_GEO, False, True)
    first = dispatch(puts, x, CAPTURE_IDX, None, None, False, 1, False, False, None)
    puts.device.capturing_now = True
    with pytest.raises(RuntimeError, match=r"puts transport \(Buffer\(transport='puts'\)\)"):
        dispatch(puts, x, None, None, first.handle, False, 1, False, False, None)


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_captured_dispatch_with_a_bad_routing_is_reported_by_the_next_call_and_receives_nothing():
    """The bad id is read as "no expert" (nothing written out of bounds), and the verdict that travels with the
    count exchange empties the receive: only the -1 tails of the worst-case outputs are written."""
    geo = CAPTURE_GEO
    be = simulated_backend(geo, True, False)
    x = np.arange(3 * geo.hidden, dtype=np.float32).reshape(3, geo.hidden)
    bad = CAPTURE_IDX.copy()
    bad[1, 1] = 40  # past the 6 experts: read as "no expert" by the kernels
    be.device.capturing_now = True
    with be.captured_memory():
        assert be.routing_summary(bad) == (-1, -1)  # nothing can be read back under capture
        captured = dispatch(be, x, bad, None, None, False, 1, False, False, None)
    be.device.capturing_now = False
    assert be.capture.held, "the captured call's allocations are held for the graph"
    with pytest.raises(ValueError, match="replayed from a CUDA graph was given a topk_idx holding expert id 40"):
        dispatch(be, x, None, None, captured.handle, False, 1, False, False, None)
    assert not be.steps.unusable
    assert (captured.recv_topk_idx == -1).all() and (captured.handle.recv_src_metadata == -1).all()
    assert be.routing_summary(CAPTURE_IDX) == (5, -1)  # reported once: the record was cleared


def _eager_replay(expand: bool, seed: int) -> tuple:
    """``(backend, x, first, eager, eager_sum)``: a simulated backend of ``CAPTURE_GEO``, 3 tokens ``x`` (float32),
    the dispatch ``first`` of ``CAPTURE_IDX``, an eager cached ``cpu_sync=False`` replay of ``x * 2`` and its combine
    (what a captured replay must give)."""
    be = simulated_backend(CAPTURE_GEO, True, False)
    x = np.random.default_rng(seed).standard_normal((3, CAPTURE_GEO.hidden)).astype(np.float32)
    first = dispatch(be, x, CAPTURE_IDX, None, None, expand, 2, True, True, None)
    eager = dispatch(be, x * 2, None, None, first.handle, expand, 2, True, False, None)
    return be, x, first, eager, combine(be, eager.recv_x, eager.handle, None, ())


def _same_as_eager(first, eager, eager_sum, captured, captured_sum) -> None:
    """A captured replay's received rows (those ``first`` received), ids and combine equal the eager replay's."""
    rows = int(first.handle.num_expanded_tokens if first.handle.expand else first.handle.num_recv_tokens)
    np.testing.assert_array_equal(captured.recv_x[:rows], eager.recv_x[:rows])
    np.testing.assert_array_equal(captured.recv_topk_idx, eager.recv_topk_idx)
    np.testing.assert_array_equal(captured_sum.x, eager_sum.x)


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True])
def test_a_captured_cached_dispatch_and_combine_give_the_eager_results(expand):
    be, x, first, eager, eager_sum = _eager_replay(expand, seed=3)
    be.device.capturing_now = True
    captured = dispatch(be, x * 2, None, None, first.handle, expand, 2, True, False, None)
    captured_sum = combine(be, captured.recv_x, captured.handle, None, ())
    be.device.capturing_now = False
    _same_as_eager(first, eager, eager_sum, captured, captured_sum)
    np.testing.assert_array_equal(captured.handle.num_recv_tokens_per_expert, first.handle.num_recv_tokens_per_expert)
    assert int(captured.handle.num_expanded_tokens) == int(first.handle.num_expanded_tokens)
    be.close()
    assert not be.capture.held


def _launch_log(monkeypatch) -> list:
    """Every kernel launch's grid and non-array arguments, in order."""
    from ep_comm.launching import bound

    log, launch = [], bound.BoundLaunch.__call__

    def recording(self, grid, block, stream, shared_bytes, *args):
        scalars = tuple(a if isinstance(a, (bool, int, float, np.integer, np.floating)) else type(a).__name__
                        for a in args)
        log.append((self.dispatcher.__name__, grid, block, shared_bytes, scalars))
        return launch(self, grid, block, stream, shared_bytes, *args)

    monkeypatch.setattr(bound.BoundLaunch, "__call__", recording)
    return log


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [True, False], ids=["expand", "compact"])
def test_the_launches_of_a_step_do_not_depend_on_the_step_number(monkeypatch, expand):
    """What a CUDA graph replay relies on: a cached dispatch launches the same kernels with the same
    shapes and scalars at an even step as at an odd one, and so does a combine (the buffer parity
    comes from the device step counter). Compact mode writes the rank's own rows straight into
    ``recv_x`` and reads its own partials from ``y``: the same at every step too."""
    be = simulated_backend(CAPTURE_GEO, True, False)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    first = dispatch(be, x, CAPTURE_IDX, None, None, expand, 2 if expand else 1, False, False, None)
    log = _launch_log(monkeypatch)

    def launches(call) -> list:
        start = len(log)
        call()
        return log[start:]

    dispatches = [launches(lambda: dispatch(be, x, None, None, first.handle, expand, 2 if expand else 1, False,
                                            False, None))
                  for _ in range(2)]
    combines = [launches(lambda: combine(be, first.recv_x, first.handle, None, ())) for _ in range(2)]
    assert dispatches[0] and dispatches[0] == dispatches[1]
    assert combines[0] and combines[0] == combines[1]
    assert int(be.transport.step[0]) == 5


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_new_routing_exchanges_counts_per_local_expert_and_compact_counts_from_them_alone(monkeypatch, expand):
    """A new routing's count exchange leaves, per source, its rows then its entries per local expert (the
    reference's ``send_count_words``), then its routing verdict's words, in the count words of the step's
    parity; a compact receive counts from
    those words alone (``receive_count_words_kernel``, no scan of the meta rows), an expand one scans the
    meta rows (``receive_count_kernel``); the launches are the same at an odd step as at an even one."""
    be = simulated_backend(CAPTURE_GEO, True, False)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    counts = ref.send_count_words(ref.dispatch_layout(CAPTURE_IDX, CAPTURE_GEO.num_experts, 1))
    want = np.append(counts, [verdict_words(*topk_values(np, CAPTURE_IDX))], axis=1)
    log = _launch_log(monkeypatch)
    steps = []
    for _ in range(2):
        start = len(log)
        dispatch(be, x, CAPTURE_IDX, None, None, expand, 2, False, False, None)
        steps.append(log[start:])
        np.testing.assert_array_equal(be.transport.own.counts[int(be.transport.step[0]) % 2], want)
    names = {launch[0] for launch in steps[0]}
    assert ("receive_count_words_kernel" in names) != expand and ("receive_count_kernel" in names) == expand
    assert steps[0] == steps[1]
    be.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True])
def test_non_contiguous_inputs_give_the_results_of_contiguous_ones(expand):
    """Strided views and Fortran-order arrays (as slicing or a transpose hands them over) are read as
    the arrays they show: x, topk_idx, topk_weights, the combine's y and its weights."""
    geo = Geometry(1, 6, 12, 3, 9, payload_dtype("float32"))
    rng = np.random.default_rng(21)
    wide_x = rng.standard_normal((4, 2 * geo.hidden)).astype(np.float32)
    x = wide_x[:, ::2]
    idx = np.asfortranarray(np.array([[0, 4, -1], [5, 1, 2], [-1, -1, 3], [2, 0, 5]], np.int64))
    w = rng.random((4, 2 * geo.num_topk)).astype(np.float32)[:, 1::2]
    assert not (x.flags.c_contiguous or idx.flags.c_contiguous or w.flags.c_contiguous)
    args = (expand, 2, True, True, None)
    want_be, got_be = simulated_backend(geo, True, False), simulated_backend(geo, True, False)
    want = dispatch(want_be, np.ascontiguousarray(x), np.ascontiguousarray(idx), np.ascontiguousarray(w), None, *args)
    got = dispatch(got_be, x, idx, w, None, *args)
    _compare("non-contiguous dispatch", want, got)
    y = np.repeat(got.recv_x, 2, axis=1)[:, ::2]
    y_weights = np.repeat(got.recv_topk_weights, 2, axis=-1)[..., ::2]
    want_sum = combine(want_be, want.recv_x, want.handle, want.recv_topk_weights, ())
    got_sum = combine(got_be, y, got.handle, y_weights, ())
    _same("non-contiguous combine.x", want_sum.x, got_sum.x)
    _same("non-contiguous combine.topk_weights", want_sum.topk_weights, got_sum.topk_weights)


def test_the_simulated_nvshmem_backend_is_a_backend_with_its_transport_named():
    stores = simulated_backend(CAPTURE_GEO, False, False)
    puts = simulated_backend(CAPTURE_GEO, False, True)
    assert isinstance(stores, Backend) and isinstance(puts, Backend)
    assert (stores.transport_name, puts.transport_name, stores.num_sms) == ("stores", "puts", 1)


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_the_nvshmem_profile_table_times_every_phase_of_the_call_sequence():
    be = simulated_backend(CAPTURE_GEO, True, False, profile=True)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    out = dispatch(be, x, CAPTURE_IDX, None, None, False, 1, False, True, None)
    dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    combine(be, out.recv_x, out.handle, None, ())
    rows = {(row.op, row.phase): row for row in be.profile_table()}
    assert rows["dispatch", "total"].calls == 2 and rows["dispatch", "count"].calls == 1
    assert {("dispatch", p) for p in ("scatter", "signal+wait", "receive_count", "host sync", "alloc outputs",
                                      "receive_copy")} <= set(rows)
    assert {("combine", p) for p in ("total", "send", "signal+wait", "reduce", "host sync")} <= set(rows)
    assert all(row.host_us_p50 > 0 and row.gpu_us_p50 is None for row in rows.values())  # no events on the host
    be.close()


class _CountingBoard:
    """An abort board that counts its device reads."""

    def __init__(self, num_ranks: int):
        self.table = np.zeros((num_ranks, ABORT_WORDS), np.int64)
        self.reads = 0
        self.posted = []

    def post_abort(self, record) -> None:
        self.posted.append(record)

    def abort_table(self):
        self.reads += 1
        return self.table


def _nothing(seq: int) -> int:
    return seq


def test_a_step_reads_the_abort_records_on_entry_only_when_asked():
    """``Steps.run(read_board=False)`` (a ``cpu_sync=False`` step whose last wait saw no record) reads no record;
    ``read_board=True`` reads them and raises a peer's record before the step's body runs."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    board.table[1] = encode("combine", 1, "timed out after 3 s waiting for ranks [0]")
    assert steps.run("dispatch", False, _nothing) == 1 and board.reads == 0
    ran = []
    with pytest.raises(PeerAbortedError, match=r"rank 0: cannot combine: rank 1 gave up at combine #1"):
        steps.run("combine", True, ran.append)
    assert board.reads == 1 and steps.unusable and not ran and not board.posted
    with pytest.raises(BufferUnusableError, match="cannot dispatch: rank 1 gave up at combine #1"):
        steps.run("dispatch", False, ran.append)
    assert board.reads == 1 and not ran


def test_a_step_whose_body_raises_leaves_the_buffer_unusable_and_posts_its_record():
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)

    def fails(seq: int, what: str) -> None:
        raise RuntimeError(f"{what} at step {seq}")

    with pytest.raises(RuntimeError, match="kernel at step 1"):
        steps.run("dispatch", False, fails, "kernel")
    assert steps.unusable == "dispatch #1 failed midway" and len(board.posted) == 1
    assert decode(np.stack([board.posted[0], np.zeros(ABORT_WORDS, np.int64)])) == [
        (0, "dispatch #1", "failed midway (RuntimeError: kernel at step 1)")]
    with pytest.raises(BufferUnusableError, match="cannot combine: dispatch #1 failed midway"):
        steps.run("combine", True, _nothing)
    assert steps.seq == 1


def test_the_receive_part_of_a_split_step_is_guarded_as_a_whole_step():
    """``Steps.run`` numbers a split step and runs its send part, which returns the receive part;
    ``Steps.resume`` runs that later: a clean one returns its value, a failing one marks the buffer unusable and
    posts the record of that step, as a failing body does."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    receive = steps.run("dispatch", False, lambda seq: lambda scale: seq * scale)
    assert steps.latest == "dispatch #1" and steps.resume("dispatch", receive, 10) == 10 and not steps.unusable

    def fails(reason: str) -> None:
        raise RuntimeError(reason)

    assert steps.run("combine", False, lambda seq: fails) is fails and steps.latest == "combine #1"
    with pytest.raises(RuntimeError, match="lost"):
        steps.resume("combine", fails, "lost")
    assert steps.unusable == "combine #1 failed midway"
    assert decode(np.stack([board.posted[0], np.zeros(ABORT_WORDS, np.int64)])) == [
        (0, "combine #1", "failed midway (RuntimeError: lost)")]


def test_a_wait_every_rank_arrived_at_reads_the_abort_records_only_when_it_saw_one():
    """``Steps.after_wait``: no device read when every rank arrived and the wait saw no record (the nvshmem
    wait kernel's mapped status); a read when the wait saw one, or when a rank is missing."""
    board = _CountingBoard(2)
    steps = Steps(0, 3.0, board)
    steps.run("dispatch", False, lambda seq: steps.after_wait("dispatch", [], seen=False))
    assert board.reads == 0 and not steps.unusable
    board.table[1] = encode("dispatch", 1, "failed midway")
    with pytest.raises(PeerAbortedError, match=r"rank 0: dispatch #1: rank 1 gave up at dispatch #1"):
        steps.after_wait("dispatch", [], seen=True)
    assert board.reads == 1
    board.table[1], board.reads = 0, 0
    late = Steps(0, 3.0, board)
    with pytest.raises(TimeoutError, match=r"waiting for ranks \[1\]"):
        late.after_wait("dispatch", [1], seen=False)
    assert board.reads == 1


def _count_board_reads(transport) -> list:
    """Count the calls of ``transport.abort_table`` (the device reads of the abort records) in ``reads[0]``."""
    reads, table = [0], transport.abort_table

    def counted():
        reads[0] += 1
        return table()

    transport.abort_table = counted
    return reads


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_an_eager_step_reads_the_abort_records_only_when_the_mapped_status_shows_one():
    """No device read of the abort records by a clean ``cpu_sync=True`` dispatch, cached dispatch or combine (not on
    entry, not after the poll): the mapped status the GPU wait fills says whether there is one to read. A close reads
    them once, on entry (a peer that gave up is reported as "cannot close", without a wait)."""
    be = simulated_backend(CAPTURE_GEO, True, False)
    reads = _count_board_reads(be.transport)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    out = dispatch(be, x, CAPTURE_IDX, None, None, False, 1, False, True, None)
    dispatch(be, x, None, None, out.handle, False, 1, False, True, None)
    combine(be, out.recv_x, out.handle, None, ())
    assert reads[0] == 0
    be.close()
    assert reads[0] == 1 and be.transport is None


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_record_the_wait_saw_is_raised_after_the_host_wait():
    """A peer's record posted while this rank waits (the wait kernel copies it into the mapped status) makes
    the ``cpu_sync=True`` step raise ``PeerAbortedError`` after its host wait: the step's rows are not used."""
    be = simulated_backend(CAPTURE_GEO, True, False)
    transport = be.transport
    exchange = transport.exchange

    def peer_gives_up_meanwhile(*args):
        exchange(*args)
        transport.aborts[0] = encode("dispatch", 1, "failed midway")

    transport.exchange = peer_gives_up_meanwhile
    reads = _count_board_reads(transport)
    x = np.ones((3, CAPTURE_GEO.hidden), np.float32)
    with pytest.raises(PeerAbortedError, match=r"rank 0: dispatch #1: rank 0 gave up at dispatch #1"):
        dispatch(be, x, CAPTURE_IDX, None, None, False, 1, False, True, None)
    assert reads[0] == 1 and be.steps.unusable


@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_cached_pair_decides_on_the_symmetric_rows_once_per_buffer(monkeypatch, expand):
    """The 16-byte verdict (``wide_rows``) and the payload views of the Buffer's symmetric rows are made by the
    first calls and reused by every later cached dispatch and combine (launches stubbed: host work only)."""
    from ep_comm.launching import bound
    from ep_comm.launching import kernel_launches as launching

    geo = Geometry(1, 6, 16, 3, 9, payload_dtype("bfloat16"))
    be = simulated_backend(geo, True, False)
    monkeypatch.setattr(bound.BoundLaunch, "__call__", lambda self, *args: None)
    seen = []
    for name in ("wide_rows", "payload_rows"):
        made = getattr(launching, name)
        monkeypatch.setattr(launching, name, lambda *args, made=made: seen.append(args) or made(*args))
    symmetric = {id(a) for a in (*be.transport.rows, be._own_rows)}

    def on_symmetric_rows() -> int:
        """How many calls so far were made on the symmetric rows."""
        return sum(any(id(a) in symmetric for a in args) for args in seen)

    x = np.ones((3, geo.hidden), geo.dtype)
    first = dispatch(be, x, CAPTURE_IDX, None, None, expand, 1, False, False, None)
    combine(be, first.recv_x, first.handle, None, ())
    made = on_symmetric_rows()
    assert made > 0
    for _ in range(2):
        out = dispatch(be, x, None, None, first.handle, expand, 1, False, False, None)
        combine(be, out.recv_x, out.handle, None, ())
    assert on_symmetric_rows() == made and len(seen) > made


def _log_transport(transport, log: list) -> None:
    """Append the name of each signal/wait call of ``transport`` to ``log`` (beside the kernel launches)."""
    for name in ("exchange", "signal", "wait"):
        call = getattr(transport, name)
        setattr(transport, name, lambda *args, call=call, name=name: log.append(name) or call(*args))


def _split(be, request_of, send):
    """The send half of ``send`` (``be.dispatch_send`` / ``be.combine_send``) of ``request_of()``."""
    with be.captured_memory():
        return send(request_of())


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
@pytest.mark.parametrize("cpu_sync", [True, False], ids=["cpu_sync", "no_cpu_sync"])
def test_a_split_step_signals_without_waiting_and_its_hook_waits_then_receives(monkeypatch, expand, cpu_sync):
    """``dispatch_send`` / ``combine_send`` launch up to the signal and no wait; the hook launches the wait first,
    then the receive kernels; the outputs are the plain calls' bit for bit (new routing, replay, combine)."""
    geo = CAPTURE_GEO
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, geo.hidden)).astype(np.float32)
    w = rng.random((3, geo.num_topk)).astype(np.float32)
    plain_be, be = simulated_backend(geo, True, False), simulated_backend(geo, True, False)
    log = _launch_log(monkeypatch)
    _log_transport(be.transport, log)
    args = (expand, 2 if expand else 1, True, cpu_sync)
    plain = dispatch(plain_be, x, CAPTURE_IDX, w, None, *args, None)
    requests = [lambda: DispatchRequest(x, CAPTURE_IDX, w, None, *args, None),
                lambda: DispatchRequest(x * 2, plain.handle.topk_idx, w, plain.handle, *args, None)]
    wants = [plain, dispatch(plain_be, x * 2, None, w, plain.handle, *args, None)]
    for seq, (request_of, want) in enumerate(zip(requests, wants), start=1):
        start = len(log)
        half = _split(be, request_of, be.dispatch_send)
        sent = [entry if isinstance(entry, str) else entry[0] for entry in log[start:]]
        assert sent[-1] == "signal" and "wait" not in sent and "exchange" not in sent
        assert not any(name.startswith("receive") for name in sent), sent
        assert half.step == f"dispatch #{seq}"
        half.prepare()
        start = len(log)
        got = half.receive()
        hook = [entry if isinstance(entry, str) else entry[0] for entry in log[start:]]
        assert hook[0] == "wait" and "signal" not in hook and any(name.startswith("receive") for name in hook), hook
        _compare("hooked dispatch", want, got)
    y_w = plain.recv_topk_weights
    half = _split(be, lambda: CombineRequest(plain.recv_x, plain.handle, y_w, ()), be.combine_send)
    assert log[-1] == "signal"
    half.prepare()
    start = len(log)
    got = half.receive()
    assert log[start] == "wait"
    want = combine(plain_be, plain.recv_x, plain.handle, y_w, ())
    _same("hooked combine.x", want.x, got.x)
    _same("hooked combine.topk_weights", want.topk_weights, got.topk_weights)
    assert "exchange" not in log
    be.close()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
def test_a_hook_on_another_stream_waits_for_the_send_and_one_captured_unlike_its_send_is_refused():
    """The hook's stream waits for the event marked after the send when it is not the send's stream; a hook whose
    capture state differs from its send's raises before enqueuing anything and can be called afterwards."""
    geo = CAPTURE_GEO
    be = simulated_backend(geo, True, False)
    x = np.ones((3, geo.hidden), np.float32)
    request = DispatchRequest(x, CAPTURE_IDX, None, None, False, 1, False, False, None)
    half = be.dispatch_send(request)
    be.device.current_stream = 7
    be.device.capturing_now = True
    with pytest.raises(RuntimeError, match=r"^dispatch's receive hook was called while the current stream is being "
                                           r"captured, but its send was enqueued outside any CUDA graph capture"):
        half.prepare()
    assert not getattr(be.device, "waited", [])
    be.device.capturing_now = False
    half.prepare()
    assert be.device.waited == ["event 1"]
    be.device.current_stream = 0
    assert half.step == "dispatch #1"
    half.receive()
    captured = simulated_backend(geo, True, False)
    captured.device.capturing_now = True
    half = _split(captured, lambda: request, captured.dispatch_send)
    captured.device.capturing_now = False
    with pytest.raises(RuntimeError, match="is not being captured, but its send was captured into a CUDA graph"):
        half.prepare()


@pytest.mark.skipif(not SIMULATED, reason="runs the kernels in the Numba CUDA simulator")
@pytest.mark.parametrize("expand", [False, True], ids=["compact", "expand"])
def test_a_send_and_its_hook_captured_apart_hold_their_memory_and_give_the_eager_results(expand):
    """Send half and hook under capture (two graphs): each half's allocations are held for its graph (the send's
    the replay's outputs, the hook's the handle and what the receive allocates), and the results are the eager
    call's."""
    be, x, first, eager, eager_sum = _eager_replay(expand, seed=8)
    be.device.capturing_now = True
    request = DispatchRequest(x * 2, first.handle.topk_idx, None, first.handle, expand, 2, True, False, None)
    half = _split(be, lambda: request, be.dispatch_send)
    held = len(be.capture.held)
    assert held == 1
    half.prepare()
    captured = half.receive()
    assert len(be.capture.held) == held + 1
    half = _split(be, lambda: CombineRequest(captured.recv_x, captured.handle, None, ()), be.combine_send)
    half.prepare()
    captured_sum = half.receive()
    be.device.capturing_now = False
    assert len(be.capture.held) == held + 3
    _same_as_eager(first, eager, eager_sum, captured, captured_sum)
    be.close()
    assert not be.capture.held
