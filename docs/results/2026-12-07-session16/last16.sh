#!/bin/bash
# session 16, a last short call (~350 s): the 1-rank decode and prefill bench, old tree against new (each checks its
# round trip), then the contract suite at 2 ranks under MPS with stores and the repro at 2 and 1 ranks.
D=docs/results/2026-12-07-session16
LAST_START=200 STEPS="bench new n1,bench old o1,bench new n1 prefill,bench old o1 prefill" bash $D/compare16.sh
SUITES=s2 KERNELS=0 GPUTESTS=0 bash $D/verify16.sh
