"""Byte-for-byte comparisons of two backends' outputs (the mpi backend's and the simulated nvshmem backend's) or of
two ways to make the same call (plain and split, eager and captured): shapes, dtypes' bytes, and every handle field.
Arrays may be NumPy's or the GPU's (copied to the host)."""
import numpy as np

from ep_comm.contract.arrays import to_host


def assert_same(name, a, b) -> None:
    """``a`` (mpi, or the reference call) and ``b`` (nvshmem) are both None, or of one shape and the same bytes in
    ``a``'s dtype."""
    if a is None or b is None:
        assert a is None and b is None, name
        return
    a, b = to_host(a), to_host(b)
    assert a.shape == b.shape, f"{name}: shape {a.shape} (mpi) != {b.shape} (nvshmem)"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b.astype(a.dtype)).tobytes(), \
        f"{name}: differs\nmpi={a}\nnvshmem={b}"


def defined_rows(out, handle):
    """recv_x rows the contract defines: the received rows and, in expand mode, the gap rows between experts' blocks,
    zero with ``zero_padding``; without it a gap row's bytes are undefined (docs/design.md, "Expand"), so they are
    given as zeros here. Not the worst-case tail."""
    rows = int(handle.num_expanded_tokens if handle.expand else handle.num_recv_tokens)
    defined = to_host(out.recv_x)[:rows]
    if handle.expand and not handle.zero_padding:
        defined = defined.copy()
        defined[to_host(out.recv_topk_idx)[:rows] < 0] = 0
    return defined


# the handle fields that do not depend on the order rows were placed in (counts, psums, the routing's own layout)
_ORDER_FREE_FIELDS = ("psum_num_recv_tokens_per_rank", "psum_num_recv_tokens_per_expert",
                      "num_unaligned_recv_tokens_per_expert", "num_recv_tokens", "num_expanded_tokens", "num_out_rows",
                      "is_token_in_rank")


def _assert_same_fields(tag, hm, hn, fields) -> None:
    """The handles ``hm`` and ``hn`` agree byte for byte in ``fields`` and in their counts per expert."""
    for field in fields:
        assert_same(f"{tag} handle.{field}", getattr(hm, field), getattr(hn, field))
    assert_same(f"{tag} handle.num_recv_tokens_per_expert", to_host(hm.num_recv_tokens_per_expert),
                to_host(hn.num_recv_tokens_per_expert))


def assert_same_dispatch(tag, om, on) -> None:
    """Two dispatch outputs (``om`` the mpi backend's or the reference call's, ``on`` the one checked) agree byte for
    byte: the defined ``recv_x`` rows, received ids and weights, and every field of the handles."""
    assert_same(f"{tag} recv_x", defined_rows(om, om.handle), defined_rows(on, on.handle))
    assert_same(f"{tag} recv_topk_idx", om.recv_topk_idx, on.recv_topk_idx)
    assert_same(f"{tag} recv_topk_weights", om.recv_topk_weights, on.recv_topk_weights)
    hm, hn = om.handle, on.handle
    _assert_same_fields(tag, hm, hn, _ORDER_FREE_FIELDS + ("recv_src_metadata", "dst_buffer_slot_idx"))
    assert isinstance(hn.num_recv_tokens_per_expert, list) == hm.cpu_sync


def _row_bytes(*arrays) -> list:
    """The rows of ``arrays`` (one row per leading index, all of one length; GPU arrays copied to the host), each as
    the bytes of its row in every array, in order."""
    hosts = [np.ascontiguousarray(to_host(a)) for a in arrays]
    parts = [h.reshape(len(h), -1).view(np.uint8) for h in hosts]
    return [b"".join(p[i].tobytes() for p in parts) for i in range(len(parts[0]))]


def _row_multiset(*arrays) -> list:
    """:func:`_row_bytes` sorted: what a dispatch received regardless of the order it was placed in."""
    return sorted(_row_bytes(*arrays))


def _received_rows(out, rows: int) -> list:
    """The first ``rows`` rows of a dispatch's ``recv_x``, received ids and (where dispatched) weights."""
    weights = [] if out.recv_topk_weights is None else [to_host(out.recv_topk_weights)[:rows]]
    return [to_host(out.recv_x)[:rows], to_host(out.recv_topk_idx)[:rows], *weights]


def _metadata_multiset(out, rows: int) -> list:
    """The source metadata rows of a dispatch (its first ``num_recv_tokens``) as a sorted multiset. In expand mode
    the expanded row a top-k entry landed in (columns ``2..``) depends on the order, so each such index stands for
    the bytes of the row it names (``recv_x``, id, weight; -1 for none): what it points at must agree."""
    h = out.handle
    meta = to_host(h.recv_src_metadata)[:int(h.num_recv_tokens)]
    if not h.expand:
        return _row_multiset(meta)
    row_bytes = _row_bytes(*_received_rows(out, rows))
    return sorted((m[:2].tobytes(), tuple(row_bytes[r] if r >= 0 else b"-1" for r in m[2:].tolist()))
                  for m in meta)


def assert_same_dispatch_unordered(tag, om, on) -> None:
    """Two dispatches with ``deterministic=False`` (``om`` the reference call's, ``on`` the one checked) received the
    same rows, each once, whatever order their atomic slots put them in: the counts and psums byte for byte; the
    defined ``recv_x`` rows with their ids and weights, the source metadata rows (in expand mode with the rows they
    name standing for their indices), and the sender's slots as sorted multisets (a destination's slots are ``0..n-1``
    in either order)."""
    hm, hn = om.handle, on.handle
    _assert_same_fields(tag, hm, hn, _ORDER_FREE_FIELDS)
    rows = int(hm.num_expanded_tokens if hm.expand else hm.num_recv_tokens)
    assert _row_multiset(*_received_rows(om, rows)) == _row_multiset(*_received_rows(on, rows)), \
        f"{tag} received rows differ"
    assert _metadata_multiset(om, rows) == _metadata_multiset(on, rows), f"{tag} source metadata differs"
    assert sorted(to_host(hm.dst_buffer_slot_idx).ravel().tolist()) == \
        sorted(to_host(hn.dst_buffer_slot_idx).ravel().tolist()), f"{tag} slots differ"


def assert_same_as_eager(first, eager, eager_sum, captured, captured_sum) -> None:
    """A captured replay's received rows (those ``first`` received), ids and combine equal the eager replay's."""
    rows = int(first.handle.num_expanded_tokens if first.handle.expand else first.handle.num_recv_tokens)
    np.testing.assert_array_equal(captured.recv_x[:rows], eager.recv_x[:rows])
    np.testing.assert_array_equal(captured.recv_topk_idx, eager.recv_topk_idx)
    np.testing.assert_array_equal(captured_sum.x, eager_sum.x)


def assert_same_outputs(want: list, got: list) -> None:
    """Two sequences of dispatch and combine outputs (the reference's and the one checked) agree call by call, byte
    for byte (:func:`assert_same_dispatch`; a combine's ``x`` and ``topk_weights``)."""
    assert len(want) == len(got), f"{len(got)} outputs, want {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if hasattr(a, "handle"):
            assert_same_dispatch(f"call {i}", a, b)
        else:
            assert_same(f"call {i} x", a.x, b.x)
            assert_same(f"call {i} topk_weights", a.topk_weights, b.topk_weights)
