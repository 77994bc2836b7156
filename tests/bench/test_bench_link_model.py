"""``python -m ep_comm.bench --scaleup-ranks N`` under mpirun: the meta fields, each point's ``link_model`` equal to
``ep_comm.contract.traffic`` on the bench's own routing, the report's table, and the refused combinations."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from helpers.bench import bench_results, run_bench

from ep_comm.contract import traffic
from ep_comm.contract.topology import Topology
from ep_comm.testing import make_routing

RANKS, TOKENS, EXPERTS, TOPK, ROW_BYTES = 4, 64, 16, 4, 256 * 2  # cpu_demo: hidden 256 bfloat16, uniform, seed 0


def test_link_model_counts_the_rows_of_the_bench_routing_on_two_nodes(tmp_path):
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    done = run_bench(RANKS, "--config", "cpu_demo", "--tokens", str(TOKENS), "--scaleup-ranks", "2", "--iters", "1",
                     "--warmup", "0", "--json", str(out), "--csv", str(table))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    meta, point = result["meta"], result["points"][0]
    assert point["check_passed"], point["failures"]
    assert (meta["scaleup_ranks"], meta["num_nodes"], meta["transport"]) == (2, 2, "auto")
    assert meta["link_rates_gbps"] == {"scaleup": 356.0, "scaleout": 50.0}
    want = traffic.uniform_expectation(EXPERTS, TOPK, RANKS, 2)._asdict()
    assert meta["uniform_expectation"] == pytest.approx(want)

    routings = [make_routing("uniform", TOKENS, EXPERTS, TOPK, seed=(0, r)).topk_idx for r in range(RANKS)]
    rows = traffic.world_rows(routings, EXPERTS, Topology.of(RANKS, 2))
    model = point["link_model"]
    for i, op in enumerate(traffic.OPS):
        assert model[op]["row_bytes"] == ROW_BYTES
        assert model[op]["measured_p50_us"] == point["latency_us"][op]["p50"]
        for j, route in enumerate(traffic.ROUTES):
            for k, link in enumerate(traffic.LINKS):
                got = model[op][route][link]
                assert np.array(got["rows_per_token"]) * TOKENS == pytest.approx(rows[i, j, k])
                assert got["bytes_per_token"] == pytest.approx(list(rows[i, j, k] * ROW_BYTES / TOKENS))
                assert got["rows_per_token_max"] == pytest.approx(rows[i, j, k].max() / TOKENS)
                assert got["bytes_per_token_mean"] == pytest.approx(rows[i, j, k].sum() * ROW_BYTES / (RANKS * TOKENS))
            nbytes = rows[i, j] * ROW_BYTES
            assert model[op][route]["model_us"] == pytest.approx(traffic.model_time_s(nbytes[0], nbytes[1]) * 1e6)
        counted = model[op]["counted_scaleout"]  # Buffer.traffic() on mpi: the flat Buffer sends the flat rows
        assert np.array(counted["rows_per_token"]) * TOKENS == pytest.approx(rows[i, 0, 1])
        ratio = rows[i, 1, 1].sum() / rows[i, 0, 1].sum()
        assert model[op]["forwarded_over_flat"]["scaleout_bytes"] == pytest.approx(ratio)
    assert model["dispatch"]["forwarded_over_flat"]["scaleout_bytes"] < 1
    # the forwarded combine sends one summed row per token and remote node back: the dispatch's saving
    assert model["combine"]["forwarded_over_flat"]["scaleout_bytes"] == pytest.approx(
        model["dispatch"]["forwarded_over_flat"]["scaleout_bytes"])
    assert "link model (rows/token sent per rank" in done.stdout
    assert "dispatch scale-out rows the Buffer counted (Buffer.traffic): " in done.stdout
    assert "dispatch forwarded/flat scale-out bytes: " in done.stdout
    assert_csv_has_the_link_model(table, model)


def assert_csv_has_the_link_model(table, model) -> None:
    """The CSV row carries the link model's means, model times, ratio and counted rows per operation and route."""
    (row,) = list(csv.DictReader(table.open()))
    for op in traffic.OPS:
        for route in traffic.ROUTES:
            for link in traffic.LINKS:
                got = float(row[f"link_{op}_{route}_{link}_rows_per_token"])
                assert got == pytest.approx(model[op][route][link]["rows_per_token_mean"])
            assert float(row[f"link_{op}_{route}_scaleout_bytes_per_token"]) == pytest.approx(
                model[op][route]["scaleout"]["bytes_per_token_mean"])
            assert float(row[f"link_{op}_{route}_model_us"]) == pytest.approx(model[op][route]["model_us"])
        assert float(row[f"link_{op}_forwarded_over_flat_scaleout_bytes"]) == pytest.approx(
            model[op]["forwarded_over_flat"]["scaleout_bytes"])
        assert float(row[f"link_{op}_counted_scaleout_rows_per_token"]) == pytest.approx(
            model[op]["counted_scaleout"]["rows_per_token_mean"])


def test_forwarding_on_two_nodes_checks_its_round_trips_in_the_forwarded_order(tmp_path):
    """``--forwarding``: the Buffer forwards, and every round trip of the point (eager, cached, host calls) is
    compared with ``expected_round_trip(forwarded=...)`` (the bench sends each partial back unchanged, so the sums are
    exact in any order: what this catches is a partial lost or doubled on the forwarded route)."""
    result, _ = bench_results(tmp_path, RANKS, "--config", "cpu_demo", "--tokens", str(TOKENS), "--scaleup-ranks",
                              "2", "--forwarding", "--iters", "1", "--warmup", "0", "--quiet")
    point = result["points"][0]
    assert point["check_passed"], point["failures"]
    assert (result["meta"]["forwarding"], result["meta"]["num_nodes"]) == (True, 2)


def test_without_scaleup_ranks_there_is_no_link_model(tmp_path):
    result, table = bench_results(tmp_path, 2, "--config", "cpu_demo", "--tokens", "8", "--iters", "1", "--warmup", "0",
                                  "--quiet")
    assert result["meta"]["transport"] == "auto", "the Buffer's default"
    assert result["meta"]["transport_in_effect"] is None, "the mpi backend has no transport to choose"
    assert "scaleup_ranks" not in result["meta"]
    assert "link_model" not in result["points"][0]
    assert not [name for name in next(csv.reader(table.open())) if name.startswith("link_")]


@pytest.mark.parametrize("args, message", [
    (["--scaleup-ranks", "3"], "--scaleup-ranks: scaleup_ranks=3: must be >= 1 and divide the rank count 4"),
    (["--scaleup-ranks", "2", "--transport", "stores"], "transport='stores' with scaleup_ranks=2"),
    (["--forwarding"], "--forwarding: the 4 ranks of this run are one node (--scaleup-ranks not given)"),
    (["--forwarding", "--scaleup-ranks", "4"], "--forwarding: the 4 ranks of this run are one node (--scaleup-ranks 4)"),
])
def test_scaleup_ranks_that_cannot_run_are_refused(args, message):
    done = run_bench(RANKS, "--config", "cpu_demo", "--tokens", "8", "--iters", "1", "--quiet", *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
