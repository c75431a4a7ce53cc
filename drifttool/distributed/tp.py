"""Tensor parallelism (TP): attention heads and MLP channels sharded over the ``tp`` dimension.

Placeholder table (filled by the TP rules): no operator is sharded yet.
"""

from __future__ import annotations

RULES: dict = {}


def check(config, dims) -> None:
    """Refuse a model this degree does not divide (UnsupportedConfigError)."""


def gather_output(plan, rt, op, stream, index, tensor):
    return None
