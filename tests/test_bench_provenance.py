"""The benchmark records where its figures come from: the git commit of the checkout (with a dirty
flag), the package versions, and on GPU the GPU model and driver (``nvidia-smi`` faked here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.mpirun import launcher, run_job

from ep_comm.bench import provenance
from ep_comm.cli.versions import versions

REPO = Path(__file__).resolve().parents[1]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def test_the_commit_of_a_checkout_and_its_dirty_flag(tmp_path):
    git("init", "-q", cwd=tmp_path)
    (tmp_path / "f").write_text("a")
    git("add", "f", cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c", cwd=tmp_path)
    sha = git("rev-parse", "HEAD", cwd=tmp_path)
    (tmp_path / "untracked").write_text("x")
    assert provenance.git_commit(tmp_path) == {"git_commit": sha, "git_dirty": False}, "untracked files do not count"
    (tmp_path / "f").write_text("b")
    assert provenance.git_commit(tmp_path) == {"git_commit": sha, "git_dirty": True}


def test_no_commit_outside_a_checkout_or_below_its_top(tmp_path):
    assert provenance.git_commit(tmp_path) is None
    git("init", "-q", cwd=tmp_path)
    (tmp_path / "site-packages").mkdir()
    assert provenance.git_commit(tmp_path / "site-packages") is None, "a package installed inside another repository"


def test_the_gpu_model_is_the_ranks_gpu_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '00000000:18:00.0, NVIDIA H200, 570.124.06'\n"
                   "echo '00000000:2A:00.0, NVIDIA H100 80GB HBM3, 570.124.06'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert provenance.gpu_model("0000:2a:00.0") == "NVIDIA H100 80GB HBM3, driver 570.124.06"
    assert provenance.gpu_model("0000:99:00.0") is None


def test_the_bench_json_and_header_record_commit_and_versions(tmp_path):
    out = tmp_path / "b.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    job = run_job(launcher(2, env) + [sys.executable, "-m", "ep_comm.bench", "--iters", "1", "--warmup", "0",
                                      "--json", str(out)], env, 240, cwd=REPO)
    assert job.returncode == 0, job.stdout + job.stderr
    meta = json.loads(out.read_text())["meta"]
    header, version_line = job.stdout.splitlines()[:2]
    if provenance.git_commit(REPO) is None:  # not a checkout (an sdist, say): no commit recorded
        assert "git_commit" not in meta and "git_commit=" not in header
    else:
        assert meta["git_commit"] == git("rev-parse", "HEAD", cwd=REPO) and isinstance(meta["git_dirty"], bool)
        assert f"git_commit={meta['git_commit']} git_dirty={meta['git_dirty']}" in header
    assert meta["versions"] == versions() and "gpu" not in meta, "no GPU on the mpi backend"
    assert version_line.startswith(f"versions: python {meta['versions']['python']}, ep_comm ")
