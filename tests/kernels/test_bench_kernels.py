"""Every measurement of ``python -m ep_comm.bench.kernels`` runs, at a tiny shape."""
from __future__ import annotations

from ep_comm.bench.kernels import Bench, parse_args


def test_every_measurement_launches(xp):
    a = parse_args(["--tokens", "6", "--hidden", "8", "--experts", "8", "--topk", "2", "--alignment", "4",
                    "--blocks", "2", "--warps-per-block", "2"])
    bench = Bench(xp, a)
    assert bench.num_rows > 0 and bench.num_expanded >= bench.num_rows
    for launch, _ in bench.measurements().values():
        launch()
