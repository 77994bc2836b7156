"""``ep_comm.testing``: the shared generators and checker in one process (one rank), and the packaging of the
configs and ``py.typed`` (package data, inside a built wheel)."""
from __future__ import annotations

import importlib.resources
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import ep_comm
from ep_comm.bench.config import load_config
from ep_comm.cli.configs import available_configs, shipped_config_dir
from ep_comm.testing import (
    DTYPES,
    DispatchOptions,
    HostDispatch,
    Sources,
    check_combine,
    check_dispatch,
    check_round_trip,
    expected_receive,
    make_routing,
    mask_routing,
    random_payload,
    token_count,
)

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_experts=8, hidden=16, num_topk=3, num_max_tokens_per_rank=12)
WHEEL_TIMEOUT_S = 300


# ------------------------------------------------------------------ generators
def test_mask_routing_masks_entries_tokens_and_the_first_tokens_on_a_copy():
    idx = make_routing("uniform", 400, 16, 4, seed=0, idx_dtype=np.int32).topk_idx
    masked = mask_routing(idx, np.random.default_rng(1), entry_rate=0.25, token_rate=0.1, first_tokens=3)
    assert masked.dtype == np.int32 and (idx >= 0).all(), "the input is not changed"
    assert (masked[:3] == -1).all()
    assert 0.2 < (masked == -1).mean() < 0.45
    assert ((masked == -1) | (masked == idx)).all()
    assert (masked == -1).all(axis=1)[3:].mean() > 0.05, "some tokens go nowhere"


def test_mask_routing_draws_the_same_stream_whatever_the_rates():
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    idx = make_routing("hot", 10, 8, 2, seed=0).topk_idx
    mask_routing(idx, a)
    mask_routing(idx, b, entry_rate=0.5, token_rate=0.5)
    assert a.random() == b.random()


@pytest.mark.parametrize("call, pattern", [
    (lambda: mask_routing(np.zeros((2, 2), np.int64), np.random.default_rng(), entry_rate=1.5),
     r"entry_rate=1.5: must be in \[0, 1\]"),
    (lambda: mask_routing(np.zeros((2, 2), np.int64), np.random.default_rng(), first_tokens=-1),
     r"first_tokens=-1: must be >= 0"),
    (lambda: token_count("many", 4, np.random.default_rng(), 0), r"token mode='many': must be one of"),
    (lambda: make_routing("uniform", 2, 4, 2, idx_dtype=np.float32), r"idx_dtype=float32: must be an integer dtype"),
])
def test_generator_errors_name_argument_value_rule(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_token_counts_by_mode():
    rng = np.random.default_rng(0)
    assert token_count("full", 9, rng, 0) == 9 and token_count("one", 9, rng, 3) == 1
    assert token_count("all_empty", 9, rng, 1) == 0
    assert token_count("some_empty", 9, rng, rank=1, turn=1) == 0
    assert all(0 <= token_count("some_empty", 9, rng, rank=0, turn=1) <= 9 for _ in range(20))
    assert max(token_count("small", 100, rng, 0) for _ in range(200)) == 8
    assert max(token_count("random", 5, rng, 0) for _ in range(200)) == 5


def test_routing_seeded_by_a_generator_advances_it():
    rng = np.random.default_rng(3)
    first = make_routing("zipf", 20, 16, 4, seed=rng).topk_idx
    assert not np.array_equal(first, make_routing("zipf", 20, 16, 4, seed=rng).topk_idx)
    assert np.array_equal(first, make_routing("zipf", 20, 16, 4, seed=np.random.default_rng(3)).topk_idx)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_random_payload_has_negative_zeros_only_when_asked(dtype):
    x = random_payload(np.random.default_rng(0), (64, 32), DTYPES[dtype], negative_zero_rate=0.1)
    assert x.dtype == DTYPES[dtype]
    assert (np.signbit(x.astype(np.float32)) & (x.astype(np.float32) == 0)).mean() > 0.05
    plain = random_payload(np.random.default_rng(0), (64, 32), DTYPES[dtype])
    assert not (np.signbit(plain.astype(np.float32)) & (plain.astype(np.float32) == 0)).any()


# ------------------------------------------------------------------ the checker on one rank
def one_rank_round_trip(opts: DispatchOptions, seed: int = 0):
    """A dispatch + combine on a one-rank mpi Buffer; ``(sources, out, res)``."""
    rng = np.random.default_rng(seed)
    idx = mask_routing(make_routing("uniform", 10, 8, 3, seed=rng).topk_idx, rng, entry_rate=0.2, first_tokens=1)
    x = random_payload(rng, (10, 16), DTYPES["float32"], 0.1)
    w = rng.random(idx.shape).astype(np.float32)
    sources = Sources(8, SHAPE["num_max_tokens_per_rank"], [idx], [x], [w if opts.weighted else None])
    with ep_comm.Buffer(MPI.COMM_SELF, dtype="float32", backend="mpi", deterministic=opts.deterministic,
                        **SHAPE) as buf:
        out = buf.dispatch(x, idx, w if opts.weighted else None, expand=opts.expand,
                           expert_alignment=opts.alignment, zero_padding=opts.zero_padding, cpu_sync=opts.cpu_sync)
        res = buf.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights if opts.weighted else None)
    return sources, out, res


OPTIONS = [DispatchOptions(), DispatchOptions(weighted=True, deterministic=True),
           DispatchOptions(cpu_sync=False, weighted=True),
           DispatchOptions(expand=True, alignment=4, zero_padding=True, weighted=True, deterministic=True),
           DispatchOptions(expand=True, alignment=2, cpu_sync=False, zero_padding=True)]


@pytest.mark.parametrize("opts", OPTIONS)
def test_round_trips_of_the_mpi_backend_pass(opts):
    sources, out, res = one_rank_round_trip(opts)
    assert check_round_trip(sources, 0, opts, out, res) == []


@pytest.mark.parametrize("opts", [OPTIONS[1], OPTIONS[3]])
def test_the_checker_catches_wrong_outputs(opts):
    sources, out, res = one_rank_round_trip(opts)
    got = HostDispatch.of(out)
    want = expected_receive(sources, 0)
    rows = got.num_expanded if opts.expand else got.num_recv
    assert rows >= 2 and len(want.origin) >= 2
    swapped = got.recv_x.copy()
    first_two = np.nonzero(swapped.any(axis=1))[0][:2]
    swapped[first_two] = swapped[first_two[::-1]]
    assert check_dispatch(sources, 0, opts, replace(got, recv_x=swapped)), "swapped rows"
    meta = got.meta.copy()
    meta[0, 0] = meta[1, 0]
    assert any("missing or duplicated" in p for p in check_dispatch(sources, 0, opts, replace(got, meta=meta)))
    weights = got.recv_w.copy()
    weights[got.recv_idx >= 0] += 1
    assert any("weights differ" in p for p in check_dispatch(sources, 0, opts, replace(got, recv_w=weights)))
    assert any("shape" in p for p in check_dispatch(sources, 0, opts, replace(got, recv_w=weights[:-1])))
    assert any("recv_topk_weights is None" in p for p in check_dispatch(sources, 0, opts, replace(got, recv_w=None)))
    off = res.x.copy()
    off.view(np.uint32)[1, 0] ^= 1
    assert any("combine differs" in p for p in check_combine(sources, 0, opts, off, res.topk_weights))
    assert any("topk_weights differ" in p for p in check_combine(sources, 0, opts, res.x, res.topk_weights + 1))


def test_the_checker_catches_dirty_padding_and_order():
    opts = OPTIONS[3]
    sources, out, _ = one_rank_round_trip(opts, seed=4)
    got = HostDispatch.of(out)
    padding = np.nonzero(got.recv_idx < 0)[0]
    assert len(padding), "alignment 4 leaves padding rows"
    dirty = got.recv_x.copy()
    dirty[padding[0]] = 1.0
    assert "padding rows are not zero" in check_dispatch(sources, 0, opts, replace(got, recv_x=dirty))
    meta = got.meta.copy()
    meta[[0, 1]] = meta[[1, 0]]
    assert any("order" in p for p in check_dispatch(sources, 0, opts, replace(got, meta=meta)))


# ------------------------------------------------------------------ packaging
def test_the_configs_of_a_checkout_are_its_top_level_configs():
    shipped = shipped_config_dir()
    assert shipped == REPO / "configs", "ep_comm is imported from this checkout, which has no ep_comm/configs/"
    names = sorted(p.stem for p in shipped.glob("*.toml"))
    assert "cpu_demo" in names and names == available_configs()
    assert load_config("cpu_demo").path == str(shipped / "cpu_demo.toml")
    assert (importlib.resources.files("ep_comm") / "py.typed").is_file()


def test_every_package_directory_is_listed_in_pyproject():
    with open(REPO / "pyproject.toml", "rb") as f:
        listed = tomllib.load(f)["tool"]["setuptools"]["packages"]
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ep_comm").rglob("*.py")}
    assert sorted(on_disk | {"ep_comm.configs"}) == sorted(listed), "pyproject's [tool.setuptools] packages"


def test_the_wheel_carries_the_modules_configs_and_py_typed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("ep_comm", "configs"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "out"), str(source)]
    try:
        built = subprocess.run(cmd, capture_output=True, text=True, timeout=WHEEL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish within {WHEEL_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    assert built.returncode == 0, built.stdout + built.stderr[-5000:]
    (wheel,) = (tmp_path / "out").glob("ep_comm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (REPO / "configs").glob("*.toml")}
    assert {f"ep_comm/configs/{c}" for c in configs} <= names and "cpu_demo.toml" in configs
    modules = {p.relative_to(source).as_posix() for p in (source / "ep_comm").rglob("*.py")}
    assert modules <= names and "ep_comm/testing/check.py" in modules
    assert "ep_comm/py.typed" in names
