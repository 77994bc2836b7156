"""Fault tests: jobs of ``tests/faults/fault_job.py`` where the last rank skips a call, is late, is stopped
with SIGSTOP, or rank 0 is killed with SIGKILL (under a launcher that keeps the survivors running: MPICH hydra's
``-disable-auto-cleanup``; each rank a child of ``faults/shielded.py``, which takes the kill hydra still sends
the survivors now and then under load) or reaches ``close`` 8 s late, each under a hard outer timeout; one node, and
(the forwarded cases) virtual nodes with ``Buffer(forwarding=True)``, where a forwarder waits for its inbox first.

Checked on every rank that survives: the ``ep_comm.TimeoutError`` comes within ``timeout_s`` (+ 2 s) of its
own call and names the faulty rank; a rank that comes after its peers gave up raises ``PeerAbortedError``
at once instead of returning rows; every ``close`` returns within ``timeout_s + 2`` s (printed); the job
ends (exit at interpreter shutdown is bounded too).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Set

import pytest
from helpers.mpirun import launcher, mpiexec_version, run_job
from helpers.options import current

JOB = Path(__file__).parents[1] / "faults" / "fault_job.py"  # tests/faults
SHIELDED_JOB = JOB.with_name("shielded.py")  # the same job as the child of a shim that takes the launcher's kill
TIMEOUT_S = 3.0
SLACK_S = 2.0  # the bound: survivors out of close within timeout_s + 2 s
JOB_LIMIT_S = 90  # the hard outer timeout of one job
# under pytest-xdist (.ci/run) the fault jobs run one at a time, on one worker (tests/conftest.py)
pytestmark = pytest.mark.xdist_group("faults")
SURVIVOR_WAIT_S = 20  # how long the survivors of a kill may outlive the launcher
CASES = [("skip", 2), ("late", 2), ("late", 3), ("stop", 2), ("kill", 2), ("late_close", 2)]
# (scenario, ranks, ranks per node): forwarded, 4 ranks as 2 nodes, 6 as 2 and 8 as 4
FORWARDED = [(scenario, 4, 2) for scenario in ("skip", "late", "stop", "kill", "late_close")] + [
    ("late", 6, 3), ("skip", 8, 2)]


def keep_survivors_flags() -> List[str]:
    """The launcher flags that keep the other ranks running when one is killed: MPICH hydra's
    ``-disable-auto-cleanup``, Open MPI's ``--enable-recovery``."""
    version = mpiexec_version(launcher(1, {})[0])
    if "HYDRA" in version.upper():
        return ["-disable-auto-cleanup"]
    if "OPEN MPI" in version.upper() or "OPENRTE" in version.upper():  # Open MPI 4 says "mpiexec (OpenRTE) 4.1"
        return ["--enable-recovery"]
    pytest.skip(f"the kill case needs a launcher that keeps the survivors running (hydra, Open MPI): {version[:80]!r}")


def run_scenario(scenario: str, num_ranks: int, out: Path, expected: Set[int], nodes: List[str]) -> tuple:
    """``(records by rank, the job, its wall seconds)`` of one scenario's job (``nodes``: fault_job's virtual node
    options); waits up to ``SURVIVOR_WAIT_S`` after the launcher ended for the result files of ranks ``expected``
    (after a kill it may end first)."""
    env = dict(os.environ, UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1")
    flags = keep_survivors_flags() if scenario == "kill" else []
    script = SHIELDED_JOB if scenario == "kill" else JOB
    cmd = launcher(num_ranks, env) + flags + [sys.executable, str(script), scenario, "--backend", current().backend,
                                              "--timeout", str(TIMEOUT_S), "--out", str(out), *nodes]
    start = time.monotonic()
    job = run_job(cmd, env, JOB_LIMIT_S)
    wall = time.monotonic() - start
    deadline = time.monotonic() + SURVIVOR_WAIT_S
    while any(not (out / f"rank{r}.json").exists() for r in expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    return records, job, wall


def calls_of(record: dict) -> Dict[str, dict]:
    """The record's calls by ``name#n`` (``dispatch#2`` is the second dispatch)."""
    seen: Dict[str, int] = {}
    out = {}
    for c in record["calls"]:
        seen[c["call"]] = seen.get(c["call"], 0) + 1
        out[f"{c['call']}#{seen[c['call']]}"] = c
    return out


@pytest.mark.parametrize("scenario, num_ranks", CASES)
def test_fault(scenario, num_ranks, capsys, tmp_path):
    check_scenario(scenario, num_ranks, [], capsys, tmp_path)


@pytest.mark.parametrize("scenario, num_ranks, scaleup_ranks", FORWARDED)
def test_fault_forwarded(scenario, num_ranks, scaleup_ranks, capsys, tmp_path):
    check_scenario(scenario, num_ranks, ["--scaleup-ranks", str(scaleup_ranks), "--forwarding"], capsys, tmp_path)


def check_scenario(scenario: str, num_ranks: int, nodes: List[str], capsys, tmp_path: Path) -> None:
    """Run one scenario's job (``nodes``: fault_job's virtual node options) and check every surviving rank."""
    faulty = 0 if scenario == "kill" else num_ranks - 1  # fault_job.faulty_rank
    expected = set(range(num_ranks)) - ({faulty} if scenario == "kill" else set())
    records, job, wall = run_scenario(scenario, num_ranks, tmp_path, expected, nodes)
    output = f"{' '.join(job.args)} exited {job.returncode} after {wall:.1f} s:\n{job.stdout[-8000:]}\n{job.stderr[-4000:]}"
    assert set(records) == expected, output
    first_fault = "close#1" if scenario == "late_close" else "dispatch#2"
    lines = []
    for rank, record in sorted(records.items()):
        calls = calls_of(record)
        assert calls["dispatch#1"]["outcome"] == "ok" and calls["combine#1"]["outcome"] == "ok", output
        close = calls["close#1"]
        lines.append(f"rank {rank}: close {close['seconds']:.2f} s ({close['outcome']})")
        assert close["seconds"] < TIMEOUT_S + SLACK_S, output
        if rank != faulty:  # a punctual rank: its own timeout, naming the faulty rank, within timeout_s
            timed_out = calls[first_fault]
            assert timed_out["outcome"] == "TimeoutError", output
            assert f"waiting for ranks [{faulty}]" in timed_out["message"], output
            assert TIMEOUT_S <= timed_out["seconds"] < TIMEOUT_S + SLACK_S, output
            if scenario != "late_close":
                assert calls["combine#2"]["outcome"] == "BufferUnusableError", output
                assert close["outcome"] == "ok", output
        elif scenario == "skip":  # in close while its peers waited: their abort records end its wait
            assert close["outcome"] == "PeerAbortedError", output
            assert "gave up at dispatch #2" in close["message"], output
        else:  # late, stopped, late to close: the peers' abort records at once, no stale rows, no own timeout
            late_call = calls[first_fault]
            assert late_call["outcome"] == "PeerAbortedError", output
            assert late_call["seconds"] < 1.0, output
            step = first_fault.replace("#", " #")
            assert all(f"rank {r} gave up at {step}" in late_call["message"] for r in expected - {faulty}), output
            if scenario != "late_close":
                assert calls["combine#2"]["outcome"] == "BufferUnusableError", output
                assert close["outcome"] == "ok", output
    if scenario != "kill":
        assert job.returncode == 0, output
    with capsys.disabled():
        print(f"\n[fault {scenario}, {num_ranks} ranks {' '.join(nodes)}, timeout_s={TIMEOUT_S:g}] job {wall:.1f} s; " + "; ".join(lines))
