"""The shared reference inputs and checker of ep_comm's tests, soak runs, benchmark and examples.

- ``routing``: seeded routings (uniform / hot / Zipf), masks, per-rank token counts, payloads;
- ``round_trip``: what ``combine(dispatch(x))`` must return, and a bitwise comparison;
- ``forwarded``: the forwarded combine's order (``Buffer(forwarding=True)``, several nodes), independently;
- ``check``: the one dispatch/combine checker against the NumPy reference;
- ``dtypes``: the dtype table (names, NumPy dtypes, error bounds).

Nothing here imports ``ep_comm.bench``.
"""
from ep_comm.testing.check import (
    DispatchOptions,
    Expected,
    HostDispatch,
    Sources,
    check_combine,
    check_counts,
    check_dispatch,
    check_round_trip,
    expected_receive,
    same_bytes,
    token_rows,
)
from ep_comm.testing.dtypes import DTYPE_NAMES, DTYPES, RELATIVE_ERROR_BOUND
from ep_comm.testing.forwarded import Forwarded, forwarded_combine
from ep_comm.testing.round_trip import expected_round_trip, first_mismatch
from ep_comm.testing.routing import (
    KINDS,
    TOKEN_MODES,
    Routing,
    hot_routing,
    make_routing,
    mask_routing,
    random_payload,
    token_count,
    uniform_routing,
    zipf_routing,
)

__all__ = [
    "DTYPES", "DTYPE_NAMES", "KINDS", "RELATIVE_ERROR_BOUND", "TOKEN_MODES",
    "DispatchOptions", "Expected", "Forwarded", "HostDispatch", "Routing", "Sources",
    "check_combine", "check_counts", "check_dispatch", "check_round_trip", "expected_receive", "expected_round_trip",
    "first_mismatch", "forwarded_combine", "hot_routing", "make_routing", "mask_routing", "random_payload", "same_bytes", "token_count",
    "token_rows", "uniform_routing", "zipf_routing",
]
