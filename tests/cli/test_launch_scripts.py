"""The launch scripts on CPU, driven by a fake environment: the rank -> GPU assignment of
``launch/bind_gpu.sh`` (and its refusals), the options of ``launch/mpirun_gpu.sh``, and
``launch/with_mps.sh`` against a fake ``nvidia-cuda-mps-control`` that records its calls."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"

FAKE_MPS = """#!/usr/bin/env bash
# fake nvidia-cuda-mps-control: one line per call in $FAKE_MPS_LOG; "running" = a marker in the pipe
# directory; -f (foreground) runs until the marker is gone
query=
[ "${1:-}" = -f ] || query=$(cat)
echo "${1:-}${query}|$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
case "${1:-}${query}" in
    -f) echo $$ > "$FAKE_MPS_LOG.pid"
        touch "$CUDA_MPS_PIPE_DIRECTORY/running"
        while [ -e "$CUDA_MPS_PIPE_DIRECTORY/running" ]; do sleep 0.1; done ;;
    get_server_list) [ -e "$CUDA_MPS_PIPE_DIRECTORY/running" ] ;;
    quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/running" ;;
esac
"""


def test_every_launch_script_is_executable_in_the_repository():
    """A script with a shebang runs as ``launch/NAME`` from a fresh clone: git records it executable."""
    listing = subprocess.run(["git", "ls-files", "-s", "launch"], cwd=LAUNCH.parent, capture_output=True, text=True,
                             timeout=30)
    if listing.returncode or not listing.stdout:
        pytest.skip("not a git checkout: the modes git records cannot be read")
    modes = {Path(path).name: mode for mode, _, _, path in (line.split(None, 3) for line in listing.stdout.splitlines())}
    scripts = [p.name for p in LAUNCH.iterdir() if p.is_file() and p.read_bytes().startswith(b"#!")]
    assert "slurm.sbatch" in scripts
    assert {name: modes.get(name) for name in scripts} == {name: "100755" for name in scripts}
    assert all(os.access(LAUNCH / name, os.X_OK) for name in scripts)


def run_script(name: str, args: List[str], env: Dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    """``launch/NAME ARGS`` with exactly ``env`` (plus a system PATH unless ``env`` has one)."""
    return subprocess.run([str(LAUNCH / name), *args], env={"PATH": SYSTEM_PATH, **env}, capture_output=True,
                          text=True, timeout=timeout)


def bound_gpu(env: Dict[str, str]) -> subprocess.CompletedProcess:
    return run_script("bind_gpu.sh", ["printenv", "CUDA_VISIBLE_DEVICES"], env)


# ------------------------------------------------------------------ bind_gpu.sh
@pytest.mark.parametrize("local_rank, visible, per_gpu, expected", [
    ("0", "0,1", None, "0"), ("1", "4,5,6,7", None, "5"),            # one rank per GPU: the local rank's entry
    ("3", "0,1", "2", "1"), ("2", "0,1", "2", "1"), ("1", "0,1", "2", "0"),  # blocks of ranks-per-gpu ranks
    ("0", "3", "4", "3"), ("3", "3", "4", "3"),                        # one GPU, N ranks: every rank gets it
])
def test_bind_gpu_assigns_blocks_of_ranks_per_gpu(local_rank, visible, per_gpu, expected):
    env = {"OMPI_COMM_WORLD_LOCAL_RANK": local_rank, "CUDA_VISIBLE_DEVICES": visible}
    if per_gpu:
        env["EP_COMM_RANKS_PER_GPU"] = per_gpu
    done = bound_gpu(env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
                                      "SLURM_LOCALID"])
def test_bind_gpu_reads_every_launchers_local_rank(variable):
    done = bound_gpu({variable: "1", "CUDA_VISIBLE_DEVICES": "0,1", "EP_COMM_RANKS_PER_GPU": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr


def test_bind_gpu_refuses_a_second_rank_per_gpu_without_the_opt_in():
    done = bound_gpu({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 2 and done.stdout == ""
    assert "local rank 1 but only 1 GPUs (0)" in done.stderr and "--ranks-per-gpu N" in done.stderr


def test_bind_gpu_refuses_more_ranks_than_the_places_it_was_given():
    done = bound_gpu({"OMPI_COMM_WORLD_LOCAL_RANK": "4", "CUDA_VISIBLE_DEVICES": "0,1", "EP_COMM_RANKS_PER_GPU": "2"})
    assert done.returncode == 2
    assert "local rank 4 but only 2 GPUs (0 1) x EP_COMM_RANKS_PER_GPU=2 = 4 ranks" in done.stderr


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_bind_gpu_rejects_a_bad_ranks_per_gpu(value):
    done = bound_gpu({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "0", "EP_COMM_RANKS_PER_GPU": value})
    if value == "":  # empty is unset: the default of one rank per GPU
        assert done.returncode == 0 and done.stdout.strip() == "0"
        return
    assert done.returncode == 2
    assert f"EP_COMM_RANKS_PER_GPU='{value}': must be a positive integer" in done.stderr


def test_bind_gpu_without_a_local_rank_or_gpus(tmp_path):
    assert "no local rank in the environment" in bound_gpu({"CUDA_VISIBLE_DEVICES": "0"}).stderr
    fake = tmp_path / "nvidia-smi"  # lists two GPUs: no CUDA_VISIBLE_DEVICES needed
    fake.write_text("#!/bin/sh\necho 'GPU 0: H200 (UUID: a)'\necho 'GPU 1: H200 (UUID: b)'\n")
    fake.chmod(0o755)
    listed = bound_gpu({"SLURM_LOCALID": "3", "EP_COMM_RANKS_PER_GPU": "2", "PATH": f"{tmp_path}:{SYSTEM_PATH}"})
    assert listed.returncode == 0 and listed.stdout.strip() == "1", listed.stderr
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    none = bound_gpu({"SLURM_LOCALID": "0", "PATH": f"{tmp_path}:{SYSTEM_PATH}"})
    assert none.returncode == 2 and "nvidia-smi lists no GPU and CUDA_VISIBLE_DEVICES is unset" in none.stderr


# ------------------------------------------------------------------ mpirun_gpu.sh
@pytest.mark.parametrize("args, message", [
    (["2"], "usage:"), (["x", "ep_comm.bench"], "usage:"),
    (["--ranks-per-gpu", "0", "2", "ep_comm.bench"], "--ranks-per-gpu '0': must be a positive integer"),
    (["--ranks-per-gpu"], "--ranks-per-gpu '': must be a positive integer"),
])
def test_mpirun_gpu_rejects_bad_arguments(args, message):
    done = run_script("mpirun_gpu.sh", args, {})
    assert done.returncode == 2 and message in done.stderr


def test_mpirun_gpu_refuses_a_python_not_on_path(tmp_path):
    done = run_script("mpirun_gpu.sh", ["2", "ep_comm.bench"], {"MPIRUN": str(fake_open_mpi(tmp_path)),
                                                                "PYTHON": "no-such-python"})
    assert done.returncode == 2 and "PYTHON='no-such-python' is not on PATH" in done.stderr


def fake_open_mpi(tmp_path: Path) -> Path:
    """A fake Open MPI ``mpirun`` that prints its arguments and the EP_COMM/CUDA_MPS variables it got."""
    fake = tmp_path / "mpirun"
    fake.write_text("#!/usr/bin/env bash\nif [ \"$1\" = --version ]; then echo 'mpirun (Open MPI) 5.0'; exit 0; fi\n"
                    "echo \"args: $*\"\nenv | grep -E '^(EP_COMM_RANKS_PER_GPU|CUDA_MPS_)' | sort\n")
    fake.chmod(0o755)
    return fake


def test_mpirun_gpu_exports_the_opt_in_and_forwards_the_mps_variables(tmp_path):
    env = {"MPIRUN": str(fake_open_mpi(tmp_path)), "CUDA_MPS_PIPE_DIRECTORY": "/tmp/pipe",
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    done = run_script("mpirun_gpu.sh", ["--ranks-per-gpu", "2", "2", "ep_comm.bench", "--iters", "3"], env)
    assert done.returncode == 0, done.stderr
    assert "EP_COMM_RANKS_PER_GPU=2" in done.stdout.splitlines()
    args = done.stdout.splitlines()[0].split()
    for name in ("EP_COMM_RANKS_PER_GPU", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
        assert args[args.index(name) - 1] == "-x", f"{name} is not forwarded: {args}"
    assert args[-4:] == ["-m", "ep_comm.bench", "--iters", "3"] and args[args.index("-np") + 1] == "2"
    assert args[-5] == shutil.which("python3", path=SYSTEM_PATH), "the ranks run the interpreter by its absolute path"
    plain = run_script("mpirun_gpu.sh", ["2", "ep_comm.bench"], {"MPIRUN": env["MPIRUN"]})
    assert plain.returncode == 0 and "EP_COMM_RANKS_PER_GPU" not in plain.stdout, "no opt-in unless asked"


# ------------------------------------------------------------------ with_mps.sh
def mps_env(tmp_path: Path) -> Dict[str, str]:
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    return {"PATH": f"{fake.parent}:{SYSTEM_PATH}", "FAKE_MPS_LOG": str(tmp_path / "calls"), "TMPDIR": str(tmp_path)}


def mps_calls(env: Dict[str, str]) -> List[str]:
    """The fake daemon's calls, without the polls (get_server_list) in between."""
    return [c for c in Path(env["FAKE_MPS_LOG"]).read_text().splitlines() if not c.startswith("get_server_list")]


def with_mps(env: Dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run_script("with_mps.sh", list(args), env)


@pytest.mark.parametrize("per_gpu, percentage", [("1", "100"), ("2", "50"), ("3", "33"), ("8", "12"), ("100", "1")])
def test_with_mps_splits_the_thread_percentage_and_runs_the_command(tmp_path, per_gpu, percentage):
    env = mps_env(tmp_path)
    done = with_mps(env, "--ranks-per-gpu", per_gpu, "--", "sh", "-c", "env | sort")
    assert done.returncode == 0, done.stderr
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == percentage
    assert int(per_gpu) * int(percentage) <= 100
    assert seen["EP_COMM_RANKS_PER_GPU"] == per_gpu
    pipe, log = Path(seen["CUDA_MPS_PIPE_DIRECTORY"]), Path(seen["CUDA_MPS_LOG_DIRECTORY"])
    assert pipe.parent == tmp_path and log.parent == tmp_path and pipe != log, "its own mktemp directories"
    assert mps_calls(env) == [f"-f|{pipe}", f"quit|{pipe}"], "started and stopped through its own pipe directory"
    assert "MPS daemon stopped, none left" in done.stderr.splitlines()[-1]
    assert not pipe.exists()


def test_with_mps_stops_its_daemon_when_the_command_fails(tmp_path):
    env = mps_env(tmp_path)
    done = with_mps(env, "--", "sh", "-c", "exit 7")
    assert done.returncode == 7
    assert [c.split("|")[0] for c in mps_calls(env)] == ["-f", "quit"]
    assert "none left" in done.stderr


def test_with_mps_stops_its_daemon_and_the_command_when_interrupted(tmp_path):
    env = mps_env(tmp_path)
    marker, ready = tmp_path / "command_ended", tmp_path / "trap_set"
    # SIGINT at its default in the script: a shell cannot trap a signal ignored at its start, and a test run
    # started in the background (`.ci/run &`) passes SIGINT on ignored
    proc = subprocess.Popen([str(LAUNCH / "with_mps.sh"), "--", "bash", "-c",
                             f"trap 'kill $!; echo TERM > {marker}; exit 143' TERM; sleep 60 & touch {ready}; wait"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 90
    while not ready.exists() and time.monotonic() < deadline:  # the command runs with its trap set (a fixed
        time.sleep(0.1)  # sleep here raced the shell's start on a loaded 2-core CI machine)
    if not ready.exists():
        proc.kill()
        pytest.fail("the command did not start within 90 s")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)  # at most the 10 s grace and the daemon's 10 s stop, on a loaded machine
    assert proc.returncode == 143, err
    assert marker.read_text().strip() == "TERM", "INT is passed on to the command as TERM"
    assert [c.split("|")[0] for c in mps_calls(env)] == ["-f", "quit"]
    assert "none left" in err


def test_with_mps_kills_a_command_that_ignores_the_signal_and_still_stops_its_daemon(tmp_path):
    """On the device machine a run stopped by ``timeout`` left its daemon: the command (a shell with
    background jobs) outlived the TERM. Its whole process group is killed after the grace period."""
    env = dict(mps_env(tmp_path), WITH_MPS_GRACE_S="2")
    marker = tmp_path / "grandchild"
    proc = subprocess.Popen([str(LAUNCH / "with_mps.sh"), "--", "bash", "-c",
                             f"trap '' TERM; (trap '' TERM; echo $BASHPID > {marker}; sleep 60) & sleep 60; wait"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    assert [c.split("|")[0] for c in mps_calls(env)] == ["-f", "quit"]
    assert "none left" in err
    assert not _alive(int(marker.read_text())), "the command's background job is killed too"


def test_with_mps_says_when_its_daemon_is_left(tmp_path):
    env = mps_env(tmp_path)
    stubborn = Path(env["PATH"].split(":")[0]) / "nvidia-cuda-mps-control"
    stubborn.write_text(FAKE_MPS.replace('rm -f "$CUDA_MPS_PIPE_DIRECTORY/running"', "true"))
    done = with_mps(env, "--", "true")
    assert done.returncode == 0
    assert "is still running; stop it with" in done.stderr
    daemon = int(Path(env["FAKE_MPS_LOG"] + ".pid").read_text())
    assert _alive(daemon), "the message is true: the daemon is still there"
    for marker in tmp_path.glob("ep_comm_mps_pipe.*/running"):  # let the fake daemon end
        marker.unlink()


def test_with_mps_waits_for_its_daemon_to_end_and_leaves_no_process(tmp_path):
    env = mps_env(tmp_path)
    done = with_mps(env, "--", "true")
    assert done.returncode == 0 and "none left" in done.stderr
    assert not _alive(int(Path(env["FAKE_MPS_LOG"] + ".pid").read_text())), "the foreground daemon has ended"


def test_with_mps_refuses_to_run_when_its_daemon_does_not_start(tmp_path):
    env = mps_env(tmp_path)
    broken = Path(env["PATH"].split(":")[0]) / "nvidia-cuda-mps-control"
    broken.write_text("#!/usr/bin/env bash\nexit 1\n")
    marker = tmp_path / "ran"
    done = with_mps(env, "--", "touch", str(marker))
    assert done.returncode == 2 and "nvidia-cuda-mps-control -f did not start" in done.stderr
    assert not marker.exists(), "the command does not run without its daemon"


@pytest.mark.parametrize("args, message", [
    ([], "no command after --"), (["--"], "no command after --"),
    (["--ranks-per-gpu", "0", "--", "true"], "--ranks-per-gpu '0': must be a positive integer"),
    (["--ranks-per-gpu", "x", "--", "true"], "--ranks-per-gpu 'x': must be a positive integer"),
    (["--ranks", "2", "--", "true"], "unknown option '--ranks'"),
])
def test_with_mps_rejects_bad_arguments(tmp_path, args, message):
    env = mps_env(tmp_path)
    done = with_mps(env, *args)
    assert done.returncode == 2 and message in done.stderr
    assert not Path(env["FAKE_MPS_LOG"]).exists(), "no daemon started"


def test_with_mps_refuses_without_mps_on_the_path():
    done = with_mps({}, "--", "true")
    assert done.returncode == 2 and "nvidia-cuda-mps-control is not on PATH" in done.stderr


def test_with_mps_help_prints_the_usage(tmp_path):
    done = with_mps(mps_env(tmp_path), "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage:")


# ------------------------------------------------------------------ gpu_selftest.sh
def selftest(args: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return run_script("gpu_selftest.sh", args, dict(env or {}, HOME=os.environ.get("HOME", "/tmp")))


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_gpu_selftest_help_prints_the_usage_and_runs_nothing(tmp_path, flag):
    done = selftest([flag, str(tmp_path / "out")])
    assert done.returncode == 0 and done.stdout.startswith("usage:")
    assert "--ranks" in done.stdout and "--mps" in done.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--ranks", "2,x", "OUT"], "--ranks '2,x': must be a comma-separated list of positive integers"),
    (["--ranks", "OUT"], "--ranks 'OUT': must be a comma-separated list"),
    (["--ranks"], "--ranks '': must be a comma-separated list"),
    (["--frobnicate", "OUT"], "unknown option '--frobnicate'"),
])
def test_gpu_selftest_rejects_bad_options(tmp_path, args, message):
    out = tmp_path / "out"
    done = selftest([str(out) if a == "OUT" else a for a in args])
    assert done.returncode == 2 and message.replace("OUT", str(out)) in done.stderr
    assert not out.exists()


FAKE_MPIRUN = """#!/usr/bin/env bash
# fake Open MPI mpirun: prints what the ranks would get; FAKE_HANG=1 leaves a process in its own group and hangs
if [ "$1" = --version ]; then echo 'mpirun (Open MPI) 5.0'; exit 0; fi
shown=$(env | grep -E '^(EP_COMM_RANKS_PER_GPU|CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)=' | sort | tr '\\n' ' ')
echo "fake mpirun: $* | $shown"
if [ -n "${FAKE_HANG:-}" ]; then
  python3 -c 'import os, sys, time; os.setpgid(0, 0); open(sys.argv[1], "w").write(str(os.getpid())); time.sleep(99)' \
        "$FAKE_HANG" &
    sleep 300
fi
"""


def selftest_env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    env = mps_env(tmp_path)
    fake = tmp_path / "bin" / "mpirun"
    fake.write_text(FAKE_MPIRUN)
    fake.chmod(0o755)
    return dict(env, MPIRUN=str(fake), **extra)


def test_gpu_selftest_runs_each_count_on_one_gpu_under_its_own_mps_daemon(tmp_path):
    env = selftest_env(tmp_path)
    done = selftest(["--ranks", "2,4", "--mps", str(tmp_path / "out"), "soak", "examples"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()] == [
        "soak@2", "soak@4", "examples@2", "examples@4", "examples-overlap@2", "examples-overlap@4", "examples-torch@2",
        "examples-torch@4"]
    log = (tmp_path / "out" / "selftest.log").read_text()
    assert "-np 4 --bind-to none" in log
    assert "| CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 EP_COMM_RANKS_PER_GPU=4" in log, "4 ranks share the GPU under MPS"
    assert "--json " + str(tmp_path / "out" / "soak-4ranks.json") in log
    assert "--json " + str(tmp_path / "out" / "examples-overlap-2ranks.json") in log
    calls = [c.split("|")[0] for c in mps_calls(env)]
    assert calls == ["-f", "quit"] * 8, "one daemon per step, each stopped"


def test_gpu_selftest_ends_what_a_timed_out_step_left_and_nothing_else(tmp_path):
    marker = tmp_path / "left_behind"
    bystander = subprocess.Popen(["sleep", "60"])  # not the self-test's: must survive it
    try:
        done = selftest([str(tmp_path / "out"), "determinism:2"], selftest_env(tmp_path, FAKE_HANG=str(marker)))
        assert done.returncode == 1 and "determinism@2" in done.stdout and "rc=124" in done.stdout
        pid = int(marker.read_text())
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "a process of the step's session, in a process group of its own, was left running"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------ slurm_two_nodes.sbatch
def test_slurm_two_nodes_runs_the_bench_through_slurm_sbatch_with_nodes_of_eight(tmp_path):
    """Inside a (fake) allocation: launch/slurm.sbatch's srun line gets the bench with --scaleup-ranks 8 and the JSON
    path, then the script's own arguments."""
    (tmp_path / "launch").symlink_to(LAUNCH)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", 'echo "srun $*"'), ("scontrol", "echo node-a; echo node-b")):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node-[a-b]"}
    done = subprocess.run(["bash", str(LAUNCH / "slurm_two_nodes.sbatch"), "--routing", "zipf"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == (
        "srun --mpi=pmix --cpu-bind=none launch/bind_gpu.sh python3 -m ep_comm.bench --config deepseek_v3_prefill "
        "--scaleup-ranks 8 --json results/prefill_2x8.json --routing zipf")
