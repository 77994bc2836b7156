"""The benchmark records where its figures come from: the git commit of the checkout (None, and why, unless the
files are that commit's), the package versions, and on GPU the GPU model and driver (``nvidia-smi`` faked here)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.mpirun import launcher, run_job

from ep_comm.bench import provenance
from ep_comm.cli.versions import versions

REPO = Path(__file__).resolve().parents[2]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, timeout=30).stdout.strip()


def committed_checkout(root: Path) -> str:
    """A git checkout at ``root`` with one commit of ``f`` and ``ep_comm/m.py``; returns the commit."""
    git("init", "-q", cwd=root)
    (root / "f").write_text("a")
    (root / "ep_comm").mkdir()
    (root / "ep_comm" / "m.py").write_text("x = 1\n")
    git("add", "f", "ep_comm", cwd=root)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c", cwd=root)
    return git("rev-parse", "HEAD", cwd=root)


def test_a_clean_checkout_records_its_commit_and_untracked_files_outside_the_package_do_not_count(tmp_path):
    sha = committed_checkout(tmp_path)
    (tmp_path / "results.json").write_text("{}")
    assert provenance.git_commit(tmp_path) == {"git_commit": sha, "git_dirty": False}


@pytest.mark.parametrize("change, named", [
    (lambda root: (root / "f").write_text("b"), "f"),  # a tracked file changed
    (lambda root: (root / "ep_comm" / "new.py").write_text(""), "ep_comm/new.py"),  # a stale .git: newer files untracked
])
def test_files_that_are_not_heads_record_no_commit_and_say_why(tmp_path, change, named):
    sha = committed_checkout(tmp_path)
    change(tmp_path)
    got = provenance.git_commit(tmp_path)
    assert (got["git_commit"], got["git_dirty"]) == (None, True), "never a commit the files are not"
    assert got["git_commit_note"] == f"1 file(s) differ from HEAD {sha[:12]} ({named}): the run is of no commit"


def test_no_commit_outside_a_checkout_below_its_top_or_without_git(tmp_path, monkeypatch):
    assert provenance.git_commit(tmp_path) == {
        "git_commit": None, "git_dirty": None,
        "git_commit_note": f"{tmp_path} is not the top of a git checkout (an installed package?)"}
    committed_checkout(tmp_path)
    assert provenance.git_commit(tmp_path / "ep_comm")["git_commit"] is None, "a package inside another repository"
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert provenance.git_commit(tmp_path) == {
        "git_commit": None, "git_dirty": None,
        "git_commit_note": "git is not installed: the files cannot be matched to a commit"}


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
    assert {k: meta[k] for k in provenance.git_commit(REPO)} == provenance.git_commit(REPO)
    if meta["git_commit"] is None:  # not a clean checkout (a change under way, an sdist): no commit, and why
        assert "git_commit=" not in header and f"git_commit_note={meta['git_commit_note']}" in header
    else:
        assert meta["git_commit"] == git("rev-parse", "HEAD", cwd=REPO) and meta["git_dirty"] is False
        assert f"git_commit={meta['git_commit']} git_dirty=False" in header
    assert meta["versions"] == versions() and "gpu" not in meta, "no GPU on the mpi backend"
    assert version_line.startswith(f"versions: python {meta['versions']['python']}, ep_comm ")
