"""Run on every rank of ``mpirun -np N`` on GPUs: the nvshmem backend against the mpi backend.

Both backends run the same routings on the same inputs; every output, handle field and combine
result must match bit for bit (deterministic mode), and the nvshmem dispatch passes the shared checker
(``ep_comm.testing.check``) against every rank's inputs. Then: PyTorch tensors in (DLPack), a
non-deterministic buffer (combine still bit-exact), CUDA graph replays (each adding one round trip's scale-out rows of
``ep_comm.contract.traffic`` to ``Buffer.traffic()``), receive hooks (``return_recv_hook=True``:
eager, the hook on another stream, and send and hook captured into two graphs), and last a timeout: rank 1 skips
a dispatch,
rank 0 must raise ep_comm.TimeoutError naming rank 1, and everyone must get out without a hang.
Prints ``RANK r OK`` lines and exits non-zero on the first mismatch.

``--transport stores|puts|auto`` (default stores) and ``--scaleup-ranks N`` (virtual nodes of N ranks; default one
node): the nvshmem Buffers' ``transport`` and ``scaleup_ranks`` (``auto`` with nodes: stores in a node, puts between
them). Every check runs on every transport; the mpi reference is one node, or with ``--forwarding`` (the nvshmem
Buffers forward across the nodes: ``--transport auto`` only) the mpi backend forwarding in the same nodes.
"""
from __future__ import annotations

import argparse
import sys
import time

import cupy as cp
import ml_dtypes
import numpy as np
from mpi4py import MPI

import ep_comm
from ep_comm.bench.measure import captured
from ep_comm.contract import traffic
from ep_comm.contract.topology import Topology
from ep_comm.testing.check import DispatchOptions, HostDispatch, Sources, check_dispatch
from ep_comm.testing.dtypes import DTYPES
from ep_comm.testing.routing import make_routing, mask_routing

COMM = MPI.COMM_WORLD
RANK, WORLD = COMM.rank, COMM.size


def host(a):
    """NumPy copy of a CuPy/NumPy array or scalar (bfloat16 through its bits)."""
    if isinstance(a, cp.ndarray):
        if a.dtype.name == "bfloat16":
            return a.view(cp.uint16).get()
        return a.get()
    if isinstance(a, np.ndarray) and a.dtype.name == "bfloat16":
        return a.view(np.uint16)
    return np.asarray(a) if a is not None else None


def same(name: str, a, b) -> None:
    """Exact equality of values, shapes and dtypes' bytes (``a`` from mpi, ``b`` from nvshmem)."""
    ha, hb = host(a), host(b)
    if ha is None or hb is None:
        assert ha is None and hb is None, f"{name}: one side is None"
        return
    assert ha.shape == hb.shape, f"{name}: shape {ha.shape} (mpi) != {hb.shape} (nvshmem)"
    assert ha.tobytes() == hb.astype(ha.dtype).tobytes(), f"{name}: values differ\nmpi={ha}\nnvshmem={hb}"


def routing(seed: int, tokens: int, experts: int, topk: int, masked: bool) -> np.ndarray:
    """This rank's ``[T, K]`` int64 uniform routing; ``masked``: 30 % of the entries and all of token 0 are -1."""
    rng = np.random.default_rng(seed * 100 + RANK)
    idx = make_routing("uniform", tokens, experts, topk, seed=rng).topk_idx
    return mask_routing(idx, rng, entry_rate=0.3, first_tokens=1) if masked else idx


def compare_handles(tag: str, hm, hn) -> None:
    for field in ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx", "num_recv_tokens",
                  "num_expanded_tokens", "num_out_rows"):
        same(f"{tag} handle.{field}", getattr(hm, field), getattr(hn, field))
    same(f"{tag} handle.num_recv_tokens_per_expert", np.asarray(hm.num_recv_tokens_per_expert),
         np.asarray(host(hn.num_recv_tokens_per_expert) if isinstance(hn.num_recv_tokens_per_expert, cp.ndarray)
                    else hn.num_recv_tokens_per_expert))


def one_case(bufs, dtype: str, expand: bool, alignment: int, cpu_sync: bool, masked: bool, weighted: bool,
             with_bias: bool, seed: int) -> None:
    mpi_buf, nv_buf = bufs
    geo = nv_buf.geometry
    tag = (f"[{dtype} expand={expand} align={alignment} cpu_sync={cpu_sync} masked={masked} w={weighted} "
           f"bias={with_bias}]")
    tokens = [geo.max_tokens // 2 + 3 * RANK, 0, geo.max_tokens][seed % 3] if seed % 3 != 1 or RANK == 0 else 5
    tokens = min(tokens, geo.max_tokens)
    idx = routing(seed, tokens, geo.num_experts, geo.num_topk, masked)
    rng = np.random.default_rng(7 + seed + RANK)
    x = rng.standard_normal((tokens, geo.hidden)).astype(DTYPES[dtype])
    w = rng.random((tokens, geo.num_topk)).astype(np.float32) if weighted else None
    stats_m = np.zeros(geo.num_experts // WORLD, np.int64)
    stats_n = cp.zeros(geo.num_experts // WORLD, cp.int64)
    kw = dict(expand=expand, expert_alignment=alignment, cpu_sync=cpu_sync, zero_padding=True)
    om = mpi_buf.dispatch(x, idx, w, stats=stats_m, **kw)
    on = nv_buf.dispatch(cp.asarray(x), cp.asarray(idx), None if w is None else cp.asarray(w), stats=stats_n, **kw)
    defined = int(om.handle.num_expanded_tokens if expand else om.handle.num_recv_tokens)
    same(f"{tag} recv_x (received and padding rows; a worst-case tail is undefined)", om.recv_x[:defined],
         on.recv_x[:defined])
    same(f"{tag} recv_topk_idx", om.recv_topk_idx, on.recv_topk_idx)
    same(f"{tag} recv_topk_weights", om.recv_topk_weights, on.recv_topk_weights)
    same(f"{tag} stats", stats_m, stats_n)
    compare_handles(tag, om.handle, on.handle)
    gathered = COMM.allgather((idx, x, w))
    sources = Sources(geo.num_experts, geo.max_tokens, [g[0] for g in gathered], [g[1] for g in gathered],
                      [g[2] for g in gathered])
    opts = DispatchOptions(expand, alignment, True, cpu_sync, weighted, deterministic=True)
    problems = check_dispatch(sources, RANK, opts, HostDispatch.of(on))
    assert not problems, f"{tag} nvshmem dispatch fails the shared checker: {problems}"
    # cached dispatch (replay) with new payload
    x2 = (x.astype(np.float32) * 2 + 1).astype(x.dtype)
    rm = mpi_buf.dispatch(x2, handle=om.handle)
    rn = nv_buf.dispatch(cp.asarray(x2), handle=on.handle)
    same(f"{tag} replay recv_x", rm.recv_x, rn.recv_x)
    compare_handles(tag + " replay", rm.handle, rn.handle)
    # combine: y = recv_x, weights per row when given
    yw_m = om.recv_topk_weights if weighted else None
    yw_n = on.recv_topk_weights if weighted else None
    bias_m = (tuple(rng.standard_normal((tokens, geo.hidden)).astype(np.float32) for _ in range(2)) if with_bias
              else None)
    bias_n = tuple(cp.asarray(b) for b in bias_m) if with_bias else None
    cm = mpi_buf.combine(om.recv_x, om.handle, topk_weights=yw_m, bias=bias_m)
    cn = nv_buf.combine(on.recv_x, on.handle, topk_weights=yw_n, bias=bias_n)
    same(f"{tag} combine.x", cm.x, cn.x)
    same(f"{tag} combine.topk_weights", cm.topk_weights, cn.topk_weights)


NV: dict = {}  # the nvshmem Buffers' transport, scaleup_ranks and forwarding (main sets them)
REF: dict = {}  # the mpi references' nodes: none, or those of the nvshmem Buffers when they forward (main sets them)


def nvshmem_buffer(**kw) -> ep_comm.Buffer:
    """An nvshmem Buffer of ``kw`` on the transport and nodes of the command line."""
    return ep_comm.Buffer(backend="nvshmem", **NV, **kw)


def mpi_buffer(**kw) -> ep_comm.Buffer:
    """The mpi reference Buffer of ``kw``: one node, or forwarding in the nvshmem Buffers' nodes."""
    return ep_comm.Buffer(backend="mpi", **REF, **kw)


def round_trip_rows(idx: np.ndarray, num_experts: int) -> tuple:
    """``(dispatch, combine)``: the scale-out rows this rank puts in one dispatch of routing ``idx`` (every rank's,
    gathered: collective) and its combine, in the nvshmem Buffers' nodes and route (``ep_comm.contract.traffic``)."""
    rows = traffic.world_rows(COMM.allgather(idx), num_experts, Topology.of(WORLD, NV["scaleup_ranks"]))
    route = traffic.ROUTES.index("forwarded" if NV["forwarding"] else "flat")
    return tuple(int(r) for r in rows[:, route, traffic.LINKS.index("scaleout"), RANK])


def expected_mode() -> str:
    """``Buffer.transport`` the command line's transport and nodes give."""
    nodes = WORLD // (NV["scaleup_ranks"] or WORLD)
    if NV["transport"] != "auto" or nodes == 1:
        return "stores" if NV["transport"] in ("stores", "auto") else "puts"
    return "puts" if nodes == WORLD else "stores+puts"


def check_against_mpi() -> None:
    geo_kw = dict(num_experts=4 * WORLD, hidden=40, num_topk=3, num_max_tokens_per_rank=20, deterministic=True,
                  timeout_s=20.0)
    seed = 0
    for dtype in ("bfloat16", "float16", "float32"):
        mpi_buf = mpi_buffer(dtype=dtype, **geo_kw)
        nv_buf = nvshmem_buffer(dtype=dtype, **geo_kw)
        assert nv_buf.transport == expected_mode(), (nv_buf.transport, NV)
        for expand, alignment in ((False, 1), (True, 1), (True, 4)):
            for cpu_sync in (True, False):
                for masked, weighted, with_bias in ((False, True, False), (True, False, True)):
                    seed += 1
                    one_case((mpi_buf, nv_buf), dtype, expand, alignment, cpu_sync, masked, weighted, with_bias, seed)
        nv_buf.close()
        mpi_buf.close()
    print(f"RANK {RANK} OK nvshmem == mpi bit for bit ({NV}, transport {expected_mode()}, {seed} cases)", flush=True)


def check_torch_and_nondeterministic() -> None:
    import torch

    kw = dict(num_experts=2 * WORLD, hidden=64, num_topk=2, num_max_tokens_per_rank=16, dtype="bfloat16",
              timeout_s=20.0)
    buf = nvshmem_buffer(deterministic=False, **kw)
    ref = mpi_buffer(deterministic=True, **kw)
    idx = routing(99, 12, kw["num_experts"], 2, masked=False)
    x = np.random.default_rng(RANK).standard_normal((12, 64)).astype(ml_dtypes.bfloat16)
    mine = cp.cuda.Device().id  # the Buffer's GPU: torch must put its tensors there too
    torch.cuda.set_device(mine)
    xt = torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    out = buf.dispatch(xt, torch.from_numpy(idx).cuda())
    assert isinstance(out.recv_x, cp.ndarray)
    res = buf.combine(out.recv_x, out.handle)
    ref_out = ref.dispatch(x, idx)
    want = ref.combine(ref_out.recv_x, ref_out.handle)
    same("torch/non-deterministic combine.x", want.x, res.x)
    try:
        buf.dispatch(x, cp.asarray(idx))
    except TypeError as exc:
        assert str(exc).startswith("x is a host array"), exc
    else:
        raise AssertionError("a NumPy x must raise TypeError on the nvshmem backend")
    if torch.cuda.device_count() > 1:
        other = (mine + 1) % torch.cuda.device_count()
        try:
            buf.dispatch(xt.to(f"cuda:{other}"), torch.from_numpy(idx).cuda())
        except ValueError as exc:
            assert str(exc).startswith(f"x is on GPU {other}: this rank's Buffer works on GPU {mine}"), exc
        else:
            raise AssertionError("an x on another GPU must raise ValueError")
    else:
        print(f"RANK {RANK} SKIP the check that an x on another GPU is refused: only one GPU is visible "
              "(the ranks share it)", flush=True)
    buf.close()
    ref.close()
    print(f"RANK {RANK} OK torch tensors in, non-deterministic combine bit-exact, host and other-GPU arrays refused",
          flush=True)


def replay(stream, graphs, fills) -> None:
    """After a barrier: copy each ``(captured input, host array)`` of ``fills`` into the input, launch
    ``graphs`` in order on ``stream``, and wait for them."""
    COMM.Barrier()
    with stream:
        for dst, src in fills:
            dst[...] = cp.asarray(src)
        for graph in graphs:
            graph.launch(stream)
        stream.synchronize()


def check_graph_replay() -> None:
    """A cached dispatch (cpu_sync=False) captured into one CUDA graph and its combine into another,
    replayed alternately with new payloads copied into the captured input: every replay equals the
    mpi backend bit for bit; eager calls in between keep working (host and device steps agree); a
    new routing, or a cpu_sync=True step, under capture is refused and the buffer stays usable."""
    kw = dict(num_experts=4 * WORLD, hidden=64, num_topk=3, num_max_tokens_per_rank=24, dtype="bfloat16",
              deterministic=True, timeout_s=20.0)
    nv, ref = nvshmem_buffer(**kw), mpi_buffer(**kw)
    stream = cp.cuda.Stream(non_blocking=True)
    replays = 0
    for expand, alignment, weighted in ((False, 1, True), (True, 4, False)):
        idx = routing(41 + expand, 20, kw["num_experts"], 3, masked=True)
        rng = np.random.default_rng(5 + RANK)
        x0 = rng.standard_normal((20, 64)).astype(ml_dtypes.bfloat16)
        w = rng.random((20, 3)).astype(np.float32) if weighted else None
        opts = dict(expand=expand, expert_alignment=alignment, zero_padding=True)
        first_n = nv.dispatch(cp.asarray(x0), cp.asarray(idx), None if w is None else cp.asarray(w), **opts)
        first_m = ref.dispatch(x0, idx, w, **opts)
        x_in = cp.asarray(x0)
        with stream:
            warm = nv.dispatch(x_in, handle=first_n.handle, cpu_sync=False)
            nv.combine(warm.recv_x, warm.handle)
            stream.synchronize()
            idx_dev = cp.asarray(idx)
            for bad in (lambda: nv.dispatch(x_in, idx_dev), lambda: nv.dispatch(x_in, handle=first_n.handle)):
                try:
                    captured(stream, bad)
                except RuntimeError as exc:
                    assert "captured into a CUDA graph" in str(exc), exc
                else:
                    raise AssertionError("a new routing / cpu_sync=True dispatch must be refused under capture")
            out, d_graph = captured(stream, lambda: nv.dispatch(x_in, handle=first_n.handle, cpu_sync=False))
            res, c_graph = captured(stream, lambda: nv.combine(out.recv_x, out.handle))
        per_replay = round_trip_rows(idx, kw["num_experts"])
        for i in range(4):
            xi = (x0.astype(np.float32) * (i + 2) - i).astype(ml_dtypes.bfloat16)
            before = nv.traffic().scaleout_rows
            replay(stream, (d_graph, c_graph), [(x_in, xi)])
            added = tuple(a - b for a, b in zip(nv.traffic().scaleout_rows, before))
            assert added == per_replay, (f"graph replay {i}: scale-out rows added {added}, the model's {per_replay}",
                                         NV)
            rm = ref.dispatch(xi, handle=first_m.handle)
            cm = ref.combine(rm.recv_x, rm.handle)
            rows = int(rm.handle.num_expanded_tokens if expand else rm.handle.num_recv_tokens)
            tag = f"[graph replay {i} expand={expand}]"
            same(f"{tag} recv_x", rm.recv_x[:rows], out.recv_x[:rows])
            same(f"{tag} recv_topk_idx", rm.recv_topk_idx, out.recv_topk_idx[:len(rm.recv_topk_idx)])
            same(f"{tag} combine.x", cm.x, res.x)
            replays += 1
            if i == 1:  # an eager round trip between replays
                e = nv.dispatch(cp.asarray(xi), handle=first_n.handle)
                same(f"{tag} eager recv_x", rm.recv_x, e.recv_x)
                same(f"{tag} eager combine.x", cm.x, nv.combine(e.recv_x, e.handle).x)
        replays += check_new_routing_replays(nv, ref, stream, x_in, opts, expand)
    nv.close()
    ref.close()
    print(f"RANK {RANK} OK CUDA graph replays of cached and new-routing dispatches and their combines == mpi "
          f"bit for bit ({replays} replays, eager calls in between, uncapturable calls refused, a bad captured "
          "routing reported by the next call)", flush=True)


def check_recv_hooks() -> None:
    """``return_recv_hook=True`` on nvshmem: eager hooks (new routing and replay, cpu_sync True and False, compact
    and expand, combine with weights and bias) equal the mpi backend's plain calls bit for bit, with the hook on
    the send's stream or on another one; with peer stores the send halves and the hooks of a cached dispatch
    and of its combine are captured into four graphs, replayed in order with new payloads, bit for bit."""
    kw = dict(num_experts=4 * WORLD, hidden=64, num_topk=3, num_max_tokens_per_rank=24, dtype="bfloat16",
              deterministic=True, timeout_s=20.0)
    nv, ref = nvshmem_buffer(**kw), mpi_buffer(**kw)
    send_stream, hook_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(71 + RANK)
    x0 = rng.standard_normal((20, 64)).astype(ml_dtypes.bfloat16)
    w = rng.random((20, 3)).astype(np.float32)
    bias = rng.standard_normal((20, 64)).astype(np.float32)
    for expand, cpu_sync, other_stream in ((False, True, False), (True, False, True), (False, False, True),
                                           (True, True, False)):
        tag = f"[hook expand={expand} cpu_sync={cpu_sync} other_stream={other_stream}]"
        idx = routing(61 + expand, 20, kw["num_experts"], 3, masked=True)
        opts = dict(expand=expand, expert_alignment=4 if expand else 1, zero_padding=True, cpu_sync=cpu_sync)
        want = ref.dispatch(x0, idx, w, **opts)
        with send_stream:
            hook = nv.dispatch(cp.asarray(x0), cp.asarray(idx), cp.asarray(w), return_recv_hook=True, **opts)
        with hook_stream if other_stream else send_stream:
            got = hook()
            replay_hook = nv.dispatch(cp.asarray(x0), handle=got.handle, cpu_sync=cpu_sync, return_recv_hook=True)
            replayed = replay_hook()
            y_w = got.recv_topk_weights
            combine_hook = nv.combine(got.recv_x, got.handle, topk_weights=y_w, bias=cp.asarray(bias),
                                      return_recv_hook=True)
            res = combine_hook()
            cp.cuda.get_current_stream().synchronize()
        rows = int(want.handle.num_expanded_tokens if expand else want.handle.num_recv_tokens)
        for name, out in (("dispatch", got), ("replay", replayed)):
            same(f"{tag} {name} recv_x", want.recv_x[:rows], out.recv_x[:rows])
            same(f"{tag} {name} recv_topk_idx", want.recv_topk_idx, out.recv_topk_idx[:len(want.recv_topk_idx)])
            same(f"{tag} {name} recv_topk_weights", want.recv_topk_weights,
                 out.recv_topk_weights[:len(want.recv_topk_weights)])
        cm = ref.combine(want.recv_x, want.handle, topk_weights=want.recv_topk_weights, bias=bias)
        same(f"{tag} combine.x", cm.x, res.x)
        same(f"{tag} combine.topk_weights", cm.topk_weights, res.topk_weights)
    check_hook_graphs(nv, ref, send_stream, x0)
    nv.close()
    ref.close()
    print(f"RANK {RANK} OK receive hooks == mpi bit for bit ({expected_mode()}; eager, on another stream, and "
          "send/hook captured into separate graphs)", flush=True)


def check_hook_graphs(nv, ref, stream, x0) -> None:
    """A cached dispatch (cpu_sync=False) and its combine, each captured as a send graph and a hook graph,
    replayed send, hook, send, hook with new payloads: bit for bit the mpi backend's plain calls."""
    for expand in (False, True):
        idx = routing(81 + expand, 20, nv.geometry.num_experts, 3, masked=True)
        opts = dict(expand=expand, expert_alignment=2 if expand else 1, zero_padding=True)
        first_n = nv.dispatch(cp.asarray(x0), cp.asarray(idx), **opts)
        first_m = ref.dispatch(x0, idx, **opts)
        x_in = cp.asarray(x0)
        with stream:
            hook, d_send = captured(stream, lambda: nv.dispatch(x_in, handle=first_n.handle, cpu_sync=False,
                                                                return_recv_hook=True))
            try:
                hook()
            except RuntimeError as exc:  # a captured send needs a captured hook; the hook stays pending
                assert "its send was captured into a CUDA graph" in str(exc), exc
            else:
                raise AssertionError("an eager hook of a captured send must be refused")
            out, d_hook = captured(stream, hook)
            c_hook, c_send = captured(stream, lambda: nv.combine(out.recv_x, out.handle, return_recv_hook=True))
            res, c_recv = captured(stream, c_hook)
        for i in range(3):
            xi = (x0.astype(np.float32) * (i + 3) - i).astype(ml_dtypes.bfloat16)
            replay(stream, (d_send, d_hook, c_send, c_recv), [(x_in, xi)])
            rm = ref.dispatch(xi, handle=first_m.handle)
            cm = ref.combine(rm.recv_x, rm.handle)
            rows = int(rm.handle.num_expanded_tokens if expand else rm.handle.num_recv_tokens)
            tag = f"[hook graphs replay {i} expand={expand}]"
            same(f"{tag} recv_x", rm.recv_x[:rows], out.recv_x[:rows])
            same(f"{tag} recv_topk_idx", rm.recv_topk_idx, out.recv_topk_idx[:len(rm.recv_topk_idx)])
            same(f"{tag} combine.x", cm.x, res.x)


def check_new_routing_replays(nv, ref, stream, x_in, opts: dict, expand: bool) -> int:
    """A dispatch of a new routing (cpu_sync=False) and its combine captured once, replayed with a new
    routing and payload copied into the captured inputs each time; then a replay with an expert id past
    the experts, which the next eager call must raise as ValueError (the ranks stay in step)."""
    experts, topk = nv.geometry.num_experts, nv.geometry.num_topk
    idx_in = cp.asarray(routing(60, 20, experts, topk, masked=True))
    with stream:
        warm = nv.dispatch(x_in, idx_in, cpu_sync=False, **opts)
        nv.combine(warm.recv_x, warm.handle)
        stream.synchronize()
        out, d_graph = captured(stream, lambda: nv.dispatch(x_in, idx_in, cpu_sync=False, **opts))
        res, c_graph = captured(stream, lambda: nv.combine(out.recv_x, out.handle))
    for i in range(3):
        idx = routing(61 + i + 10 * expand, 20, experts, topk, masked=True)
        xi = np.random.default_rng(90 + i + RANK).standard_normal((20, x_in.shape[1])).astype(ml_dtypes.bfloat16)
        replay(stream, (d_graph, c_graph), [(x_in, xi), (idx_in, idx)])
        rm = ref.dispatch(xi, idx, **opts)
        cm = ref.combine(rm.recv_x, rm.handle)
        rows = int(rm.handle.num_expanded_tokens if expand else rm.handle.num_recv_tokens)
        tag = f"[new-routing graph replay {i} expand={expand}]"
        same(f"{tag} recv_x", rm.recv_x[:rows], out.recv_x[:rows])
        same(f"{tag} recv_topk_idx", rm.recv_topk_idx, out.recv_topk_idx[:len(rm.recv_topk_idx)])
        same(f"{tag} num_recv_tokens", np.int64(rm.handle.num_recv_tokens), out.handle.num_recv_tokens.astype(cp.int64))
        same(f"{tag} combine.x", cm.x, res.x)
    bad = routing(70, 20, experts, topk, masked=False)
    bad[3, 0] = experts + 5
    replay(stream, (d_graph, c_graph), [(idx_in, bad)])
    valid = cp.asarray(routing(71, 20, experts, topk, masked=True))
    try:
        nv.dispatch(x_in, valid, **opts)
    except ValueError as exc:
        assert f"replayed from a CUDA graph was given a topk_idx holding expert id {experts + 5}" in str(exc), exc
    else:
        raise AssertionError("a bad routing replayed from a graph must be raised by the next eager call")
    ok = nv.dispatch(x_in, valid, **opts)  # reported once; the ranks stayed in step
    nv.combine(ok.recv_x, ok.handle)
    return 4


def check_non_contiguous() -> None:
    """Strided and Fortran-order CuPy inputs (x, topk_idx, topk_weights, the combine's y) give the mpi
    backend's results on contiguous copies, bit for bit."""
    kw = dict(num_experts=4 * WORLD, hidden=32, num_topk=3, num_max_tokens_per_rank=16, dtype="float32",
              deterministic=True, timeout_s=20.0)
    nv, ref = nvshmem_buffer(**kw), mpi_buffer(**kw)
    idx = routing(80, 12, kw["num_experts"], 3, masked=True)
    rng = np.random.default_rng(80 + RANK)
    wide, w = rng.standard_normal((12, 64)).astype(np.float32), rng.random((12, 6)).astype(np.float32)
    on = nv.dispatch(cp.asarray(wide)[:, ::2], cp.asfortranarray(cp.asarray(idx)), cp.asarray(w)[:, ::2])
    om = ref.dispatch(np.ascontiguousarray(wide[:, ::2]), idx, np.ascontiguousarray(w[:, ::2]))
    same("[non-contiguous] recv_x", om.recv_x, on.recv_x)
    same("[non-contiguous] recv_topk_idx", om.recv_topk_idx, on.recv_topk_idx)
    same("[non-contiguous] recv_topk_weights", om.recv_topk_weights, on.recv_topk_weights)
    cn = nv.combine(cp.repeat(on.recv_x, 2, axis=1)[:, ::2], on.handle)
    same("[non-contiguous] combine.x", ref.combine(om.recv_x, om.handle).x, cn.x)
    nv.close()
    ref.close()
    print(f"RANK {RANK} OK strided and Fortran-order inputs == mpi on contiguous copies", flush=True)


def check_timeout() -> None:
    buf = ep_comm.Buffer(num_experts=2 * WORLD, hidden=16, num_topk=1, num_max_tokens_per_rank=4, dtype="float32",
                         backend="nvshmem", timeout_s=2.0, **NV)
    idx = cp.zeros((2, 1), dtype=cp.int64)
    x = cp.ones((2, 16), dtype=cp.float32)
    start = time.monotonic()
    if RANK != 0:
        time.sleep(3 * buf.timeout_s)  # rank 0 must time out before this rank's close signal arrives
    else:
        try:
            buf.dispatch(x, idx)
        except ep_comm.TimeoutError as exc:
            assert exc.missing_ranks == tuple(range(1, WORLD)), exc.missing_ranks
            print(f"RANK 0 OK timeout after {time.monotonic() - start:.1f} s: {exc}", flush=True)
        else:
            raise AssertionError("rank 0 should have timed out")
        try:
            buf.dispatch(x, idx)
        except ep_comm.BufferUnusableError:
            pass
        else:
            raise AssertionError("the buffer must be unusable after a timeout")
    try:
        buf.close()
    except ep_comm.TimeoutError as exc:
        print(f"RANK {RANK} OK close gave up waiting: {exc}", flush=True)
    except ep_comm.PeerAbortedError as exc:  # rank 0 posted its abort record when it gave up: the late ranks learn it
        assert RANK != 0 and exc.aborted_ranks == (0,), (RANK, exc.records)
        print(f"RANK {RANK} OK close raised the abort record of rank 0: {exc}", flush=True)
    else:
        assert RANK == 0, "a rank that missed the timed-out dispatch must learn of rank 0's abort record at close"
    print(f"RANK {RANK} OK closed {time.monotonic() - start:.1f} s after the timeout test began", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=("stores", "puts", "auto"), default="stores",
                        help="Buffer(transport=...) of the nvshmem Buffers (default: stores)")
    parser.add_argument("--scaleup-ranks", type=int, default=None,
                        help="Buffer(scaleup_ranks=...) of the nvshmem Buffers (default: one node)")
    parser.add_argument("--forwarding", action="store_true",
                        help="Buffer(forwarding=True) of the nvshmem Buffers and of the mpi references (with nodes)")
    args = parser.parse_args()
    NV.update(transport=args.transport, scaleup_ranks=args.scaleup_ranks, forwarding=args.forwarding)
    if args.forwarding:
        REF.update(scaleup_ranks=args.scaleup_ranks, forwarding=True)
    check_against_mpi()
    check_torch_and_nondeterministic()
    check_non_contiguous()
    check_graph_replay()
    check_recv_hooks()
    COMM.Barrier()
    check_timeout()
    print(f"RANK {RANK} ALL OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
