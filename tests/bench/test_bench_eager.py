"""The bench's eager-path figures: eager over graph per operation, the first call at a token count, the sweep
(``--sweep``), the busy-stream check (``--busy-check``), the token-count limits. In-process pieces on made-up
samples, then the command under mpirun on the CPU config. Timings are never asserted on, only their shape."""
import json

import pytest
from helpers.bench import run_bench

from ep_comm.bench import busy, eager
from ep_comm.bench.__main__ import SWEEP_TOKENS, main, parser
from ep_comm.bench.measure import RankSample
from ep_comm.bench.point import prime_tokens
from ep_comm.bench.report import csv_row, format_point, format_tail, summarize

GRAPH = {"dispatch": [2e-6] * 3, "combine": [1e-6] * 3, "dispatch_new": [4e-6] * 3, "combine_new": [2e-6] * 3}


def _sample(rank: int, tokens: int = 10, graphs: bool = True, **fields) -> RankSample:
    return RankSample(rank=rank, num_tokens=tokens, rows_sent=12, recv_rows=8, recv_from_self=3, expanded_rows=0,
                      times={"dispatch": [2e-5] * 3, "combine": [1e-5] * 3, "dispatch_cached": [1e-5] * 3},
                      host_times={"dispatch_cached_async": [3e-6] * 3, "combine": [2e-6] * 3,
                                  "dispatch_new_async": [5e-6] * 3},
                      graph_times=dict(GRAPH) if graphs else {}, first_call_s=1e-3 * (rank + 1), **fields)


# ------------------------------------------------------------------ in-process pieces
def test_each_eager_operation_is_set_against_its_graph_replay():
    point = summarize([_sample(0), _sample(1)], row_bytes=100)
    assert point["eager_over_graph"] == {"dispatch": pytest.approx(5.0), "dispatch_cached": pytest.approx(5.0),
                                         "combine": pytest.approx(5.0)}
    assert all(ratio > 0 for ratio in point["eager_over_graph"].values())
    assert csv_row(point)["dispatch_cached_eager_over_graph"] == pytest.approx(5.0)
    text = format_point(point, None)
    assert "eager over CUDA graph replay (p50): dispatch 5.00x (graph dispatch_new)" in text
    assert "eager cached dispatch (cpu_sync=True) p50 10.0 us" in text
    assert summarize([_sample(0, graphs=False)], row_bytes=100)["eager_over_graph"] == {}, "no graphs, no ratio"


def test_the_first_call_is_the_slowest_ranks_and_kept_per_rank():
    point = summarize([_sample(0), _sample(1)], row_bytes=100)
    assert point["first_call_us"] == pytest.approx(2000) and point["first_call_us_per_rank"] == [
        pytest.approx(1000), pytest.approx(2000)]
    assert "first call at this count 2000.0 us (before the warm-up" in format_point(point, None)


def test_the_sweep_has_one_entry_and_one_table_row_per_point():
    points = [summarize([_sample(r, tokens=t) for r in range(2)], row_bytes=100) for t in (1, 16, 64)]
    sweep = eager.sweep_sections(points, swept=True)["sweep"]
    assert [e["tokens_per_rank"] for e in sweep] == [1, 16, 64]
    for entry in sweep:
        assert set(entry["eager_us"]) == {"dispatch", "dispatch_cached", "combine"}
        assert set(entry["host_us"]) == set(eager.HOST_OPS)
        assert entry["first_call_us"] > 0 and entry["eager_over_graph"]["combine"] > 0
    assert eager.sweep_sections(points, swept=False) == {}
    table = format_tail(points).splitlines()
    assert table[0] == eager.SWEEP_TITLE and len(table) == 2 + 3
    assert table[2].split()[:3] == ["1", "all", "2000.0"] and table[2].split()[-2:] == ["5.0/5.0/5.0", "ok"]
    assert format_tail(points[:1]) is None, "one token count: no sweep table"


def test_the_busy_check_compares_the_host_time_with_half_a_millisecond():
    figures = {"host": [2e-5] * 3, "gpu_total": [1.01e-3] * 3, "spin": [1e-3] * 3, "pair": [1e-5] * 3}
    point = summarize([_sample(r, busy=dict(figures)) for r in range(2)], row_bytes=100)
    check = point["busy_check"]
    assert check["hidden_sync"] is False and check["host_us"]["p50"] == pytest.approx(20)
    assert check["graph_pair_us"] == pytest.approx(3.0) and check["expected_gpu_us"] == pytest.approx(1003.0)
    assert "no hidden sync" in format_point(point, None)
    waited = summarize([_sample(0, busy=dict(figures, host=[1e-3] * 3))], row_bytes=100)["busy_check"]
    assert waited["hidden_sync"] is True
    no_graphs = summarize([_sample(0, graphs=False, busy=figures)], row_bytes=100)["busy_check"]
    assert no_graphs["expected_gpu_us"] is None


def test_a_skipped_or_unasked_busy_check():
    skipped = summarize([_sample(0, busy={"skipped": busy.SKIPPED_ON_MPI})], row_bytes=100)
    assert skipped["busy_check"] == {"skipped": busy.SKIPPED_ON_MPI}
    assert f"busy-stream check skipped: {busy.SKIPPED_ON_MPI}" in format_point(skipped, None)
    assert "busy_check" not in summarize([_sample(0)], row_bytes=100), "--no-busy-check: no field"


@pytest.mark.parametrize("tokens, primed", [([128], 127), ([1], 2), ([1, 16, 64], 63), ([1, 2, 3], 4), ([4, 3], 2)])
def test_the_priming_round_trip_runs_at_a_count_none_of_the_points_has(tokens, primed):
    assert prime_tokens(tokens) == primed


def test_sweep_without_a_list_runs_decode_to_prefill_sizes():
    assert parser().parse_args(["--sweep"]).sweep == SWEEP_TOKENS == [1, 16, 64, 128, 512, 4096]
    assert parser().parse_args(["--sweep", "--iters", "2"]).sweep == SWEEP_TOKENS
    assert parser().parse_args([]).busy_check is True and parser().parse_args(["--no-busy-check"]).busy_check is False


@pytest.mark.parametrize("value", ["0", "-4", "1.5", "x", "16,0", "8,,16"])
def test_bad_sweep_counts_are_refused_naming_the_option(value, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--sweep", value])
    assert info.value.code == 2
    assert f"argument --sweep: {value!r}: must be a list of token counts >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, shown", [(["--sweep", "16,4097"], "--sweep 16,4097: 4097"),
                                         (["--tokens", "5000"], "--tokens 5000: 5000")])
def test_token_counts_above_the_configs_limit_are_refused_before_measuring(argv, shown, capsys):
    from ep_comm.bench import runner

    assert runner.run(parser().parse_args(["--config", "cpu_demo", "--quiet", *argv])) == 2
    err = capsys.readouterr().err
    assert f"ep_comm.bench: {shown} tokens per rank is above max_tokens_per_rank = 4096 of config cpu_demo" in err


# ------------------------------------------------------------------ the command under mpirun
def test_a_sweep_on_cpu_reports_every_count_and_skips_the_busy_check(tmp_path):
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    done = run_bench(2, "--config", "cpu_demo", "--sweep", "1,16,64", "--busy-check", "--iters", "3", "--warmup", "1",
                     "--json", str(out), "--csv", str(table))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["meta"]["prime_tokens"] == 63 and result["meta"]["busy_check"] is True
    assert [e["tokens_per_rank"] for e in result["sweep"]] == [1, 16, 64]
    for entry in result["sweep"]:
        assert entry["check_passed"] and entry["first_call_us"] > 0
        for stats in [*entry["eager_us"].values(), *entry["host_us"].values()]:
            assert 0 < stats["p50"] <= stats["p99"]
        assert set(entry["eager_us"]) == {"dispatch", "dispatch_cached", "combine"}
        assert set(entry["host_us"]) == set(eager.HOST_OPS)
        assert entry["eager_over_graph"] == {}, "no graph replays on the mpi backend"
    for point in result["points"]:
        assert point["busy_check"] == {"skipped": busy.SKIPPED_ON_MPI}
        assert len(point["first_call_us_per_rank"]) == 2 and point["first_round_trip_s"] > 0
    assert eager.SWEEP_TITLE in done.stdout and "busy-stream check skipped: the mpi backend" in done.stdout
    assert "first_call_us" in table.read_text().splitlines()[0]


def test_no_busy_check_leaves_the_field_out(tmp_path):
    out = tmp_path / "bench.json"
    done = run_bench(2, "--config", "cpu_demo", "--tokens", "8", "--no-busy-check", "--iters", "1", "--warmup", "0",
                     "--quiet", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert "busy_check" not in result["points"][0] and "sweep" not in result
    assert result["meta"]["busy_check"] is False
