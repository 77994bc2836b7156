"""The CPU side of ``tools/eager_timeline.py`` (issue 47's per-phase timeline of an eager call): the phases and kernel
rows of a call's record, their medians and the text tables, and one timed call through its recorder with a stand-in
for CuPy's events and the driver's launch (no GPU)."""
import importlib.util
import inspect
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "tools" / "eager_timeline.py"
_spec = importlib.util.spec_from_file_location("eager_timeline", _PATH)
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


def _record(shift: float = 0.0) -> dict:
    """A call of a new routing with cpu_sync=True: three launches before the poll, one after (seconds)."""
    us = 1e-6
    return {"start": 1.0, "end": 1.0 + 120 * us, "poll": [1.0 + 60 * us, 1.0 + (100 + shift) * us],
            "gpu_done": 1.0 + 140 * us, "calibration_us": 3.0 + shift,
            "launches": [{"name": "count", "host": 1.0 + 5 * us, "driver": 4 * us, "gpu": [1.0 + 8 * us, 1.0 + 20 * us]},
                         {"name": "signal_and_wait", "host": 1.0 + 30 * us, "gpu": [1.0 + 32 * us, 1.0 + 40 * us]},
                         {"name": "receive_count", "host": 1.0 + 50 * us, "gpu": [1.0 + 52 * us, 1.0 + 60 * us]},
                         {"name": "receive_copy", "host": 1.0 + 110 * us, "gpu": [1.0 + 112 * us, 1.0 + 135 * us]}]}


def test_the_phases_of_a_call_with_and_without_a_poll():
    phases = timeline.call_phases(_record())
    assert phases == pytest.approx({"call": 120, "enqueue": 60, "poll": 40, "after_poll": 20, "gpu_done": 140})
    no_poll = dict(_record(), poll=None)
    assert timeline.call_phases(no_poll) == pytest.approx({"call": 120, "enqueue": 120, "gpu_done": 140})


def test_the_kernel_rows_give_each_kernels_gpu_idle_before_it_from_the_poll_after_it():
    rows = timeline.kernel_rows(_record())
    assert [r["kernel"] for r in rows] == ["0:count", "1:signal_and_wait", "2:receive_count", "3:receive_copy"]
    assert "gap_us" not in rows[0]
    assert rows[1]["gap_us"] == pytest.approx(12) and rows[2]["gap_us"] == pytest.approx(12)
    assert rows[3]["gap_us"] == pytest.approx(12), "the receive copy waits for the host from the poll's end (100 us)"
    assert rows[3]["host_us"] == pytest.approx(110) and rows[3]["gpu_end_us"] == pytest.approx(135)
    assert rows[0]["driver_us"] == pytest.approx(4) and "driver_us" not in rows[1]
    assert rows[0]["python_us"] == pytest.approx(5) and rows[1]["python_us"] == pytest.approx(21)  # 30 - 5 - 4
    assert rows[3]["python_us"] == pytest.approx(20), "from 50 us to 110 us, the poll's 40 us left out"


def test_the_summary_takes_medians_and_the_text_has_a_column_per_rank():
    summary = timeline.summarize([_record(0), _record(5), _record(8)])
    assert summary["calls"] == 3 and summary["phases_us"]["poll"] == pytest.approx(45)
    assert summary["calibration_us"] == {"p50": 8.0, "max": 11.0}
    assert summary["kernels_us"]["3:receive_copy"]["gap_us"] == pytest.approx(7)  # 12, 7, 4 after polls of 100-108
    lines = timeline.format_summary("tokens=128 new_sync", [summary, summary], [0.0, 7.5])
    assert lines[0].startswith("== tokens=128 new_sync") and "rank 1" in lines[1]
    assert lines[2].split() == ["start", "skew", "0.0", "7.5"]
    assert timeline.start_skew([[1.0, 2.0], [1.000010, 2.000004]]) == pytest.approx([0.0, 7.0])
    assert any(line.split()[0] == "poll" and line.split()[1:] == ["45.0", "45.0"] for line in lines), lines
    assert any(line.strip().startswith("3:receive_copy") for line in lines), lines


class _FakeEvent:
    """A CUDA event on the host clock: recorded = its time, done at once."""

    def __init__(self):
        self.at = None
        self.done = True

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass


def _fake_cupy(events):
    def event_record(ptr, stream):
        events[ptr].record()

    def make_event():
        e = _FakeEvent()
        e.ptr = len(events)
        events.append(e)
        return e

    stream = SimpleNamespace(synchronize=lambda: None)
    cuda = SimpleNamespace(Event=make_event, get_current_stream=lambda: stream,
                           runtime=SimpleNamespace(eventRecord=event_record),
                           get_elapsed_time=lambda a, b: (b.at - a.at) * 1e3)
    return SimpleNamespace(cuda=cuda)


def _stand_in_poll(polled):
    """A runner's ``_poll`` with ``StepRunner._poll``'s parameters (held to them below), noting its calls."""
    def poll(marker, what, tag=-1):
        polled.append((marker, what, tag))
    return poll


def test_one_timed_call_through_the_recorder_notes_launches_and_the_poll_and_restores_them():
    events, launched = [], []
    raw = SimpleNamespace(launch=lambda *args: launched.append(args[-1]))
    runner, polled = SimpleNamespace(), []
    runner._poll = original_poll = _stand_in_poll(polled)
    original_launch = raw.launch
    recorder = timeline._Recorder(_fake_cupy(events), runner, raw, pool=4)

    def op():
        raw.launch("f", 1, 32, 0, 7, 0, "kernel count_kernel")
        runner._poll("marker", "dispatch", 5)
        raw.launch("f", 1, 32, 0, 7, 0, "kernel receive_compact_kernel")

    record = timeline._timed_call(_fake_cupy(events), recorder, op)
    assert launched == ["kernel count_kernel", "kernel receive_compact_kernel"]
    assert polled == [("marker", "dispatch", 5)]
    assert [launch["name"] for launch in record["launches"]] == ["count_kernel", "receive_compact_kernel"]
    assert record["poll"] is not None and record["start"] <= record["poll"][0] <= record["poll"][1] <= record["end"]
    first = record["launches"][0]
    assert record["start"] <= first["host"] and first["gpu"][0] <= first["gpu"][1] <= record["gpu_done"]
    assert 0 <= first["driver"] < record["end"] - record["start"]
    phases = timeline.call_phases(record)
    assert set(phases) == {"call", "enqueue", "poll", "after_poll", "gpu_done"}
    recorder.restore()
    assert raw.launch is original_launch and runner._poll is original_poll


def test_the_stand_in_poll_has_the_backends_poll_parameters():
    from ep_comm.backends.nvshmem.steps import StepRunner

    real = list(inspect.signature(StepRunner._poll).parameters)[1:]  # without self
    assert list(inspect.signature(_stand_in_poll([])).parameters) == real


def test_the_command_line_refuses_an_unknown_op(capsys):
    with pytest.raises(SystemExit):
        timeline.main(["--out", "/tmp/never", "--ops", "new_sync,teleport"])
    assert "teleport" in capsys.readouterr().err
