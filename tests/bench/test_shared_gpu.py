"""Ranks sharing a GPU, on CPU: the benchmark's detection (fake GPU ids), the marks its report, JSON
and CSV carry (a fabricated sample), what it skips; and the soak's per-process memory figures (a
fake NVML query)."""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess

import pytest

from ep_comm.bench import runner, shared_gpu
from ep_comm.bench.measure import RankSample
from ep_comm.bench.report import csv_row, format_report, summarize, write_csv, write_json
from ep_comm.soak.memory import GPU_WIDE_NOTE, MIB, MemoryProbe, MemoryTrack, memory_failures, process_used_bytes

NOTE = "shared GPU: not an NVLink figure"


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize("ids, shared", [
    ([None, None], False),                                       # the mpi backend: no GPU, nothing shared
    (["0000:19:00.0", "0000:3B:00.0"], False),                   # one rank per GPU
    (["0000:19:00.0", "0000:19:00.0"], True),                    # two ranks on one GPU
    (["0000:19:00.0", "0000:3B:00.0", "0000:19:00.0", "0000:3B:00.0"], True),  # two ranks per GPU
    (["0000:19:00.0"], False), ([], False), ([None, "0000:19:00.0", None], False),
])
def test_any_shared_from_gpu_ids(ids, shared):
    assert shared_gpu.any_shared(ids) is shared


class FakeComm:
    """``allgather`` of a communicator whose other ranks hold ``others``."""

    def __init__(self, others):
        self.others = others

    def allgather(self, mine):
        return [mine] + list(self.others)


def test_ranks_share_a_gpu_gathers_every_ranks_id():
    assert shared_gpu.ranks_share_a_gpu(FakeComm(["b", "a"]), "a")
    assert not shared_gpu.ranks_share_a_gpu(FakeComm(["b", "c"]), "a")
    assert not shared_gpu.ranks_share_a_gpu(FakeComm([None]), None)


def test_a_shared_gpu_run_skips_nccl_and_the_ceiling_and_says_why():
    meta = {}
    args = argparse.Namespace(no_baselines=False)
    assert runner._gpu_extras(FakeComm([]), args, timer=None, meta=meta, shared=True) is None
    assert meta == {"nvlink_ceiling_gbps": None, "nvlink_ceiling": shared_gpu.CEILING_SKIPPED,
                    "baselines": shared_gpu.BASELINES_SKIPPED}
    assert "NCCL refuses two ranks on one GPU" in meta["baselines"]
    line = shared_gpu.skip_line(no_baselines=False)
    assert "\n" not in line and "NCCL baselines" in line and "NVLink ceiling" in line and NOTE in line
    assert "NCCL" not in shared_gpu.skip_line(no_baselines=True)


# ------------------------------------------------------------------ marks on every figure
def _sample(rank, recv, from_self):
    return RankSample(rank=rank, num_tokens=10, rows_sent=12, recv_rows=recv, recv_from_self=from_self,
                      expanded_rows=0, failures=[], times={"dispatch": [1e-3, 2e-3, 3e-3], "combine": [1e-3] * 3})


def _points(shared):
    samples = [_sample(0, 8, 3), _sample(1, 16, 9)]
    return [summarize(samples, 100, 16, 16, shared_gpu=shared), summarize(samples, 100, None, 132, shared_gpu=shared)]


def test_points_of_a_shared_gpu_run_carry_the_note():
    for point in _points(True):
        assert point["shared_gpu"] is True and point["note"] == NOTE
    for point in _points(False):
        assert point["shared_gpu"] is False and "note" not in point
    assert summarize([_sample(0, 8, 3)], 100)["shared_gpu"] is False, "not shared unless said"


def test_text_report_marks_every_point_and_the_sm_table():
    text = format_report({"backend": "nvshmem", "shared_gpu": True, "note": NOTE}, _points(True))
    headers = [line for line in text.splitlines() if line.startswith("== ")]
    assert len(headers) == 3 and all(line.endswith(f"[{NOTE}]") for line in headers), headers
    assert f"note={NOTE}" in text.splitlines()[0], "the run's header says it too"
    plain = format_report({"backend": "nvshmem", "shared_gpu": False}, _points(False))
    assert "shared GPU" not in plain


def test_json_and_csv_mark_a_shared_gpu_run(tmp_path):
    points = _points(True)
    write_json(str(tmp_path / "bench.json"), {"shared_gpu": True, "note": NOTE}, points)
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["shared_gpu"] is True and result["meta"]["note"] == NOTE
    assert all(p["shared_gpu"] and p["note"] == NOTE for p in result["points"])
    write_csv(str(tmp_path / "bench.csv"), points)
    with open(tmp_path / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["shared_gpu"], r["note"]) for r in rows] == [("True", NOTE)] * 2
    row = csv_row(_points(False)[0])
    assert (row["shared_gpu"], row["note"]) == (False, "")
    assert list(row)[:4] == ["tokens_per_rank", "num_sms", "num_sms_in_effect", "check_passed"], "new columns go last"


# ------------------------------------------------------------------ the soak's memory of this process
def test_process_used_bytes_reads_this_pids_lines():
    listing = "4242, 618\n17, 1000\n4242, 2\n99, [N/A]\n"
    assert process_used_bytes(listing, 4242) == 620 * MIB, "one line per GPU the process holds memory on"
    assert process_used_bytes(listing, 17) == 1000 * MIB
    assert process_used_bytes(listing, 99) is None, "NVML has no figure (e.g. under MPS)"
    assert process_used_bytes(listing, 5) is None and process_used_bytes("", 5) is None
    assert process_used_bytes("424, 7\n", 42) is None, "the pid matches whole"


def _probe(listing=None, error=None) -> MemoryProbe:
    def query() -> str:
        if error is not None:
            raise error
        return listing.format(pid=os.getpid())

    return MemoryProbe(gpu=True, compute_apps=query)


def test_probe_measures_this_process_and_notes_when_it_cannot():
    found = _probe("1, 5000\n{pid}, 618\n")
    assert found.process_device_bytes() == 618 * MIB and found.notes() == [GPU_WIDE_NOTE]
    mps = _probe("1, 5000\n")  # under MPS NVML lists the MPS server, not the clients
    assert mps.process_device_bytes() is None and mps.process_device_bytes() is None
    assert len(mps.notes()) == 2 and "not measured in 2 sample(s)" in mps.notes()[1]
    assert f"no memory of pid {os.getpid()}" in mps.notes()[1] and "MPS" in mps.notes()[1]
    missing = _probe(error=FileNotFoundError(2, "No such file or directory", "nvidia-smi"))
    assert missing.process_device_bytes() is None and "nvidia-smi failed: FileNotFoundError" in missing.notes()[1]
    hung = _probe(error=subprocess.TimeoutExpired("nvidia-smi", 30))
    assert hung.process_device_bytes() is None and "TimeoutExpired" in hung.notes()[1]
    cpu = MemoryProbe(gpu=False)
    assert set(cpu.sample()) == {"rss_bytes"} and cpu.notes() == []


def test_gpu_wide_growth_is_reported_not_failed_and_own_growth_fails():
    track = MemoryTrack()
    for i, (wide, own) in enumerate([(4000, 600), (4400, 640), (5018, 650)]):  # MiB
        track.add({"rss_bytes": 100 * MIB, "pool_used_bytes": 14 * MIB, "gpu_wide_used_bytes": wide * MIB,
                   "process_device_bytes": own * MIB}, is_baseline=i == 1)
    summary = track.summary(64 * MIB)
    assert summary["gpu_wide_used_bytes"]["growth"] == 618 * MIB and summary["gpu_wide_used_bytes"]["ok"]
    assert memory_failures("soak", summary, 64 * MIB) == []
    track.add({"rss_bytes": 100 * MIB, "pool_used_bytes": 14 * MIB, "gpu_wide_used_bytes": 4000 * MIB,
               "process_device_bytes": 740 * MIB})
    failures = memory_failures("soak", track.summary(64 * MIB), 64 * MIB)
    assert len(failures) == 1 and failures[0].startswith("soak: process_device_bytes grew by 100.0 MiB")


def test_a_metric_missing_from_some_samples_is_left_out_of_the_summary():
    track = MemoryTrack()
    track.add({"rss_bytes": 1, "process_device_bytes": 5})
    track.add({"rss_bytes": 2})
    assert list(track.summary(0)) == ["rss_bytes"]
