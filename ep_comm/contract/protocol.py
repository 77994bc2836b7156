"""Constants of the host/device protocol that kernels compile in: the routing verdict's words and the words of
the receive count's record.

They live here, inside the kernel cache key (``jit.py``), and the host modules re-export them:
``ep_comm.contract.checks`` (the verdict's encoding) and ``ep_comm.contract.symmetric`` (the record's layout). Plain Python: the
host imports it without Numba.
"""
from __future__ import annotations

VERDICT_WORDS = 2  # int32 words of a routing verdict in the count exchange, after the counts
ID_CLAMP = 2**31 - 1  # the largest verdict word: ids from ID_CLAMP - 1 on travel as ID_CLAMP

RECORD_TAG, RECORD_N, RECORD_M, RECORD_VERDICTS = 0, 1, 2, 3  # words of the receive count's record
