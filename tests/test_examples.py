"""The MoE layer examples: whole runs under ``mpiexec -n 2`` and ``-n 4`` (each exits non-zero when its
check against the dense reference fails), and in-process: the bfloat16 casts of the layer and the
check itself catching a wrong layer output or a wrong routing."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ep_comm.testing.dtypes import RELATIVE_ERROR_BOUND
from examples import moe_layer
from examples.moe_layer import ArrayOps, MoELayer, parse_args, run
from helpers.mpirun import launcher, run_job

REPO = Path(__file__).resolve().parents[1]
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
