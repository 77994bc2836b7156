"""The checks of a simulated combine (``world.World``) against ``ep_comm.contract.reduce``: :func:`run_combine`, a
dispatch (``dispatch_checks.run_dispatch``) then a combine on every rank, compared with the reference bit for bit.

Compact mode: the rows a rank received from itself are not sent back into its own buffer; the reduce
reads them from ``y``.
"""
from __future__ import annotations

import numpy as np
from dispatch_checks import run_dispatch
from world import bits, random_payload

from ep_comm.contract import layout as ref
from ep_comm.contract import reduce
from ep_comm.contract.arrays import to_host

PARITY = 0  # dispatch ran with parity 1


def expected_combine(world, sent, received, ys, weights, bias_terms, expand: bool) -> list:
    """Per source rank: ``reduce.combine_rows`` over the partials ``reduce.expand_partials`` makes."""
    from_rank = []
    for d in range(world.num_ranks):
        n = len(world.arrivals(d, sent))
        meta = received[d].recv_src_metadata[:n]
        partial = (reduce.expand_partials(ys[d], meta[:, 2:], weights[d], world.dtype) if expand else ys[d][:n])
        from_rank.append((meta, partial))
    out = []
    for s in range(world.num_ranks):
        tokens = world.topk[s].shape[0]
        rows = []
        for meta, partial in from_rank:
            per_token = np.zeros((tokens, world.hidden), world.dtype)
            mine = meta[:, 0] // world.max_tokens == s
            per_token[meta[mine, 0] % world.max_tokens] = partial[mine]
            rows.append(per_token)
        reached = ref.is_token_in_rank(world.topk[s], world.num_experts, world.num_ranks)
        out.append(reduce.combine_rows(rows, reached, bias_terms[s], world.dtype))
    return out


def poison_own_regions(world) -> list:
    """Fill every rank's own region ``rows[PARITY, rank]`` with all-one bits (NaN in every payload dtype);
    returns a copy of each region as filled."""
    filled = []
    for s, view in enumerate(world.views):
        view.rows[PARITY, s] = np.iinfo(view.rows.dtype).max
        filled.append(to_host(view.rows[PARITY, s]).copy())
    return filled


def run_combine(world, *, expand: bool, weighted: bool, bias: int, deterministic: bool = True,
                poison_own: bool = False):
    """Dispatch, combine on every rank and compare with the reference bit for bit; with ``poison_own``
    (compact), every rank's own region is poisoned before the combine and must stay untouched by it."""
    sent, received = run_dispatch(world, deterministic=deterministic, expand=expand, alignment=2, zero_padding=True)
    poisoned = poison_own_regions(world) if poison_own else None
    rng = np.random.default_rng(7)
    k, xp = world.kernels, world.xp
    ys, device_ys, weights = [], [], []
    for d in range(world.num_ranks):
        rows = len(received[d].recv_x) if expand else received[d].recv_src_metadata.shape[0]
        ys.append(random_payload(rng, (rows, world.hidden), world.dtype))
        device_ys.append(world.device_payload(ys[d]))
        weights.append(rng.standard_normal(rows).astype(np.float32) if weighted and expand else None)
        k.combine_scatter(device_ys[d], xp.asarray(received[d].recv_src_metadata),
                       received[d].counts.rank_psum, [v.rows for v in world.views], my_rank=d, step=world.step(PARITY),
                       expand=expand, weights=world.dev(weights[d]), stream=0)
    for s, region in enumerate(poisoned or ()):
        np.testing.assert_array_equal(to_host(world.views[s].rows[PARITY, s]), region)
    bias_terms = []
    for s in range(world.num_ranks):
        shape = (world.topk[s].shape[0], world.hidden)
        terms = [random_payload(rng, shape, world.dtype), random_payload(rng, shape, np.dtype(np.float32))][:bias]
        bias_terms.append(terms)
    want = expected_combine(world, sent, received, ys, weights, bias_terms, expand)
    for s in range(world.num_ranks):
        out = xp.full((world.topk[s].shape[0], world.hidden), 3, world.device_payload(world.x[s]).dtype)
        own = {} if expand else dict(y=device_ys[s], recv_rank_psum=received[s].counts.rank_psum)
        k.combine_reduce(world.views[s].rows, world.step(PARITY), xp.asarray(sent[s].slot_idx),
                         world.dev(world.topk[s]), out, my_rank=s,
                         bias=[world.device_payload(b) for b in bias_terms[s]], **own, stream=0)
        np.testing.assert_array_equal(bits(to_host(out)), bits(want[s]))
