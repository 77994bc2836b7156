"""A new routing with ``cpu_sync=True`` over the fake GPU (kernels in the CUDA simulator): compact into worst-case
outputs (the prepared path's decode case) it counts in its copy's launch, and its poll ends on the mapped record's
tag of this step, never on a record an earlier step left, and on the progress marker alone once a step was captured
(``docs/design.md``, "Polls, not syncs")."""
from typing import List

import numpy as np
import pytest
from helpers.fake_gpu import SMALL_GEO, SMALL_IDX, launch_log, simulated_buffer
from helpers.same_outputs import assert_same_dispatch

from ep_comm.contract.protocol import RECORD_TAG
from ep_comm.kernels import switches

COUNT_APART = ["receive_count_words_kernel", "receive_compact_kernel"]
COUNTED = ["receive_counted_compact_kernel"]


def _x(seed: int) -> np.ndarray:
    """3 tokens of ``SMALL_GEO`` (float32 ``[3, H]``)."""
    return np.random.default_rng(seed).standard_normal((3, SMALL_GEO.hidden)).astype(np.float32)


def _receives(log: list) -> List[str]:
    """The receive launches of a launch log (``launch_log``), by kernel name."""
    return [entry[0] for entry in log if entry[0].startswith("receive")]


class _Gpu:
    """The GPU as the host sees it while a counted copy runs: its record's tag word still ``stale`` (block 0 has not
    published yet) until the progress marker is reached, at the ``checks``-th check of it; ``checked`` counts them."""

    def __init__(self, record: np.ndarray, stale: int, checks: int):
        self.record, self.stale, self.checks = record, stale, checks
        self.checked, self.tag = 0, None

    def launched(self) -> None:
        """After the counted copy's launch: its tag is not visible yet."""
        self.tag, self.record[RECORD_TAG] = int(self.record[RECORD_TAG]), self.stale

    def reached(self, marker) -> bool:
        self.checked += 1
        if self.checked < self.checks:
            return False
        if self.tag is not None:
            self.record[RECORD_TAG] = self.tag
        return True


def _slow_gpu(monkeypatch, buf, stale: int, checks: int) -> _Gpu:
    """A :class:`_Gpu` in front of ``buf``'s backend: every counted copy's tag hidden as ``stale`` until its marker."""
    be = buf._backend
    gpu = _Gpu(be.runner.record_host, stale, checks)
    receive_counted = be.kernels.receive_counted

    def hidden(*args, **kwargs):
        out = receive_counted(*args, **kwargs)
        gpu.launched()
        return out

    monkeypatch.setattr(be.kernels, "receive_counted", hidden)
    monkeypatch.setattr(be.device, "reached", gpu.reached)
    return gpu


def _new(buf, x: np.ndarray, expand: bool = False, sync: bool = True):
    return buf.dispatch(x, SMALL_IDX, expand=expand, expert_alignment=2, cpu_sync=sync)


@pytest.mark.parametrize("prepared", [False, True], ids=["general", "prepared"])
def test_a_compact_cpu_sync_new_routing_counts_in_its_copy_only_into_worst_case_outputs(monkeypatch, prepared):
    """The prepared path copies into worst-case outputs before the poll: one counted copy, no receive count apart;
    the general path allocates exact outputs after the poll: the receive count, then the copy. The bytes are those of
    the receive count apart (``EP_COMM_KERNEL_LEGACY=count_in_copy``)."""
    log = launch_log(monkeypatch)
    with monkeypatch.context() as legacy:
        legacy.setattr(switches, "LEGACY", frozenset({"count_in_copy"}))
        apart = simulated_buffer(prepared)
        want = [_new(apart, _x(1))]
        del log[:]
        want.append(_new(apart, _x(2)))
        assert _receives(log) == COUNT_APART
    buf = simulated_buffer(prepared)
    got = [_new(buf, _x(1))]
    del log[:]
    device = buf._backend.device
    markers = []  # receive launches before each progress marker: the poll's after the launch that writes the record
    monkeypatch.setattr(device, "progress", lambda: markers.append(len(_receives(log))) or "marker")
    got.append(_new(buf, _x(2)))  # the second call of the shape: the prepared one
    assert buf._backend.prepared.replayed == apart._backend.prepared.replayed == int(prepared)
    assert _receives(log) == (COUNTED if prepared else COUNT_APART) and markers == [1]
    for i, (w, g) in enumerate(zip(want, got)):
        assert_same_dispatch(f"call {i}", w, g)


def test_the_poll_ends_on_this_steps_record_tag_before_the_marker(monkeypatch):
    """The record's tag is the device step counter, the host's step number while nothing was captured (combines
    between the dispatches advance both); the poll reads it before the marker and is done."""
    buf = simulated_buffer()
    be = buf._backend
    _new(buf, _x(1))
    out = _new(buf, _x(2), sync=False)
    buf.combine(out.recv_x, out.handle)
    gpu = _slow_gpu(monkeypatch, buf, stale=-5, checks=10)
    gpu.launched = lambda: None  # the tag visible at once
    got = _new(buf, _x(3))
    assert gpu.checked == 0, "the marker was never checked"
    assert be.prepared.replayed == 1
    assert int(be.runner.record_host[RECORD_TAG]) == be.runner.steps.seq == int(be.transport.step[0]) == 4
    monkeypatch.undo()
    assert_same_dispatch("woken by the tag", _new(simulated_buffer(False), _x(3)), got)


def test_a_record_left_by_the_previous_step_never_ends_the_poll(monkeypatch):
    """The previous dispatch left the record with its own tag (this step's number less one): the poll waits for the
    marker (``checks`` checks), then reads this step's record."""
    buf = simulated_buffer()
    be = buf._backend
    for seed in (1, 2):
        _new(buf, _x(seed))
    left = int(be.runner.record_host[RECORD_TAG])
    assert left == be.runner.steps.seq == 2
    gpu = _slow_gpu(monkeypatch, buf, stale=left, checks=4)
    got = _new(buf, _x(3))
    assert gpu.checked == 4 and be.runner.steps.seq == left + 1
    monkeypatch.undo()
    assert_same_dispatch("after a stale record", _new(simulated_buffer(False), _x(3)), got)


def test_after_a_capture_the_poll_ends_on_the_marker_alone(monkeypatch):
    """A captured step's replays advance the device step counter unseen by the host: here one replay of a captured
    new routing, which left its record tagged with the number the host gives its next step. The poll must not end on
    it (nor on the step's own tag, which the host cannot know): it waits for the marker."""
    buf = simulated_buffer()
    be = buf._backend
    _new(buf, _x(1)), _new(buf, _x(2))
    be.device.capturing_now = True
    with be.captured_memory():
        _new(buf, _x(4), sync=False)
    be.device.capturing_now = False
    be.transport.step[0] += 1  # the graph's replay: the counter advances, the host's step number does not
    expected = be.runner.steps.seq + 1  # what the host would take for the next step's tag
    be.runner.record_host[RECORD_TAG] = expected  # the replay's record
    gpu = _slow_gpu(monkeypatch, buf, stale=expected, checks=3)
    got = _new(buf, _x(3))
    assert gpu.checked == 3 and be.runner.steps.seq == expected
    assert int(be.runner.record_host[RECORD_TAG]) == expected + 1, "the step's own tag: the device's count"
    monkeypatch.undo()
    assert_same_dispatch("after a capture", _new(simulated_buffer(False), _x(3)), got)


def test_a_poll_woken_by_the_tag_still_raises_a_missing_peer(monkeypatch):
    """The wait's outcome is read after the poll however it ended: a peer the GPU wait missed raises
    ``ep_comm.TimeoutError`` naming it, and the Buffer is unusable, as after a marker."""
    buf = simulated_buffer()
    be = buf._backend
    _new(buf, _x(1)), _new(buf, _x(2))
    transport, exchange = be.transport, be.transport.exchange

    def missing_a_peer(*args):
        exchange(*args)
        transport.missing = [0]  # what the GPU wait records when a peer does not come within timeout_s

    monkeypatch.setattr(transport, "exchange", missing_a_peer)
    gpu = _slow_gpu(monkeypatch, buf, stale=-5, checks=10)
    gpu.launched = lambda: None
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        _new(buf, _x(3))
    assert gpu.checked == 0 and be.runner.steps.unusable
