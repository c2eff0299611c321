"""Reduction operations shared by every engine."""

from __future__ import annotations

from enum import Enum
from typing import Any

from popmesh.core.errors import ConfigError

__all__ = ["ReduceOp"]


class ReduceOp(str, Enum):
    """Element-wise reductions. AVG divides by the size of the group reduced over."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @classmethod
    def parse(cls, op: Any) -> "ReduceOp":
        """Accept a ReduceOp, a name such as ``"sum"``/``"MEAN"``, or a foreign enum with such a name
        (e.g. ``torch.distributed.ReduceOp.SUM``)."""
        if isinstance(op, ReduceOp):
            return op
        name = op if isinstance(op, str) else getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        key = str(name).strip().lower()
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown reduce op {op!r}: use one of {choices}") from None


_ALIASES = {"mean": "avg", "average": "avg", "product": "prod", "add": "sum"}
