"""Every measurement of ``python -m ep_comm.bench.kernels`` runs, at a tiny shape: per SM count, and as a pair of
simulated ranks whose round trip is checked against ``ep_comm.contract.layout`` / ``ep_comm.contract.reduce``."""
from __future__ import annotations

import json

import numpy as np
from helpers.host_timing import HostTiming

from ep_comm.backends.sm_grid import grid_shape
from ep_comm.bench.event_timing import CupyTiming
from ep_comm.bench.kernels import Bench, Pair, parse_args, queue_steps, run
from ep_comm.contract import layout as ref
from ep_comm.contract import reduce
from ep_comm.contract.arrays import to_host
from ep_comm.contract.choices import PAYLOAD_DTYPES

TINY = ["--tokens", "6", "--hidden", "8", "--experts", "8", "--topk", "2", "--alignment", "4", "--warps-per-block", "2"]


def timing_for(xp):
    """CUDA events on a GPU, host times in the simulator."""
    return HostTiming() if xp is np else CupyTiming(xp)


def test_every_measurement_launches(xp):
    bench = Bench(xp, parse_args(TINY + ["--sms", "1"]), 1)
    assert bench.num_rows > 0 and bench.num_expanded >= bench.num_rows
    assert bench.k.num_blocks == grid_shape(1)["num_blocks"]
    for launch, _ in bench.measurements().values():
        launch()


def test_rows_per_sm_count_and_pair_fields(xp, capsys):
    # one timed launch per measurement and no warm-up: the rows' fields and order are checked here, not their
    # statistics (every measurement's launch in the simulator is a few hundred Python threads)
    a = parse_args(TINY + ["--sms", "1,all", "--pair", "--warmup", "0", "--iters", "1"])
    report = json.loads(json.dumps(run(xp, timing_for(xp), a, device_sms=2)))  # 'all': the device's 2 SMs
    names = list(Bench(xp, a, 1).measurements())
    for sms in (1, 2):
        rows = [r for r in report["results"] if r["sms"] == sms]
        assert [r["name"] for r in rows] == names
        assert all(r["num_blocks"] == grid_shape(sms)["num_blocks"] and r["gpu_us_p50"] >= 0 for r in rows)
        pair = [r for r in report["pair"] if r["sms"] == sms]
        assert [r["name"] for r in pair] == ["dispatch (compact)", "combine (compact)"]
        for r in pair:
            assert min(r[f"{what}_us_{p}"] for what in ("wall", "tail") for p in ("p50", "p99")) >= 0
            assert r["bytes"] > 0 and r["gb_per_s"] >= 0 and isinstance(r["held"], bool)
    assert {"args", "received_rows", "expanded_rows", "results"} <= set(report)  # the keys from before --sms
    out = capsys.readouterr().out
    assert "pair op" in out and "tail p50 us" in out


def test_pair_round_trip(xp):
    """One dispatch and one combine of the pair: each rank receives its rows (x, origin, local experts) and
    gets back ``x`` summed once per rank its token reached (the combine's y is the received x)."""
    a = parse_args(TINY + ["--sms", "1", "--pair"])
    bench = Bench(xp, a, 1)
    pair = Pair(bench, timing_for(xp), 1)
    for send, receive, _ in pair.ops().values():
        queue_steps(pair, send, receive, [], 1)
    pair.timing.synchronize()
    x, local = to_host(bench.x), a.experts // a.ranks
    topk = [to_host(t) for t in bench.topk]
    for d in range(2):
        recv_x, recv_idx, _, meta = (to_host(o) for o in pair.out[d])
        src, tok = np.divmod(meta[:, 0].astype(np.int64), a.tokens)
        want = sorted(s * a.tokens + t for s in range(2)
                      for t in np.flatnonzero(ref.is_token_in_rank(topk[s], a.experts, a.ranks)[:, d]))
        assert sorted(meta[:, 0]) == want
        np.testing.assert_array_equal(recv_x, x[tok])
        np.testing.assert_array_equal(recv_idx, [ref.local_topk(topk[s][t:t + 1], d, local)[0] for s, t in
                                                 zip(src, tok)])
    bf16 = PAYLOAD_DTYPES["bfloat16"]  # the kernels read the uint16 payload as bfloat16 bits
    for s in range(2):
        reached = ref.is_token_in_rank(topk[s], a.experts, a.ranks)
        rows = [x.view(bf16)] * a.ranks
        want = reduce.combine_rows(rows, reached, [], bf16)
        np.testing.assert_array_equal(to_host(pair.combined[s]), want.view(np.uint16))
