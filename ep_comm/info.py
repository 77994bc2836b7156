"""``python -m ep_comm.info``: what this machine offers ep_comm (versions, GPUs, NVLink, environment).

Works without a GPU: missing pieces are reported as such, never raised.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from ep_comm.backends import choose_backend
from ep_comm.cli import ArgumentParser
from ep_comm.cli.configs import available_configs
from ep_comm.cli.external_commands import command_output
from ep_comm.cli.versions import versions

ENV_PREFIXES = ("NVSHMEM_", "NCCL_", "NUMBA_", "CUDA_VISIBLE_DEVICES", "OMPI_COMM_WORLD_LOCAL_RANK",
                "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "EP_COMM_")


def gpus() -> str:
    """GPU list and NVLink topology from ``nvidia-smi``, or why there is none."""
    listing = command_output(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    if listing is None:
        return "no nvidia-smi (or it failed): no NVIDIA GPU visible"
    topo = command_output(["nvidia-smi", "topo", "-m"]) or "(nvidia-smi topo -m failed)"
    return f"{listing}\n\nNVLink topology (nvidia-smi topo -m):\n{topo}"


def auto_backend() -> str:
    """What ``backend="auto"`` resolves to here and why, or the error a broken GPU stack raises."""
    try:
        choice = choose_backend("auto")
    except RuntimeError as exc:  # a broken GPU stack is what this command should show
        return f"backend='auto' fails: {exc}"
    return f"backend='auto' resolves to: {choice.name} ({choice.reason})"


def environment() -> Dict[str, str]:
    """The environment variables that steer NVSHMEM, NCCL, Numba and rank-to-GPU binding."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}


def report() -> str:
    """The whole text printed by ``python -m ep_comm.info``."""
    lines = ["ep_comm info", "", "versions:"]
    lines += [f"  {k:<12} {v}" for k, v in versions().items()]
    lines += ["", auto_backend(), "", "GPUs:", gpus(), "",
              "environment (NVSHMEM_*, NCCL_*, NUMBA_*, binding):"]
    env = environment()
    lines += [f"  {k}={v}" for k, v in env.items()] or ["  (none set)"]
    lines += ["", f"configs: {', '.join(available_configs())}"]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m ep_comm.info [--help]``: print :func:`report`."""
    about = __doc__.splitlines()[0].split(": ", 1)[1]
    ArgumentParser(prog="python -m ep_comm.info", description=about).parse_args(argv)
    print(report())


if __name__ == "__main__":
    main()
