"""The MoE layer examples: whole runs under ``mpiexec -n 2`` and ``-n 4`` (each exits non-zero when its
check against the dense reference fails), and in-process: the bfloat16 casts of the layer and the
check itself catching a wrong layer output or a wrong routing. The micro-batch overlap example
(``examples.moe_overlap``): at 2 ranks with its JSON, and in-process with uneven micro-batches."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from helpers.mpirun import launcher, run_job

import ep_comm
from ep_comm.testing.dtypes import RELATIVE_ERROR_BOUND
from examples import moe_layer, moe_overlap
from examples.moe_layer import ArrayOps, MoELayer, parse_args, run

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 300
HAVE_TORCH = importlib.util.find_spec("torch") is not None
EXAMPLES = ["examples.moe_layer",
            pytest.param("examples.torch_moe_layer",
                         marks=pytest.mark.skipif(not HAVE_TORCH, reason="needs PyTorch (pip install -e '.[torch]')"))]


def run_example(cmd_tail: list, num_ranks: int) -> subprocess.CompletedProcess:
    """``cmd_tail`` (a python command line) on ``num_ranks`` ranks from the repository root; num_ranks 0:
    without mpiexec (a singleton MPI process)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    cmd = (launcher(num_ranks, env) if num_ranks else []) + [sys.executable, *cmd_tail]
    return run_job(cmd, env, JOB_TIMEOUT_S, cwd=REPO)


def assert_ok(job: subprocess.CompletedProcess, name: str, num_ranks: int, dtype: str) -> None:
    """Exit 0 and rank 0's one OK line naming the run."""
    out = f"{' '.join(job.args)} exited {job.returncode}:\n{job.stdout[-5000:]}\n{job.stderr[-5000:]}"
    assert job.returncode == 0, out
    lines = [line for line in job.stdout.splitlines() if line.startswith(f"{name}: ")]
    assert len(lines) == 1, out
    assert lines[0].startswith(f"{name}: OK ranks={num_ranks} backend=mpi dtype={dtype} "), out


def run_one_rank(capsys) -> tuple:
    """The NumPy example in this process (one rank, float32): ``(exit status, relative error, router error)``."""
    status = run(parse_args("moe", ["--dtype", "float32", "--tokens", "32"], 1), moe_layer.array_ops, "moe")
    out = capsys.readouterr().out
    found = re.search(r"relative error (\S+) .*router error (\S+) ", out)
    assert found, out
    return status, float(found[1]), float(found[2])


# ------------------------------------------------------------------------------ under mpiexec
@pytest.mark.parametrize("module", EXAMPLES)
@pytest.mark.parametrize("num_ranks, dtype", [(2, "bfloat16"), (4, "float32"), (4, "float16")])
def test_example_under_mpiexec(module, num_ranks, dtype):
    job = run_example(["-m", module, "--dtype", dtype, "--tokens", "96", "--hidden", "128", "--ffn", "96",
                       "--experts", "8", "--topk", "3", "--alignment", "4"], num_ranks)
    assert_ok(job, module.split(".")[1], num_ranks, dtype)


@pytest.mark.parametrize("module", EXAMPLES)
def test_example_runs_as_a_file(module):
    job = run_example([f"{module.replace('.', '/')}.py", "--tokens", "16", "--alignment", "1"], 2)
    assert_ok(job, module.split(".")[1], 2, "bfloat16")


def test_overlap_example_under_mpiexec(tmp_path):
    summary_path = tmp_path / "overlap.json"
    job = run_example(["-m", "examples.moe_overlap", "--dtype", "bfloat16", "--tokens", "95", "--hidden", "128",
                       "--ffn", "96", "--experts", "8", "--topk", "3", "--alignment", "4", "--iters", "2",
                       "--warmup", "1", "--json", str(summary_path)], 2)
    assert_ok(job, "moe_overlap", 2, "bfloat16")
    assert re.search(r"^moe_overlap timing: overlapped \S+ us vs sequential \S+ us: overlap saves \S+ %", job.stdout,
                     re.M), job.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["ok"] and summary["ranks"] == 2 and summary["micro_batch_tokens"] == [48, 47]
    assert summary["check"]["relative_error"] <= summary["check"]["bound"]
    for key in ("overlapped_us", "sequential_us", "overlap_saves_pct"):
        assert isinstance(summary[key], float), (key, summary)


def test_bad_options_exit_2_naming_the_rule():
    job = run_example(["-m", "examples.moe_layer", "--experts", "6", "--topk", "8"], 0)
    assert job.returncode == 2
    assert "--topk=8: must be <= --experts=6" in job.stderr


# ------------------------------------------------------------------------------ in process (1 rank)
def test_bfloat16_casts_match_ml_dtypes():
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38, 1e-40, -1e-45],
                       dtype=np.float32)
    values = np.concatenate([special, np.random.default_rng(0).standard_normal(4096, dtype=np.float32) * 1e3])
    ops = ArrayOps(np, ml_dtypes.bfloat16)
    got = ops.to_payload(values)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), values.astype(ml_dtypes.bfloat16).view(np.uint16))
    np.testing.assert_array_equal(ops.float32(got), got.astype(np.float32))
    assert np.isnan(ops.to_payload(np.array([np.nan, -np.nan], np.float32)).astype(np.float32)).all()


def test_the_check_passes_on_one_rank(capsys):
    status, relative, router = run_one_rank(capsys)
    assert status == 0 and relative < RELATIVE_ERROR_BOUND["float32"] and router < moe_layer.ROUTER_ERROR_BOUND


def test_the_check_catches_a_wrong_output(monkeypatch, capsys):
    experts = MoELayer.experts
    monkeypatch.setattr(MoELayer, "experts", lambda self, recv_x, segments: experts(self, recv_x, segments) * 1.01)
    status, relative, router = run_one_rank(capsys)
    assert status == 1 and relative > 5e-3 and router < moe_layer.ROUTER_ERROR_BOUND


def test_the_check_catches_a_wrong_routing(monkeypatch, capsys):
    route = moe_layer.route
    monkeypatch.setattr(moe_layer, "route", lambda ops, x, w_gate, k: route(ops, x, -w_gate, k))  # bottom-k experts
    status, relative, router = run_one_rank(capsys)
    assert status == 1 and relative < RELATIVE_ERROR_BOUND["float32"] and router > 0.1


# ------------------------------------------------------------------------------ overlap example in process
def run_overlap_one_rank(capsys, tokens: int, micro_batches: int) -> tuple:
    """The overlap example in this process (one rank, float32): ``(exit status, rank 0's output)``."""
    args = moe_overlap.overlap_args(["--dtype", "float32", "--tokens", str(tokens), "--micro-batches",
                                     str(micro_batches), "--iters", "1", "--warmup", "0"], 1)
    return moe_overlap.run_overlap(args), capsys.readouterr().out


def test_micro_batches_split_like_array_split():
    for tokens, n in [(0, 2), (1, 2), (7, 3), (96, 2), (95, 4)]:
        got = [np.arange(tokens)[s] for s in moe_overlap.micro_batches(tokens, n)]
        assert [g.tolist() for g in got] == [a.tolist() for a in np.array_split(np.arange(tokens), n)]


@pytest.mark.parametrize("tokens, micro_batches", [(33, 3), (1, 2)])
def test_overlap_check_passes_on_uneven_micro_batches(capsys, tokens, micro_batches):
    status, out = run_overlap_one_rank(capsys, tokens, micro_batches)
    assert status == 0, out
    assert f"moe_overlap: OK ranks=1 backend=mpi dtype=float32 T={tokens} " in out
    assert f"micro-batches={micro_batches}" in out and "moe_overlap timing: overlapped " in out


def test_overlap_check_catches_a_wrong_output(monkeypatch, capsys):
    experts = MoELayer.experts
    monkeypatch.setattr(MoELayer, "experts", lambda self, recv_x, segments: experts(self, recv_x, segments) * 1.01)
    status, out = run_overlap_one_rank(capsys, 32, 2)
    assert status == 1 and "moe_overlap: FAILED " in out and "timing" not in out


def test_overlap_schedule_sends_both_dispatches_before_any_receive(monkeypatch):
    """The documented order: both dispatches sent; each micro-batch received, computed, its combine sent; then
    both combines received."""
    events = []

    def spy(name):
        method = getattr(MoELayer, name)

        def sent(self, *args, **kwargs):
            i = bufs.index(self.buf)
            events.append(f"send {name} {i}")
            hook = method(self, *args, **kwargs)
            assert kwargs["return_recv_hook"] and isinstance(hook, ep_comm.RecvHook)
            return lambda: events.append(f"hook {name} {i}") or hook()
        return sent

    for name in ("dispatch", "combine"):
        monkeypatch.setattr(MoELayer, name, spy(name))
    compute = MoELayer.compute
    monkeypatch.setattr(MoELayer, "compute", lambda self, out: events.append(f"compute {bufs.index(self.buf)}")
                        or compute(self, out))
    args = moe_overlap.overlap_args(["--dtype", "float32", "--tokens", "16"], 1)
    params = moe_layer.make_params(args.hidden, args.ffn, args.experts, args.seed)
    with moe_layer.open_buffer(None, args, 8) as a, moe_layer.open_buffer(None, args, 8) as b:
        bufs = [a, b]
        first = MoELayer(a, params, moe_layer.array_ops(a), args.alignment)
        x = moe_layer.seeded_tokens(args, first.ops, 0)
        outputs = moe_overlap.overlapped([first, first.on(b)], [x[:8], x[8:]], moe_overlap.HostLanes())
    assert [out.y.shape for out in outputs] == [(8, args.hidden)] * 2
    assert events == ["send dispatch 0", "send dispatch 1", "hook dispatch 0", "compute 0", "send combine 0",
                      "hook dispatch 1", "compute 1", "send combine 1", "hook combine 0", "hook combine 1"]


def test_layer_on_another_geometry_is_refused():
    args = moe_overlap.overlap_args(["--dtype", "float32", "--tokens", "16"], 1)
    other = moe_overlap.overlap_args(["--dtype", "float32", "--tokens", "16", "--topk", "2"], 1)
    params = moe_layer.make_params(args.hidden, args.ffn, args.experts, args.seed)
    with moe_layer.open_buffer(None, args, 8) as a, moe_layer.open_buffer(None, other, 8) as b:
        layer = MoELayer(a, params, moe_layer.array_ops(a), args.alignment)
        with pytest.raises(ValueError, match=r"buf: geometry .* must be this layer's"):
            layer.on(b)
