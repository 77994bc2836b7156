"""``--plot``: legends outside the data, series told apart by line and marker, a single point visible."""
from __future__ import annotations

import pytest

from ep_comm.bench.measure import RankSample
from ep_comm.bench.report import summarize, write_plot

matplotlib = pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install -e '.[bench]')")


def one_point(sms):
    sample = RankSample(rank=0, num_tokens=64, rows_sent=64, recv_rows=64, recv_from_self=32, expanded_rows=0,
                        failures=[], times={"dispatch": [1e-3, 2e-3], "combine": [1e-3, 3e-3]})
    return summarize([sample], row_bytes=512, num_sms=sms)


def test_a_plot_of_one_point_per_sm_count(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    path = tmp_path / "p.png"
    write_plot(str(path), {"config": "c", "backend": "mpi", "ranks": 1}, [one_point(None), one_point(16)])
    assert path.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert ax.get_legend().get_window_extent(renderer).x0 > ax.get_window_extent(renderer).x1, "legend right of it"
        lines = ax.get_lines()
        assert all(line.get_marker() not in ("None", "", None) for line in lines), "a single point shows its marker"
        styles = {(line.get_label().split()[1], line.get_linestyle(), line.get_marker()) for line in lines}
        assert len({s[0] for s in styles}) == len(styles) == 2, styles  # logical/nvlink or p50/p99, each its own
