"""Where the benchmark's config files (``*.toml``, one per MoE layer shape) are found, and which there are.

The configs live in ``configs/`` at the top of the repository; the wheel ships them as the package data
``ep_comm/configs/``. A checkout or an editable install reads the top-level directory, an installed wheel
its package data; ``EP_COMM_CONFIG_DIR`` overrides both.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the ep_comm package directory


def shipped_config_dir() -> Path:
    """The configs that come with ep_comm: ``ep_comm/configs/`` in an installed wheel, else the checkout's
    top-level ``configs/`` (beside the ``ep_comm`` package)."""
    installed = PACKAGE_DIR / "configs"
    return installed if installed.is_dir() else PACKAGE_DIR.parent / "configs"


def config_dir() -> Path:
    """The directory names are looked up in: ``$EP_COMM_CONFIG_DIR`` or :func:`shipped_config_dir`."""
    return Path(os.environ.get("EP_COMM_CONFIG_DIR", shipped_config_dir()))


def available_configs() -> List[str]:
    """Names of the configs in :func:`config_dir`, sorted."""
    return sorted(p.stem for p in config_dir().glob("*.toml"))
