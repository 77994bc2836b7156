"""Model and benchmark shapes: TOML files under the top-level ``configs/`` (``ep_comm/configs/`` in the wheel;
found by :mod:`ep_comm.cli.configs`), one loader, strict validation.

A config file holds the MoE layer shape and optional routing defaults::

    name = "cpu_demo"            # optional; when given it must equal the file name
    description = "..."          # optional
    num_experts = 16
    hidden = 256
    num_topk = 4
    tokens_per_rank = 256
    dtype = "bfloat16"           # float32 | float16 | bfloat16
    max_tokens_per_rank = 4096   # optional: the most tokens per rank a run may ask for (--tokens, --sweep);
                                 # default the larger of 4096 and tokens_per_rank

    [routing]                    # optional table, every key optional
    kind = "uniform"             # uniform | hot | zipf
    seed = 0
    zipf_s = 1.2                 # Zipf exponent (kind = "zipf")
    hot_expert = 0               # the expert every token picks (kind = "hot")

Unknown keys are errors: a misspelt key must not silently fall back to a default.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Tuple, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from ep_comm.cli.configs import available_configs, config_dir
from ep_comm.contract.choices import PAYLOAD_DTYPES
from ep_comm.testing.routing import KINDS as ROUTING_KINDS

DEFAULT_MAX_TOKENS = 4096
"""``max_tokens_per_rank`` of a config that does not set it (or its ``tokens_per_rank`` when larger)."""

class ConfigError(ValueError):
    """A config file is missing, unreadable, or breaks a rule; the message names file, key, value and rule."""


@dataclass(frozen=True)
class RoutingDefaults:
    """How the benchmark routes tokens unless the command line says otherwise."""

    kind: str = "uniform"
    seed: int = 0
    zipf_s: float = 1.2
    hot_expert: int = 0


@dataclass(frozen=True)
class Config:
    """One MoE layer shape. ``dtype`` is a payload dtype name of ``ep_comm.contract.choices``."""

    name: str
    num_experts: int
    hidden: int
    num_topk: int
    tokens_per_rank: int
    dtype: str  # required in the file (no default: see _TOP_RULES)
    description: str = ""
    max_tokens_per_rank: int = DEFAULT_MAX_TOKENS  # the most tokens per rank a benchmark run may ask for
    routing: RoutingDefaults = field(default_factory=RoutingDefaults)
    path: str = ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value >= 1


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


# key -> (check, rule shown in the error, required)
Rule = Tuple[Callable[[Any], bool], str, bool]
_TOP_RULES: Dict[str, Rule] = {
    "name": (lambda v: isinstance(v, str) and v != "", "must be a non-empty string", False),
    "description": (_is_text, "must be a string", False),
    "num_experts": (_is_positive_int, "must be a positive integer", True),
    "hidden": (_is_positive_int, "must be a positive integer", True),
    "num_topk": (_is_positive_int, "must be a positive integer", True),
    "tokens_per_rank": (_is_positive_int, "must be a positive integer", True),
    "dtype": (lambda v: v in PAYLOAD_DTYPES, f"must be one of {sorted(PAYLOAD_DTYPES)}", True),
    "max_tokens_per_rank": (_is_positive_int, "must be a positive integer", False),
    "routing": (lambda v: isinstance(v, dict), "must be a table ([routing])", False),
}
_ROUTING_RULES: Dict[str, Rule] = {
    "kind": (lambda v: v in ROUTING_KINDS, f"must be one of {list(ROUTING_KINDS)}", False),
    "seed": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0", False),
    "zipf_s": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
               "must be a number > 0", False),
    "hot_expert": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0", False),
}


def _check_table(path: Path, table: Dict[str, Any], rules: Dict[str, Rule], prefix: str) -> None:
    for key in table:
        if key not in rules:
            raise ConfigError(f"{path}: unknown key '{prefix}{key}' (known keys: {', '.join(rules)})")
    for key, (check, rule, required) in rules.items():
        if key not in table:
            if required:
                raise ConfigError(f"{path}: missing required key '{prefix}{key}' ({rule})")
            continue
        if not check(table[key]):
            raise ConfigError(f"{path}: {prefix}{key} = {table[key]!r}: {rule}")


def _check_relations(path: Path, cfg: Config) -> None:
    if cfg.num_topk > cfg.num_experts:
        raise ConfigError(f"{path}: num_topk = {cfg.num_topk}: must not exceed num_experts = {cfg.num_experts}")
    if cfg.max_tokens_per_rank < cfg.tokens_per_rank:
        raise ConfigError(f"{path}: max_tokens_per_rank = {cfg.max_tokens_per_rank}: must not be below "
                          f"tokens_per_rank = {cfg.tokens_per_rank}")
    if cfg.routing.hot_expert >= cfg.num_experts:
        raise ConfigError(f"{path}: routing.hot_expert = {cfg.routing.hot_expert}: "
                          f"must be < num_experts = {cfg.num_experts}")
    if cfg.name != path.stem:
        raise ConfigError(f"{path}: name = {cfg.name!r}: must equal the file name {path.stem!r}")


def resolve_config_path(name_or_path: Union[str, Path]) -> Path:
    """A path (contains a separator or ends in ``.toml``) is taken as is; a bare name is looked up."""
    text = str(name_or_path)
    if text.endswith(".toml") or os.sep in text or "/" in text:
        path = Path(text)
    else:
        path = config_dir() / f"{text}.toml"
        if not path.is_file():
            raise ConfigError(f"config {text!r}: no file {path}; known configs: {', '.join(available_configs())}")
    if not path.is_file():
        raise ConfigError(f"config {text!r}: no such file {path}")
    return path


def load_config(name_or_path: Union[str, Path]) -> Config:
    """Load and validate a config by name (``cpu_demo``) or path (``my/shape.toml``).

    Raises :class:`ConfigError` naming the file, the key, the value and the broken rule.
    """
    path = resolve_config_path(name_or_path)
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    _check_table(path, table, _TOP_RULES, "")
    routing = table.get("routing", {})
    _check_table(path, routing, _ROUTING_RULES, "routing.")
    shape = {k: v for k, v in table.items() if k not in ("routing", "name")}
    shape.setdefault("max_tokens_per_rank", max(DEFAULT_MAX_TOKENS, shape["tokens_per_rank"]))
    cfg = Config(name=table.get("name", path.stem), routing=RoutingDefaults(**routing), path=str(path), **shape)
    _check_relations(path, cfg)
    return cfg
