"""The orders of ``tools/host_calls.py`` (host time of single eager calls, old tree against new): on a Buffer over the
fake GPU (no kernel runs, ``helpers.eager_counts.LaunchCounter``), each order makes the calls it names, with the
handles and weights it names, and reports every call's times; the summary and its table."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from helpers.eager_counts import LaunchCounter
from helpers.fake_gpu import simulated_buffer

from ep_comm.testing.routing import uniform_routing

_PATH = Path(__file__).resolve().parents[2] / "tools" / "host_calls.py"
_spec = importlib.util.spec_from_file_location("host_calls", _PATH)
host_calls = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_calls)

ROUNDS = 3


class Spy:
    """A Buffer's dispatch and combine, each call's arguments noted (``calls``: ``(name, args, kwargs)``)."""

    def __init__(self, buf):
        self.buf, self.calls = buf, []

    def dispatch(self, *args, **kwargs):
        self.calls.append(("dispatch", args, kwargs))
        return self.buf.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        self.calls.append(("combine", args, kwargs))
        return self.buf.combine(*args, **kwargs)


@pytest.fixture
def spied(monkeypatch):
    """``(spy, x, idx, weights)``: a Buffer of ``SMALL_GEO`` over the fake GPU (``simulated_buffer``) under a
    LaunchCounter, one warm-up round per order."""
    monkeypatch.setattr(host_calls, "WARMUP", 1)
    buf = simulated_buffer()
    geo = buf.geometry
    idx = uniform_routing(geo.max_tokens, geo.num_experts, geo.num_topk, seed=2).topk_idx
    x = np.ones((geo.max_tokens, geo.hidden), geo.dtype)
    weights = np.full((geo.max_tokens, geo.num_topk), 0.5, np.float32)
    with LaunchCounter(buf._backend):
        yield Spy(buf), x, idx, weights
    buf.close()


def _syncs():
    seen = []
    return seen, lambda: seen.append(1)


def test_the_alone_order_times_each_call_after_a_sync(spied):
    spy, x, idx, weights = spied
    seen, sync = _syncs()
    calls = host_calls.alone_order(spy, x, idx, weights, sync)
    assert list(calls) == ["cached_weights", "cached", "combine", "combine_fresh", "new", "cached_sync", "new_sync",
                           "combine_sync"]
    first = len(spy.calls)
    times = host_calls.time_alone(calls, ROUNDS, sync)
    assert {name: len(v) for name, v in times.items()} == {name: ROUNDS for name in calls}
    assert all(t > 0 for v in times.values() for t in v)
    rounds = 1 + ROUNDS
    # one sync per call, one more between combine_fresh's dispatch and its combine, one at the end
    assert len(seen) == rounds * (len(calls) + 1) + 1
    made = spy.calls[first:first + len(calls) + 1]  # the first round: combine_fresh dispatches, then combines
    kinds = [(name, "handle" in kwargs, "topk_weights" in kwargs, kwargs.get("cpu_sync")) for name, _, kwargs in made]
    assert kinds == [("dispatch", True, True, False), ("dispatch", True, False, False), ("combine", False, False, None),
                     ("dispatch", True, False, False), ("combine", False, False, None),
                     ("dispatch", False, True, False), ("dispatch", True, True, True),
                     ("dispatch", False, True, True), ("combine", False, False, None)]
    combines = [args[1] for name, args, _ in spy.calls[first:] if name == "combine"]
    same, fresh = combines[0::3], combines[1::3]  # combine, combine_fresh per round (combine_sync third)
    assert all(h is same[0] for h in same), "combine: the same handle every round"
    assert len({id(h) for h in fresh}) == rounds, "combine_fresh: a new handle every round"


def test_the_round_order_is_the_bench_round(spied):
    spy, x, idx, weights = spied
    seen, sync = _syncs()
    times = host_calls.time_round(spy, x, idx, weights, ROUNDS, sync)
    assert {name: len(v) for name, v in times.items()} == {"cached": ROUNDS, "combine": ROUNDS, "new": ROUNDS}
    assert len(seen) == 1 + ROUNDS + 1, "one sync per round, before its cached dispatch, and one at the end"
    made = spy.calls[1:]  # after the dispatch whose handle the rounds replay
    assert len(made) == 3 * (1 + ROUNDS)
    replayed, combined = set(), set()
    for at in range(0, len(made), 3):
        (d, _, dk), (c, cargs, _), (n, nargs, nk) = made[at:at + 3]
        assert (d, c, n) == ("dispatch", "combine", "dispatch")
        assert "topk_weights" not in dk and dk["cpu_sync"] is False
        assert nk["cpu_sync"] is False and nargs[1] is idx
        replayed.add(id(dk["handle"]))
        combined.add(id(cargs[1]))
    assert len(replayed) == 1, "every round replays one handle"
    assert len(combined) == 1 + ROUNDS and not combined & replayed, "each combine takes its dispatch's new handle"


def test_the_summary_and_its_table():
    times = {"cached": [10e-6, 20e-6, 30e-6], "combine": [5e-6] * 3}
    result = host_calls.summary(times)
    assert result["cached"]["p50"] == pytest.approx(20) and result["cached"]["mean"] == pytest.approx(20)
    assert result["cached"]["p99"] == pytest.approx(29.8) and result["combine"]["p50"] == pytest.approx(5)
    assert host_calls.table({"round": result}) == ["round: cached 20.0/29.8, combine 5.0/5.0"]


def test_one_rank_writes_the_given_path_and_several_ranks_one_file_each_with_their_lines_marked():
    lines = ["alone: cached 1.0/2.0", "round: combine 3.0/4.0"]
    assert host_calls.rank_output("out/hc.json", lines, 0, 1) == ("out/hc.json", lines)
    path, marked = host_calls.rank_output("out/hc.json", lines, 1, 2)
    assert path == "out/hc.rank1.json"
    assert marked == ["rank 1 alone: cached 1.0/2.0", "rank 1 round: combine 3.0/4.0"]
