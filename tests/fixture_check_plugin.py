"""A pytest plugin for a collection-only run: refuse test items that ask for a fixture nothing
defines. Such an item fails only at setup, and tests that skip without a GPU never reach setup
on CPU CI (``tests/test_gpu_tests_resolve.py`` runs it over ``tests/gpu``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(session, config, items) -> None:
    missing = []
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        missing += [f"{item.nodeid}: {name}" for name in info.argnames
                    if name not in info.name2fixturedefs and name not in params]
    if missing:
        raise pytest.UsageError("fixtures that nothing defines:\n" + "\n".join(missing))
