"""The host poll of the nvshmem backend (``StepRunner._poll``), on a fake clock: it checks the progress marker back to
back first, then yields the core, and sleeps only after a long wait (no sleep granularity on a short one), and it
gives up, naming the missing rank, at ``timeout_s`` plus the slack."""
from types import SimpleNamespace

import pytest
from helpers.fake_gpu import SMALL_GEO, simulated_backend

from ep_comm.backends.nvshmem import steps as nvshmem_steps
from ep_comm.contract.protocol import RECORD_TAG
from ep_comm.errors import TimeoutError as EpTimeoutError


class _Clock:
    """A fake ``perf_counter`` advancing ``tick`` seconds per read; ``sleep``/``sched_yield`` note themselves."""

    def __init__(self, tick: float):
        self.now, self.tick, self.log = 0.0, tick, []

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.log.append(("sleep", seconds))
        self.now += seconds

    def sched_yield(self) -> None:
        self.log.append(("yield", None))


@pytest.fixture
def runner(monkeypatch):
    be = simulated_backend(SMALL_GEO, True, False)
    clock = _Clock(1e-6)
    monkeypatch.setattr(nvshmem_steps, "time", SimpleNamespace(perf_counter=clock.perf_counter, sleep=clock.sleep))
    monkeypatch.setattr(nvshmem_steps, "os", SimpleNamespace(sched_yield=clock.sched_yield))
    return be.runner, clock


def _reached_after(clock: _Clock, seconds: float):
    return lambda marker: clock.now >= seconds


def test_a_short_wait_spins_without_yielding_or_sleeping(runner):
    r, clock = runner
    r.device.reached = _reached_after(clock, 150e-6)
    r._poll("marker", "dispatch")
    assert clock.log == [] and clock.now < 160e-6, "woken within a few fake microseconds, no sleep, no yield"


def test_a_wait_past_the_spin_yields_then_sleeps_only_after_the_yield_phase(runner):
    r, clock = runner
    r.device.reached = _reached_after(clock, 5e-3)
    r._poll("marker", "dispatch")
    assert clock.log and {kind for kind, _ in clock.log} == {"yield"}, "a 5 ms wait yields, never sleeps"
    clock.log.clear()
    clock.now = 0.0
    r.device.reached = _reached_after(clock, 0.1)
    r._poll("marker", "dispatch")
    naps = [s for kind, s in clock.log if kind == "sleep"]
    assert naps and naps[0] == nvshmem_steps.POLL_NAP_S and max(naps) == nvshmem_steps.POLL_NAP_MAX_S
    first_nap = next(i for i, (kind, _) in enumerate(clock.log) if kind == "sleep")
    assert all(kind == "sleep" for kind, _ in clock.log[first_nap:]), "no yield after the sleeps began"


def test_the_poll_gives_up_at_the_timeout_naming_the_missing_rank(runner, monkeypatch):
    r, clock = runner
    clock.tick = 1e-3  # a coarse clock: the fake wait reaches the deadline quickly
    r.device.reached = lambda marker: False
    monkeypatch.setattr(r.transport, "missing", [0])
    with pytest.raises(EpTimeoutError, match=r"ranks? \[0\]"):
        r._poll("marker", "dispatch")
    assert clock.now >= r.timeout_s + nvshmem_steps.POLL_SLACK_S


def test_the_poll_ends_on_its_record_tag_and_a_record_of_another_step_still_times_out(runner, monkeypatch):
    """Given this step's tag, the poll ends as soon as the mapped record holds it (the marker not reached); a record
    holding an earlier step's tag (or :data:`NO_TAG`, a poll without a tag) leaves it to the marker, up to the
    timeout."""
    r, clock = runner
    r.device.reached = lambda marker: False
    r.record_host[RECORD_TAG] = 7
    r._poll("marker", "dispatch", 7)
    assert clock.now < 10e-6
    clock.tick = 1e-3
    monkeypatch.setattr(r.transport, "missing", [0])
    for tag in (8, nvshmem_steps.NO_TAG):
        clock.now = 0.0
        with pytest.raises(EpTimeoutError, match=r"ranks? \[0\]"):
            r._poll("marker", "dispatch", tag)
        assert clock.now >= r.timeout_s + nvshmem_steps.POLL_SLACK_S
