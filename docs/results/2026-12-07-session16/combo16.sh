#!/bin/bash
# session 16, when one device call is all there is: compare16.sh's decode and prefill bench, old tree against new
# (then host_calls, if before 260 s), then verify16.sh without tests/kernels and tests/gpu (the contract suite at 1 and
# 2 ranks under MPS, stores and puts; the repro at 2 and 1 ranks). About 530 s.
D=docs/results/2026-12-07-session16
LAST_START=260 STEPS="bench new n1,bench old o1,bench old o1 prefill,bench new n1 prefill,hc new n1,hc old o1" bash $D/compare16.sh
KERNELS=0 GPUTESTS=0 bash $D/verify16.sh
