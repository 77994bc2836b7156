"""The benchmark: its reference and report pieces in-process, and the whole command under mpirun.

Timings are printed and written, never asserted on.
"""
import inspect
import io
import json
from pathlib import Path

import numpy as np
import pytest
from helpers.bench import run_bench

from ep_comm import Buffer
from ep_comm.bench.__main__ import parser
from ep_comm.bench.measure import RankSample, fp8_failures
from ep_comm.bench.report import Progress, csv_row, format_point, summarize
from ep_comm.contract import fp8
from ep_comm.contract.choices import payload_dtype
from ep_comm.testing import expected_round_trip, first_mismatch, uniform_routing


# ------------------------------------------------------------------ in-process pieces
def test_expected_round_trip_compact_counts_ranks_reached():
    x = np.arange(1, 4 * 8 + 1, dtype=np.float32).reshape(4, 8)
    topk_idx = np.array([[0, 1], [0, 7], [4, 5], [6, -1]])  # 8 experts on 4 ranks: 2 per rank
    got = expected_round_trip(x, topk_idx, num_experts=8, num_ranks=4, expand=False)
    np.testing.assert_array_equal(got, x * np.array([1, 2, 1, 1])[:, None])


def test_expected_round_trip_expand_counts_experts_picked():
    x = np.arange(1, 4 * 8 + 1, dtype=np.float32).reshape(4, 8)
    topk_idx = np.array([[0, 1], [0, 7], [4, 5], [6, -1]])
    got = expected_round_trip(x, topk_idx, num_experts=8, num_ranks=4, expand=True)
    np.testing.assert_array_equal(got, x * np.array([2, 2, 2, 1])[:, None])


def test_expected_round_trip_rounds_once_per_partial_in_bf16():
    bf16 = payload_dtype("bfloat16")
    x = np.array([[1.0078125]], dtype=np.float32).astype(bf16)  # 1 + 2**-7: the last bf16 bit
    topk_idx = np.array([[0, 1, 2]])  # three experts of rank 0 (expand), one rank reached (compact)
    three = expected_round_trip(x, topk_idx, num_experts=4, num_ranks=1, expand=True)
    assert three.dtype == bf16
    assert float(three[0, 0]) == float(np.float32(3 * 1.0078125).astype(bf16))


def test_first_mismatch_reports_position_and_values():
    a = np.zeros((3, 4), dtype=np.float32)
    assert first_mismatch(a, a.copy()) is None
    b = a.copy()
    b[2, 1] = 1.5
    assert first_mismatch(b, a) == "token 2 hidden 1: got 1.5, expected 0.0"
    assert "expected (3, 4)" in first_mismatch(a[:2], a)
    assert first_mismatch(-a, a) is not None, "-0.0 and +0.0 differ bitwise"


def _sample(rank, recv, from_self, failures=()):
    return RankSample(rank=rank, num_tokens=10, rows_sent=12, recv_rows=recv, recv_from_self=from_self,
                      expanded_rows=0, failures=list(failures),
                      times={"dispatch": [1e-3, 2e-3, 3e-3], "combine": [1e-3] * 3, "nccl_dedup": [4e-3] * 3})


def test_summarize_counts_bytes_imbalance_and_ratios():
    point = summarize([_sample(0, 8, 3), _sample(1, 16, 9, ["boom"])], row_bytes=100)
    assert point["imbalance"] == pytest.approx(16 / 12)
    assert point["logical_bytes"] == [800, 1600] and point["nvlink_bytes"] == [500, 700]
    assert point["recv_from_peers"] == [5, 7]
    assert point["latency_us"]["dispatch"]["p50"] == pytest.approx(2000)
    assert point["latency_us"]["round_trip"]["p50"] == pytest.approx(3000)
    assert point["baseline_over_ep_comm"] == {"nccl_dedup": pytest.approx(2.0)}
    assert point["bandwidth_gbps"]["dispatch"]["logical"] == pytest.approx((800 + 1600) / 2 / 2e-3 / 1e9)
    assert not point["check_passed"] and point["failures"] == ["rank 1: boom"]
    assert point["tokens_per_s"] == pytest.approx(20 / 3e-3)
    assert csv_row(point)["nccl_dedup_over_ep_comm"] == pytest.approx(2.0)


def test_summarize_puts_each_graph_replay_over_the_same_run_device_copy():
    samples = [_sample(r, 8, 8) for r in range(2)]
    for s, slow in zip(samples, (1, 2)):
        s.times["device_copy"] = [1e-6 * slow] * 3
        s.graph_times = {"dispatch": [3e-6] * 3, "combine": [2e-6 * slow] * 3}
    point = summarize(samples, row_bytes=100)
    assert point["latency_us"]["device_copy"]["p50"] == pytest.approx(2.0)  # the slowest rank's
    assert point["graph_over_device_copy"] == {"dispatch": pytest.approx(1.5), "combine": pytest.approx(2.0)}
    assert csv_row(point)["graph_combine_over_device_copy"] == pytest.approx(2.0)
    assert summarize([_sample(0, 8, 8)], row_bytes=100)["graph_over_device_copy"] == {}


def test_summarize_counts_fp8_dispatch_bytes_and_each_copy_against_its_operation():
    samples = [_sample(r, 8, 3) for r in range(2)]
    for s in samples:
        s.times.update(device_copy=[1e-6] * 3, device_copy_combine=[4e-6] * 3, dispatch_cached=[1e-3] * 3,
                       dispatch_cast=[1.5e-3] * 3)
        s.graph_times = {"dispatch": [3e-6] * 3, "combine": [8e-6] * 3}
    point = summarize(samples, row_bytes={"dispatch": 264, "combine": 512})
    assert point["row_bytes"] == {"dispatch": 264, "combine": 512}
    assert point["logical_bytes"] == [8 * 264] * 2 and point["nvlink_bytes"] == [5 * 264] * 2
    assert point["bandwidth_gbps"]["combine"]["logical"] == pytest.approx(8 * 512 / 1e-3 / 1e9)
    assert point["graph_over_device_copy"] == {"dispatch": pytest.approx(3.0), "combine": pytest.approx(2.0)}
    assert point["baseline_over_ep_comm"] == {"nccl_dedup": pytest.approx(2.0), "device_copy": pytest.approx(5e-4),
                                              "device_copy_combine": pytest.approx(4e-3)}, "the cast rows are no baseline"
    text = format_point(point, None)
    assert "(bytes per row: dispatch 264 (FP8 + scales), combine 512)" in text
    assert "the cast adds 500.0 us at p50" in text and "baseline device_copy_combine: p50 4.0 us, 0.00x ep_comm's combine" in text
    assert (csv_row(point)["dispatch_row_bytes"], csv_row(point)["combine_row_bytes"]) == (264, 512)


def test_summarize_sets_an_fp8_run_over_its_same_run_bfloat16_dispatches():
    samples = [_sample(r, 8, 3) for r in range(2)]
    for s, slow in zip(samples, (1, 2)):
        s.times["device_copy"] = [1e-6] * 3
        s.graph_times = {"dispatch": [3e-6 * slow] * 3, "combine": [2e-6] * 3, "dispatch_new": [6e-6] * 3,
                         "combine_new": [2e-6] * 3, "dispatch_bf16": [5e-6] * 3, "dispatch_new_bf16": [8e-6] * 3}
    point = summarize(samples, row_bytes={"dispatch": 264, "combine": 512})
    assert point["graph_fp8_over_bf16"] == {"dispatch": pytest.approx(6 / 5), "dispatch_new": pytest.approx(6 / 8)}
    assert set(point["graph_over_device_copy"]) == {"dispatch", "combine", "dispatch_new", "combine_new"}
    assert "FP8 dispatch over the same-run dispatch of x in the payload dtype (p50): dispatch 1.20x, " \
           "dispatch_new 0.75x" in format_point(point, None)
    assert csv_row(point)["graph_dispatch_new_fp8_over_bf16"] == pytest.approx(0.75)
    assert summarize([_sample(0, 8, 8)], row_bytes=100)["graph_fp8_over_bf16"] == {}


class _Handle:
    expand, num_recv_tokens = False, 3


class _Out:
    """What fp8_failures reads of a compact FP8 DispatchOutput: the pair, the handle's row count."""

    def __init__(self, y):
        self.recv_x, self.handle = fp8.quantize(y), _Handle()


def test_fp8_check_compares_received_rows_with_the_quantized_sent_rows_byte_for_byte():
    y = np.random.default_rng(0).standard_normal((4, 256)).astype(payload_dtype("bfloat16"))
    out = _Out(y)
    assert fp8_failures(out, y, "first") == []
    out.recv_x[1][2, 1] *= 2  # one scale of row 2
    assert fp8_failures(out, y, "first") == ["FP8 rows (first) differ from ep_comm.contract.fp8.quantize of the sent rows: "
                                             "1 of 3 rows, first recv_x row 2"]
    y[3] = np.nan
    assert fp8_failures(_Out(y[:3]), y, "last") == [], "rows past num_recv_tokens are not checked"


def test_progress_prints_only_a_final_line_off_a_tty_and_nothing_when_quiet():
    out = io.StringIO()
    progress = Progress(live=False, final=True, stream=out)
    progress.start("64 tokens/rank", 5)
    for i in range(5):
        progress.tick(i + 1)
    progress.finish("ok")
    assert out.getvalue() == "[ep_comm.bench] 64 tokens/rank: ok\n"
    quiet = io.StringIO()
    Progress(live=False, final=False, stream=quiet).finish("ok")
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("argv", [["--sweep", "12,x"], ["--sweep", "0"], ["--iters", "0"], ["--routing", "bursty"],
                                  ["--backend", "tpu"], ["--tokens", "8", "--sweep", "8,16"], ["--num-sms", "0"],
                                  ["--num-sms", "16,x"], ["--num-sms", "16,16"], ["--num-sms", "all,ALL"],
                                  ["--num-sms", ""], ["--num-sms", "-4"], ["--num-sms", "1.5"],
                                  ["--sweep", "1,,2"], ["--sweep", "1,"], ["--num-sms", "16,,32"],
                                  ["--alignment", "3"], ["--straggler", "2"], ["--straggler", "-1:5"],
                                  ["--straggler", "a:5"], ["--straggler", "1:x"]])
def test_cli_rejects_bad_options(argv, capsys):
    from ep_comm.bench.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_bench_takes_the_buffers_default_transport():
    assert parser().get_default("transport") == inspect.signature(Buffer).parameters["transport"].default == "auto"


def test_cli_parses_sweep_lists():
    assert parser().parse_args(["--sweep", "128, 512,4096"]).sweep == [128, 512, 4096]


def test_cli_parses_sm_counts_with_all_as_none():
    assert parser().parse_args([]).num_sms == [None], "default: all SMs only"
    assert parser().parse_args(["--num-sms", "16,32,all"]).num_sms == [16, 32, None]
    assert parser().parse_args(["--num-sms", "All 8"]).num_sms == [None, 8]


def test_bad_sm_count_message_names_the_option_and_the_rule(capsys):
    from ep_comm.bench.__main__ import main

    with pytest.raises(SystemExit):
        main(["--num-sms", "16,0"])
    err = capsys.readouterr().err
    assert "--num-sms" in err and "'16,0'" in err and "distinct SM counts >= 1 or 'all'" in err


def test_summary_and_csv_carry_the_sm_count():
    samples = [_sample(0, 8, 3), _sample(1, 16, 9)]
    everything = summarize(samples, row_bytes=100)
    assert everything["num_sms"] == "all" and everything["num_sms_in_effect"] is None
    sixteen = summarize(samples, row_bytes=100, num_sms=16, num_sms_in_effect=16)
    assert (sixteen["num_sms"], sixteen["num_sms_in_effect"]) == (16, 16)
    row = csv_row(sixteen)
    assert list(row)[:3] == ["tokens_per_rank", "num_sms", "num_sms_in_effect"] and row["num_sms"] == 16
    assert csv_row(everything)["num_sms_in_effect"] == ""


def test_report_names_the_sm_count_of_each_point_and_compares_them():
    from ep_comm.bench.report import format_report

    samples = [_sample(0, 8, 3), _sample(1, 16, 9)]
    gpu = [summarize(samples, 100, 16, 16), summarize(samples, 100, None, 132)]
    text = format_report({"backend": "nvshmem"}, gpu)
    assert "== 10 tokens/rank, num_sms=16: round trip OK" in text
    assert "== 10 tokens/rank, num_sms=all (132 SMs): round trip OK" in text
    table = text[text.index("== per SM count"):].splitlines()
    assert len(table) == 4 and table[2].split()[:2] == ["10", "16"] and table[3].split()[:3] == ["10", "all", "(132)"]
    cpu = format_report({"backend": "mpi"}, [summarize(samples, 100, 16, None)])
    assert "num_sms=16 (no effect on mpi)" in cpu and "per SM count" not in cpu, "one SM count: no comparison"


def test_routing_used_by_bench_is_seeded_per_rank():
    a, b = uniform_routing(16, 16, 4, seed=(0, 0)), uniform_routing(16, 16, 4, seed=(0, 1))
    assert not np.array_equal(a.topk_idx, b.topk_idx)


# ------------------------------------------------------------------ the command under mpirun
def _check_json(path: Path, nranks: int, tokens: int, hidden: int = 256, itemsize: int = 2, row_bytes: int = 0):
    """The JSON's fields; ``row_bytes``: the dispatch's bytes per row (default ``hidden * itemsize``)."""
    row_bytes = row_bytes or hidden * itemsize
    result = json.loads(path.read_text())
    meta, points = result["meta"], result["points"]
    assert meta["ranks"] == nranks and meta["backend"] == "mpi" and meta["config"] == "cpu_demo"
    for point in points:
        assert point["check_passed"], point["failures"]
        assert tokens is None or point["tokens_per_rank"] == tokens
        assert sum(point["rows_sent"]) == sum(point["recv_rows"])
        assert all(peers <= recv for peers, recv in zip(point["recv_from_peers"], point["recv_rows"]))
        assert point["logical_bytes"] == [r * row_bytes for r in point["recv_rows"]]
        assert point["nvlink_bytes"] == [p * row_bytes for p in point["recv_from_peers"]]
        assert point["imbalance"] == pytest.approx(max(point["recv_rows"]) / np.mean(point["recv_rows"]))
        assert len(point["latency_us"]["dispatch"]["p50_per_rank"]) == nranks
    return meta, points


def test_bench_smoke_two_ranks(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench(2, "--config", "cpu_demo", "--iters", "3", "--warmup", "1", "--json", str(out),
                     "--csv", str(tmp_path / "bench.csv"))
    assert done.returncode == 0, done.stdout + done.stderr
    meta, points = _check_json(out, 2, 256)
    assert meta["command"] == (f"mpirun -np 2 python -m ep_comm.bench --config cpu_demo --iters 3 --warmup 1 "
                               f"--json {out} --csv {tmp_path / 'bench.csv'}")
    assert len(points) == 1
    assert "round trip OK" in done.stdout
    assert (tmp_path / "bench.csv").read_text().startswith("tokens_per_rank,num_sms,num_sms_in_effect,check_passed,")


def test_bench_straggler_is_named_by_the_wait_statistics(tmp_path):
    """``--straggler 1:20000``: rank 1 sleeps 20 ms before each call; rank 0's waits name it (a name, not a time)."""
    out = tmp_path / "bench.json"
    done = run_bench(2, "--config", "cpu_demo", "--iters", "3", "--warmup", "1", "--straggler", "1:20000",
                     "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["meta"]["straggler"] == {"rank": 1, "us": 20000.0} and result["meta"]["wait_stats"] is True
    waits = result["points"][0]["wait_stats"]
    assert len(waits["late_share"]) == len(waits["wait_us_p50"]) == 2 and list(waits["by_part"]) == ["eager"]
    assert waits["late_share"][1] > waits["late_share"][0] and waits["wait_us_p50"][1] > 0
    assert "waits: rank 1 made the others wait most" in done.stdout


def test_bench_expand_sweep_zipf_four_ranks(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench(4, "--config", "cpu_demo", "--expand", "--alignment", "4", "--routing", "zipf",
                     "--sweep", "32,128", "--iters", "2", "--warmup", "0", "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == ""
    meta, points = json.loads(out.read_text())["meta"], json.loads(out.read_text())["points"]
    assert meta["mode"] == "expand" and meta["routing"] == "zipf"
    assert [p["tokens_per_rank"] for p in points] == [32, 128]
    for point in points:
        assert point["check_passed"], point["failures"]
        assert all(e % 4 == 0 and e >= r for e, r in zip(point["expanded_rows"], point["recv_rows"]))
        assert point["first_round_trip_s"] > 0
        assert set(point["host_us"]) == {"dispatch_cached_async", "combine", "dispatch_new_async"}
        assert all(len(v["p50_per_rank"]) == 4 and v["p50"] > 0 for v in point["host_us"].values())


def test_bench_runs_every_point_per_sm_count(tmp_path):
    """On mpi the SM counts run the same CPU path (no kernels); each point still says which count it was."""
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    done = run_bench(2, "--config", "cpu_demo", "--sweep", "16,32", "--num-sms", "16,all", "--iters", "2",
                     "--warmup", "0", "--json", str(out), "--csv", str(table))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not used" not in done.stderr
    meta, points = _check_json(out, 2, None)
    assert meta["num_sms"] == "16,all"
    assert [(p["num_sms"], p["tokens_per_rank"]) for p in points] == [(16, 16), (16, 32), ("all", 16), ("all", 32)]
    assert all(p["num_sms_in_effect"] is None for p in points)
    rows = table.read_text().splitlines()
    assert rows[0].startswith("tokens_per_rank,num_sms,num_sms_in_effect,")
    assert [r.split(",")[:2] for r in rows[1:]] == [["16", "16"], ["32", "16"], ["16", "all"], ["32", "all"]]
    assert "== 32 tokens/rank, num_sms=16 (no effect on mpi): round trip OK" in done.stdout
    assert "== per SM count" in done.stdout
    assert "32 tokens/rank, num_sms=all: ok, dispatch p50/p99 " in done.stderr  # the one line per point


def test_bench_one_token_leaves_some_ranks_without_rows(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench(4, "--config", "cpu_demo", "--tokens", "1", "--iters", "1", "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    _check_json(out, 4, 1)


def test_bench_fp8_sends_the_prepared_pair_and_counts_fp8_bytes(tmp_path):
    """cpu_demo (hidden 256): 256 FP8 + 8 scale bytes per dispatched row (the packed row is 272 on the link), the
    combine's rows stay 256 bfloat16 = 512 bytes; round trips and FP8 rows checked (exit 0)."""
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "32", "--iters", "2", "--warmup", "1", "--fp8",
                     "--json", str(out), "--csv", str(table))
    assert done.returncode == 0, done.stdout + done.stderr
    meta, points = _check_json(out, 2, 32, row_bytes=264)
    assert meta["fp8"] is True and meta["row_bytes"] == {"dispatch": 264, "combine": 512}
    assert "264 bytes: 256 FP8 + 8 scale bytes" in meta["fp8_bytes"] and "272" in meta["fp8_bytes"]
    point = points[0]
    assert point["row_bytes"] == {"dispatch": 264, "combine": 512}
    assert {"dispatch_cached", "dispatch_cast"} <= set(point["latency_us"]) and not point["baseline_over_ep_comm"]
    assert "fp8=True" in done.stdout.splitlines()[0]
    assert "sender cast (eager cached dispatch): use_fp8=True" in done.stdout
    assert "dispatch_row_bytes,combine_row_bytes" in table.read_text().splitlines()[0]


def test_bench_fp8_expand_checks_the_rows_that_hold_tokens(tmp_path):
    """Expand with alignment 4: padding rows hold no token and are left out of the FP8 row check."""
    out = tmp_path / "bench.json"
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "16", "--expand", "--alignment", "4", "--iters", "1",
                     "--warmup", "0", "--fp8", "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    _check_json(out, 2, 16, row_bytes=264)


def test_bench_without_fp8_says_so_and_counts_payload_bytes(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "8", "--iters", "1", "--warmup", "0", "--quiet",
                     "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    meta, points = _check_json(out, 2, 8)
    assert meta["fp8"] is False and "fp8_bytes" not in meta
    assert points[0]["row_bytes"] == {"dispatch": 512, "combine": 512} and "dispatch_cast" not in points[0]["latency_us"]


def test_bench_refuses_fp8_when_hidden_is_not_a_multiple_of_128():
    done = run_bench(2, "--config", "gpt_oss_120b", "--fp8", "--iters", "1")
    assert done.returncode == 2
    assert "--fp8: config gpt_oss_120b has hidden = 2880: FP8 needs hidden a multiple of 128" in done.stderr
    assert "round trip" not in done.stdout, "nothing measured"


def test_bench_rejects_experts_not_divisible_by_ranks():
    done = run_bench(3, "--config", "cpu_demo", "--iters", "1")
    assert done.returncode == 2
    assert "num_experts = 16 is not divisible by the 3 ranks" in done.stderr


def test_a_failure_writing_the_results_at_the_end_exits_3_with_one_line(monkeypatch, tmp_path, capsys):
    """The output path passed its check before measuring, then the disk filled: exit status 3, the reason
    printed (the other ranks get the same verdict by broadcast instead of waiting)."""
    from ep_comm.bench import report, runner

    def disk_full(*_args) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", disk_full)
    args = parser().parse_args(["--config", "cpu_demo", "--tokens", "8", "--iters", "1", "--warmup", "0", "--quiet",
                                "--json", str(tmp_path / "r.json")])
    assert runner.run(args) == runner.EXIT_OUTPUT_FAILED == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "ep_comm.bench: writing the results failed (see above)" in err


def test_host_profile_writes_the_functions_of_the_host_calls_by_cumulative_time(tmp_path):
    out = tmp_path / "new" / "host.prof.txt"
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "16", "--iters", "3", "--warmup", "1", "--quiet",
                     "--host-profile", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert text.startswith("cProfile of rank 0's host calls (cached dispatch cpu_sync=False + combine, 1 + 3 rounds")
    assert "Ordered by: cumulative time" in text
    assert "(dispatch)" in text and "(combine)" in text, "the Buffer's own calls are in the table"


def test_host_profile_path_is_checked_before_measuring(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "16", "--iters", "1", "--host-profile",
                     str(blocker / "p.txt"))
    assert done.returncode == 2 and "--host-profile" in done.stderr
    assert "round trip" not in done.stdout, "nothing measured"
