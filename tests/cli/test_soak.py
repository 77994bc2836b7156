"""``python -m ep_comm.soak``: a short soak under ``mpiexec -n 2`` (every phase, JSON summary), and
in-process: the plans cover the modes, the checks catch wrong outputs, memory growth is flagged."""
from __future__ import annotations

import inspect
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers.mpirun import launcher, run_job
from mpi4py import MPI

from ep_comm import Buffer
from ep_comm.contract.choices import PAYLOAD_DTYPES
from ep_comm.soak.__main__ import main, parser
from ep_comm.soak.memory import MemoryTrack
from ep_comm.soak.plan import FORCED_STEPS, Shape, base_payload, plan_step, rank_inputs
from ep_comm.soak.round_trip import ArrayIO, check_step, negated, round_trip
from ep_comm.testing.routing import KINDS

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 300


def test_short_soak_under_mpiexec(tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = launcher(2, env) + [sys.executable, "-m", "ep_comm.soak", "--backend", "mpi", "--iters", "200",
                              "--check-every", "10", "--create-close", "10", "--repeat-deterministic", "10",
                              "--json", str(out)]
    run = run_job(cmd, env, JOB_TIMEOUT_S, cwd=REPO)
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}:\n{run.stdout[-10000:]}\n{run.stderr[-5000:]}"
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["failures"]["count"] == 0
    assert summary["ranks"] == 2 and summary["backend"] == "mpi"
    soak = summary["soak"]
    assert soak["iters"] == 200 and soak["modes"]["checked"] == FORCED_STEPS + len(range(10, 200, 10))
    assert min(soak["modes"][m] for m in ("expand", "cpu_sync_false", "replay", "weights")) > 0
    assert set(soak["memory"]) == {"rank0", "rank1"} and soak["memory"]["rank0"]["rss_bytes"]["ok"]
    assert summary["determinism"]["repeats"] == 10 and summary["determinism"]["differing"] == {}
    assert summary["create_close"]["buffers"] == 10
    assert "[ep_comm.soak] OK" in run.stdout
    assert "[ep_comm.soak] soak 200/200" in run.stderr, "rank 0 shows its progress on stderr"


def test_a_forwarding_soak_in_two_virtual_nodes_passes(tmp_path):
    """``--scaleup-ranks`` and ``--forwarding`` reach the soak's Buffers: two nodes of one rank, every round checked
    against the flat reference."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = launcher(2, env) + [sys.executable, "-m", "ep_comm.soak", "--backend", "mpi", "--iters", "30",
                              "--check-every", "3", "--create-close", "2", "--scaleup-ranks", "1", "--forwarding",
                              "--quiet", "--json", str(out)]
    run = run_job(cmd, env, JOB_TIMEOUT_S, cwd=REPO)
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}:\n{run.stdout[-10000:]}\n{run.stderr[-5000:]}"
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["soak"]["modes"]["checked"] >= 10
    assert (summary["transport"], summary["scaleup_ranks"], summary["forwarding"]) == ("auto", 1, True)


def test_the_soak_takes_the_buffers_default_transport():
    assert parser().parse_args([]).transport == "auto"
    assert parser().get_default("transport") == inspect.signature(Buffer).parameters["transport"].default


def test_plans_are_shared_and_cover_the_modes():
    steps = [plan_step(7, i, 10, [1, 2, 8]) for i in range(400)]
    assert steps == [plan_step(7, i, 10, [1, 2, 8]) for i in range(400)], "a plan depends on (seed, index) only"
    assert {s.routing for s in steps} == set(KINDS)
    assert {s.alignment for s in steps if s.expand} == {1, 2, 8}
    assert {s.token_mode for s in steps} == {"random", "full", "some_empty", "small"}
    for flag in ("expand", "cpu_sync", "weights", "bias", "replay", "zero_padding"):
        assert {getattr(s, flag) for s in steps} == {False, True}, flag
    assert any(s.mask_rate > 0 for s in steps) and any(s.nowhere_rate > 0 for s in steps)
    assert [s.index for s in steps if s.check] == list(range(0, FORCED_STEPS)) + list(range(10, 400, 10))


def test_rank_inputs_stay_in_bounds():
    shape = Shape(16, 8, 4, 12, "bfloat16")
    for i in range(50):
        step = plan_step(3, i, 1, [1, 8])
        for rank in range(3):
            mine = rank_inputs(shape, step, 3, rank, 24)
            assert len(mine.rows) <= shape.max_tokens and mine.topk_idx.shape == (len(mine.rows), 4)
            assert mine.topk_idx.max(initial=-1) < 16 and (mine.rows < 24).all()
            assert rank_inputs(shape, step, 3, rank, 24).topk_idx.tolist() == mine.topk_idx.tolist()


@pytest.mark.parametrize("dtype", sorted(PAYLOAD_DTYPES))
def test_negated_is_exact(dtype):
    x = base_payload(Shape(4, 16, 2, 8, dtype), 0)
    neg = negated(np, x)
    assert np.array_equal(neg.astype(np.float32), -x.astype(np.float32))
    assert np.array_equal(negated(np, neg).view(np.uint8), x.view(np.uint8))


def one_checked_round_trip(step_index: int):
    """An in-process (single rank) round trip of a checked plan, and what the checker needs for it."""
    shape = Shape(8, 16, 4, 16, "float32")
    base = base_payload(shape, 0)
    io = ArrayIO("mpi", base)
    step = replace(plan_step(0, step_index, 1, [1, 2, 8]), bias=True)
    mine = rank_inputs(shape, step, 0, 0, len(base))
    buf = Buffer(num_experts=shape.num_experts, hidden=shape.hidden, num_topk=shape.num_topk,
                 num_max_tokens_per_rank=shape.max_tokens, dtype=shape.dtype, backend="mpi", deterministic=True)
    out, res = round_trip(buf, io, step, lambda: buf.dispatch(
        io.payload(mine.rows), mine.topk_idx, mine.topk_weights if step.weights else None, expand=step.expand,
        expert_alignment=step.alignment, zero_padding=step.zero_padding, cpu_sync=step.cpu_sync),
        io.payload((mine.rows + 2) % len(base)))
    buf.close()
    bias = base[(mine.rows + 2) % len(base)]

    def check(o=out, r=res):
        return check_step(shape, step, [mine], [base[mine.rows]], bias, o, r, 0, True)

    return check, out, res


@pytest.mark.parametrize("step_index", [0, 1])  # compact, expand (forced full plans)
def test_checks_catch_wrong_outputs(step_index):
    check, out, res = one_checked_round_trip(step_index)
    assert check() == []
    swapped = out.recv_x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert check(replace(out, recv_x=swapped))
    meta = out.handle.recv_src_metadata.copy()
    meta[0, 0] = meta[1, 0]
    duplicated = replace(out, handle=replace(out.handle, recv_src_metadata=meta))
    assert any("missing or duplicated" in p for p in check(duplicated))
    off = res.x.copy()
    off.view(np.uint32)[0, 0] ^= 1
    assert any("combine differs" in p for p in check(r=replace(res, x=off)))


def test_memory_growth_after_warmup_is_flagged():
    track = MemoryTrack()
    for i, rss in enumerate([100, 140, 150, 150, 151]):
        track.add({"rss_bytes": rss << 20}, is_baseline=i == 1)
    ok = track.summary(16 << 20)["rss_bytes"]
    assert ok["ok"] and ok["start"] == 100 << 20 and ok["baseline"] == 140 << 20 and ok["growth"] == 11 << 20
    track.add({"rss_bytes": 200 << 20})
    assert not track.summary(16 << 20)["rss_bytes"]["ok"]


def test_bad_options_exit_2(capsys):
    assert main(["--topk", "9", "--experts", "8", "--iters", "0", "--create-close", "0"]) == 2
    assert "--topk=9" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--alignments", "0"])
    assert info.value.code == 2
    assert main(["--backend", "mpi", "--scaleup-ranks", "2", "--iters", "1"], comm=MPI.COMM_SELF) == 2
    assert ("ep_comm.soak: cannot build the Buffer: scaleup_ranks=2: must be >= 1 and divide the rank count 1"
            in capsys.readouterr().err)
