"""The fixed shape of a Buffer: ranks, experts, hidden size, top-k, token capacity and payload dtype."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Optional, Tuple

import numpy as np

from ep_comm.contract import layout as lay


@dataclass(frozen=True)
class Geometry:
    """The fixed shape of a Buffer."""

    num_ranks: int
    num_experts: int
    hidden: int
    num_topk: int
    max_tokens: int
    dtype: np.dtype

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.num_ranks

    def differences(self, other: "Geometry") -> List[str]:
        """``"name=mine (this Buffer: other's)"`` for every field in which ``other``, the geometry of the Buffer
        asked to use something made with this one, differs; fields by their constructor names."""
        names = {"num_ranks": "ranks", "max_tokens": "num_max_tokens_per_rank"}
        return [f"{names.get(f.name, f.name)}={_shown(getattr(self, f.name))} "
                f"(this Buffer: {_shown(getattr(other, f.name))})"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def output_rows(self, exact: Optional[Tuple[int, int]], expand: bool, alignment: int) -> Tuple[int, int]:
        """``(rows of recv_src_metadata, rows of recv_x)``: ``ep_comm.contract.layout.output_rows`` for this geometry."""
        return lay.output_rows(exact, expand, alignment, self.num_ranks, self.max_tokens, self.num_topk,
                               self.experts_per_rank)


def _shown(value: Any) -> Any:
    """A geometry value as a message shows it: a dtype by its name."""
    return value.name if isinstance(value, np.dtype) else value
