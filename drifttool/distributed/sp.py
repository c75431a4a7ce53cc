"""Sequence parallelism (SP): image rows and their RoPE positions sharded over the ``sp`` dimension.

Placeholder table (filled by the SP rules): no operator is sharded yet.
"""

from __future__ import annotations

RULES: dict = {}


def check(config, dims) -> None:
    """Refuse a model this degree does not divide (UnsupportedConfigError)."""


def gather_output(plan, rt, op, stream, index, tensor):
    return None
