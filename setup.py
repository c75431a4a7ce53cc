"""Which packages the wheel holds: every package under each mapped root (pyproject.toml has the rest).

The repo keeps ``cli/``, ``probes/``, ``references/`` and ``fixtures/`` at the top level
(design.md) and installs them as ``drifttool.cli``, ``drifttool.probes``, … through
``package_dir``. ``[tool.setuptools.packages.find]`` cannot rename what it finds, so the list is
derived here with ``find_packages`` under each root: a new subpackage (``drifttool/ops/strict/``,
say) is picked up without editing a hand-written list. Folders that hold only data
(``drifttool/diff/profiles/``) are namespace packages of their own, so the build names them
instead of warning that they would be ignored.
"""

from setuptools import find_namespace_packages, find_packages, setup

ROOTS = {
    "drifttool": "drifttool",
    "drifttool.cli": "cli",
    "drifttool.probes": "probes",
    "drifttool.references": "references",
    "drifttool.fixtures": "fixtures",
}

DATA_ONLY = sorted(set(find_namespace_packages("drifttool", exclude=["*__pycache__*"]))
                   - set(find_packages("drifttool")))

setup(
    package_dir=ROOTS,
    packages=[f"{name}{sub}" for name, where in ROOTS.items()
              for sub in ("", *(f".{p}" for p in find_packages(where)))]
    + [f"drifttool.{p}" for p in DATA_ONLY],
)
