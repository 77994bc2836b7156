"""What a user meets first on the command lines (bench, soak, examples, info): stdout line by line,
output paths checked before measuring, one-line exits with status 2 for an environment that cannot
run (no GPU stack, another MPI than the launcher's), argparse messages printed once, the CPU launch
script's PYTHONPATH. Every job runs under a hard timeout (``helpers.mpirun.run_job``)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.mpirun import launcher, run_job

from ep_comm.backends import gpu_available
from ep_comm.bench import runner
from ep_comm.bench.__main__ import parser

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
NO_GPU_STACK = pytest.mark.skipif(gpu_available(), reason="the GPU stack is here: --backend nvshmem would run")
NVSHMEM_MISSING = ("--backend nvshmem needs CuPy, numba-cuda and nvshmem4py (pip install -e '.[gpu]'): "
                   "No module named ")


def job_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               UCX_LOG_LEVEL="error", **extra)
    return env


def run_python(num_ranks: int, *args: str, cwd: Path = REPO, **extra: str) -> subprocess.CompletedProcess:
    """``python ARGS`` on ``num_ranks`` ranks under mpiexec (0: a singleton, no mpiexec)."""
    env = job_env(**extra)
    return run_job((launcher(num_ranks, env) if num_ranks else []) + [sys.executable, *args], env, TIMEOUT_S, cwd=cwd)


def stderr_lines(job: subprocess.CompletedProcess) -> list:
    return [line for line in job.stderr.splitlines() if line.strip()]


# ------------------------------------------------------------------ stdout line by line
def test_commands_run_with_line_buffered_stdout_on_a_pipe():
    code = ("import sys; from ep_comm.cli import exit_collectively; "
            "exit_collectively(lambda: print(sys.stdout.line_buffering) or 0)")
    job = run_python(0, "-c", code)
    assert (job.returncode, job.stdout) == (0, "True\n"), job.stderr


class FlushLog(io.StringIO):
    """A stdout that remembers what had been flushed."""

    flushed = ""

    def flush(self) -> None:
        super().flush()
        self.flushed = self.getvalue()


def test_the_header_and_each_points_report_are_flushed_before_the_next_point_runs(monkeypatch):
    out = FlushLog()
    seen_at_start = []
    run_point = runner.run_point

    def recording(comm, buf, spec, *args, **kwargs):
        seen_at_start.append((spec.num_tokens, out.flushed))
        return run_point(comm, buf, spec, *args, **kwargs)

    monkeypatch.setattr(runner, "run_point", recording)
    monkeypatch.setattr(sys, "stdout", out)
    args = parser().parse_args(["--sweep", "8,16", "--iters", "1", "--warmup", "0", "--backend", "mpi"])
    assert runner.run(args) == 0
    (first, before_first), (second, before_second) = seen_at_start
    assert (first, second) == (8, 16)
    assert before_first.startswith("ep_comm.bench config=cpu_demo backend=mpi") and "== " not in before_first
    assert "== 8 tokens/rank, num_sms=all: round trip OK" in before_second and "== 16 tokens" not in before_second
    assert "== 16 tokens/rank, num_sms=all: round trip OK" in out.getvalue()


# ------------------------------------------------------------------ output paths
def test_output_directories_are_created_before_measuring(tmp_path):
    json_path, plot_dir = tmp_path / "newdir" / "deeper" / "s.json", tmp_path / "csvdir"
    job = run_python(2, "-m", "ep_comm.bench", "--sweep", "8,16", "--iters", "1", "--warmup", "0", "--quiet",
                     "--json", str(json_path), "--csv", str(plot_dir / "s.csv"))
    assert job.returncode == 0, job.stdout + job.stderr
    assert json_path.read_text().startswith("{") and (plot_dir / "s.csv").read_text().startswith("tokens_per_rank,")


@pytest.mark.parametrize("option", ["--json", "--csv"])
def test_an_output_path_that_cannot_be_written_stops_every_rank_before_measuring(tmp_path, option):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    job = run_python(2, "-m", "ep_comm.bench", "--iters", "1", "--warmup", "0", option, str(blocker / "x"))
    assert job.returncode == 2, job.stdout + job.stderr
    assert stderr_lines(job) == [f"ep_comm.bench: {option} {blocker / 'x'}: cannot be written ({blocker} is not a "
                                 "directory)"]
    assert job.stdout == "", "nothing was measured"


def test_the_soak_checks_its_json_path_before_running(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    job = run_python(0, "-m", "ep_comm.soak", "--iters", "1", "--json", str(blocker / "s.json"))
    assert job.returncode == 2
    assert stderr_lines(job) == [f"ep_comm.soak: --json {blocker / 's.json'}: cannot be written ({blocker} is not a "
                                 "directory)"]


# ------------------------------------------------------------------ environment problems
@NO_GPU_STACK
@pytest.mark.parametrize("num_ranks", [1, 4])
@pytest.mark.parametrize("module, prog", [("ep_comm.bench", "ep_comm.bench"), ("ep_comm.soak", "ep_comm.soak"),
                                          ("examples.moe_layer", "moe_layer")])
def test_backend_nvshmem_without_the_gpu_stack_is_one_line_and_exit_2(module, prog, num_ranks):
    job = run_python(num_ranks, "-m", module, "--backend", "nvshmem")
    assert job.returncode == 2, job.stdout + job.stderr
    lines = stderr_lines(job)
    assert len(lines) == 1, job.stderr
    assert lines[0].startswith(f"{prog}: ranks {list(range(num_ranks))}: {NVSHMEM_MISSING}"), lines[0]
    assert lines[0].endswith("; use --backend mpi on CPU")


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_an_mpi_that_is_not_the_launchers_is_one_line_and_exit_2(variable):
    job = run_python(0, "-m", "ep_comm.bench", "--iters", "1", **{variable: "4"})
    assert job.returncode == 2, job.stdout + job.stderr
    ours = [line for line in stderr_lines(job) if line.startswith("ep_comm.bench:")]  # mpi4py may warn too
    assert len(ours) == 1 and "Traceback" not in job.stderr, job.stderr
    assert ours[0].startswith(f"ep_comm.bench: ranks [0]: the launcher started 4 ranks ({variable}=4) but mpi4py's "
                              "MPI (")
    assert ours[0].endswith("sees 1: mpirun is not the MPI mpi4py was built against (see README, 'GPU and clusters')")


# ------------------------------------------------------------------ small CLI items
@pytest.mark.parametrize("module", ["ep_comm.bench", "ep_comm.bench.kernels", "ep_comm.soak", "ep_comm.info",
                                    "examples.moe_layer"])
def test_help_prints_the_usage_and_runs_nothing(module):
    job = run_python(0, "-m", module, "--help")
    assert job.returncode == 0 and job.stdout.startswith(f"usage: python -m {module} [-h]"), job.stdout + job.stderr
    assert "versions:" not in job.stdout and "ep_comm.bench config=" not in job.stdout


def test_an_option_error_is_printed_once_not_once_per_rank():
    job = run_python(2, "-m", "ep_comm.bench", "--sweep", "1,,2")
    assert job.returncode == 2
    assert job.stderr.count("python -m ep_comm.bench: error: argument --sweep: '1,,2': must be a list of token "
                            "counts >= 1, e.g. 128,512,4096") == 1, job.stderr
    assert job.stderr.count("usage:") == 1


def test_alignment_needs_expand(capsys):
    from ep_comm.bench.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(["--alignment", "3"])
    assert info.value.code == 2
    assert ("error: --alignment 3: applies to expand mode only, give --expand too (compact dispatch has no expert "
            "blocks to align)") in capsys.readouterr().err
    assert parser().parse_args(["--alignment", "3", "--expand"]).alignment == 3


def test_the_cpu_launch_script_runs_examples_from_outside_the_repository(tmp_path):
    env = job_env(VIRTUAL_ENV=sys.prefix)
    env.pop("PYTHONPATH")
    job = run_job([str(REPO / "launch" / "mpirun_cpu.sh"), "1", "examples.moe_layer", "--tokens", "8", "--hidden",
                   "32", "--ffn", "16", "--experts", "4", "--topk", "2"], env, TIMEOUT_S, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.startswith("moe_layer: OK ranks=1 backend=mpi")
