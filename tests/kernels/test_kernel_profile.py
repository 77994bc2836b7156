"""The kernel profile command's host side on CPU: ncu's --csv output parsed and summarised, the command line, the
missing-ncu error. The fixture ``data/ncu_sample.csv`` has ncu's layout (``==PROF==`` lines, one quoted row per
launch and metric, thousands separators, an ``n/a``) with kernels of two shapes."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

from ep_comm.bench import kernel_profile as kp

SAMPLE = Path(__file__).parent / "data" / "ncu_sample.csv"


def test_short_names():
    numba = "cudapy::ep_comm::kernels::count::count_kernel[abi:v1,cw51](Array<long long, 2, C>, int)"
    assert kp.short_name(numba) == "count_kernel"
    assert kp.short_name("signal_and_wait") == "signal_and_wait"
    assert kp.short_name("void ns::f<int>(int*)") == "f"


def test_parse_launches_in_order():
    launches = kp.parse_csv(SAMPLE.read_text())
    assert [x.kernel for x in launches] == ["count_kernel", "scatter_kernel", "signal_and_wait", "count_kernel",
                                            "scatter_kernel", "count_kernel", "signal_and_wait"]
    first = launches[0].values
    assert first[kp.TIME_METRIC] == pytest.approx(20.4)  # 20,400 ns
    assert first["launch__registers_per_thread"] == 92
    assert math.isnan(launches[5].values["dram__throughput.avg.pct_of_peak_sustained_elapsed"])


def test_summary_medians_per_kernel_and_shape():
    rows = kp.summarize(kp.parse_csv(SAMPLE.read_text()))
    by = {(r.kernel, r.grid): r for r in rows}
    assert [r.kernel for r in rows] == ["count_kernel", "scatter_kernel", "signal_and_wait", "scatter_kernel"]
    count = by["count_kernel", 1]
    assert (count.launches, count.time_us, count.registers, count.block) == (3, pytest.approx(20.4), 92, 256)
    assert count.dram_pct == pytest.approx(0.25)  # the n/a left out
    assert by["scatter_kernel", 4].time_us == pytest.approx(10.5)
    assert by["scatter_kernel", 128].time_us == pytest.approx(14.2)
    assert by["signal_and_wait", 1].time_us == pytest.approx(9.7)
    table = kp.format_table(rows).splitlines()
    assert table[0].split()[:3] == ["kernel", "n", "time"] and table[1].split()[:3] == ["count_kernel", "3", "20.4"]


def test_time_units():
    assert kp.metric_value("1.5", "usecond", kp.TIME_METRIC) == 1.5
    assert kp.metric_value("2", "msecond", kp.TIME_METRIC) == 2000.0
    assert kp.metric_value("1,234", "%", "sm__throughput.avg.pct_of_peak_sustained_elapsed") == 1234.0


def test_no_rows():
    assert kp.parse_csv("==PROF== Disconnected\n") == []
    assert kp.summarize([]) == []


def test_parse_only_writes_the_summary(tmp_path, capsys):
    assert kp.main(["--config", "deepseek_v3_decode", "--out", str(tmp_path), "--parse", str(SAMPLE)]) == 0
    assert "count_kernel" in capsys.readouterr().out
    record = json.loads((tmp_path / "kernels_deepseek_v3_decode.json").read_text())
    assert record["metrics"]["time_us"] == kp.TIME_METRIC
    assert [k["kernel"] for k in record["kernels"]][:2] == ["count_kernel", "scatter_kernel"]
    lines = (tmp_path / "kernels_deepseek_v3_decode.csv").read_text().splitlines()
    assert lines[0].startswith("kernel,launches,time_us") and len(lines) == 5


def test_missing_ncu_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    monkeypatch.setattr(kp, "DEFAULT_NCU", str(tmp_path / "absent" / "ncu"))
    with pytest.raises(kp.NcuMissing, match="ncu.*not found.*--ncu PATH"):
        kp.find_ncu()
    assert kp.main(["--out", str(tmp_path / "out")]) == kp.EXIT_NO_NCU
    assert "not found" in capsys.readouterr().err


def test_ncu_from_environment_and_command(tmp_path, monkeypatch):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("NCU", str(fake))
    assert kp.find_ncu() == str(fake)
    command = kp.ncu_command(kp.find_ncu(), "deepseek_v3_prefill", ["--tokens", "4096"], 150, 40,
                             ["--clock-control", "none"])
    assert command[0] == str(fake) and "--csv" in command and "--clock-control" in command
    metrics = command[command.index("--metrics") + 1].split(",")
    assert metrics == [name for _, name in kp.METRICS]
    bench = command[command.index("-m") + 1:]
    assert bench[:3] == ["ep_comm.bench", "--config", "deepseek_v3_prefill"]
    assert "--no-graphs" in bench and bench[-2:] == ["--tokens", "4096"]
    assert os.path.basename(command[command.index("-m") - 1]).startswith("python")


def test_bench_arguments_after_double_dash():
    a = kp.parse_args(["--config", "deepseek_v3_decode", "--", "--tokens", "128"])
    assert a.bench_args == ["--tokens", "128"]


def test_help_runs_nothing(capsys):
    with pytest.raises(SystemExit) as info:
        kp.main(["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m ep_comm.bench.kernel_profile [-h]")
