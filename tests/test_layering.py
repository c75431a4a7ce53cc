"""The package layering holds: no import cycle among drifttool's modules; the folders (packages
and top-level modules) stand on floors (``FLOORS``, lowest first, docs/architecture.md) and
import only from their own floor or lower ones, so the folder-level graph is acyclic; the
sampler is below the training side and reaches neither the artifact's writer nor its reader;
and no function-level import of a
drifttool module exists except the few kept lazy for the CLI's start-up cost
(tests/cli/test_import_cost.py), each saying so.

The import graph is read with ``ast`` from the source (``drifttool/``, ``cli/`` as
``drifttool.cli``, ``probes/`` as ``drifttool.probes``, as pyproject's package-dir installs
them); every import counts, at module level or inside a function. The module graph leaves out
those under ``if TYPE_CHECKING:`` (never executed); the folder graph counts them too (a type
named from a higher floor is a dependency on it all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"drifttool": ROOT / "drifttool", "drifttool.cli": ROOT / "cli",
            "drifttool.probes": ROOT / "probes"}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if prefix == "drifttool" and parts[:1] in (["cli"], ["probes"]):
                continue
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _targets(module: str, node: ast.AST) -> list[str]:
    """The drifttool modules an import statement loads (``from a import b``: ``a.b`` when that is
    a module, else ``a``)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = _package_of(module).split(".")
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for n in names:
        while n and n not in MODULES:  # `import drifttool.ops.scheduler` → that module
            n = n.rpartition(".")[0]
        if n:
            out.append(n)
    return out


def _imports(type_checking: bool = False) -> tuple[dict[str, set[str]],
                                                  list[tuple[str, int, str, str]]]:
    """(graph: module → drifttool modules it imports, those under ``if TYPE_CHECKING:`` only if
    ``type_checking``; function-level imports of drifttool modules as (module, line, target,
    source line))."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    local: list[tuple[str, int, str, str]] = []
    for name, path in MODULES.items():
        text = path.read_text()
        tree = ast.parse(text)
        skip = set() if type_checking else _type_checking_lines(tree)
        lines = text.splitlines()
        nested = {id(n) for f in ast.walk(tree)
                  if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
                continue
            for target in _targets(name, node):
                if target == name:
                    continue
                graph[name].add(target)
                if id(node) in nested:
                    local.append((name, node.lineno, target, lines[node.lineno - 1]))
    return graph, local


GRAPH, LOCAL = _imports()
TYPED_GRAPH, _ = _imports(type_checking=True)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        for m in GRAPH[n] - seen:
            seen.add(m)
            todo.append(m)
    return seen


FLOORS = [
    {"__init__", "errors", "components", "shards", "digestcore", "fixture", "fixture_prompts", "environment",
     "collectives", "exit_codes", "jsondata", "host_memory", "launch_env"},
    {"artifact/"},
    {"capture/"},
    {"diff/"},
    {"runtime"},
    {"ops/"},
    {"model/", "text_encoder/", "edit_images"},
    {"distributed/"},
    {"sampling/"},
    {"fixture_settings", "setting_checks", "settings", "fingerprint", "lifecycle"},
    {"runner", "memory"},
    {"launch", "verify", "sealing", "chain", "chain_edit", "adapters/"},
    {"training/"},
    {"probes/", "reports/"},
    {"cli/"},
    {"__main__"},
]
"""The folders of drifttool on their floors, lowest first (docs/architecture.md, "Floors"): a
package (``artifact/``) or top-level module (``runner``) imports only from its own floor or a
lower one. ``__init__`` is ``drifttool/__init__.py`` (the version)."""

FLOOR_OF = {folder: i for i, floor in enumerate(FLOORS) for folder in floor}


def _folder(module: str) -> str:
    """The folder ``module`` belongs to: ``artifact/`` for ``drifttool.artifact.writer``, ``cli/``
    for ``drifttool.cli.run``, ``runner`` for ``drifttool.runner``, ``__init__`` for
    ``drifttool``."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    package = len(parts) > 1 or MODULES[module].name == "__init__.py"
    return parts[0] + "/" if package else parts[0]


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """folder → folder it imports → the module edges behind it (``a -> b``)."""
    out: dict[str, dict[str, list[str]]] = {_folder(m): {} for m in graph}
    for m, targets in graph.items():
        for t in targets:
            if _folder(t) != _folder(m):
                out[_folder(m)].setdefault(_folder(t), []).append(f"{m} -> {t}")
    return out


FOLDERS = _folder_graph(TYPED_GRAPH)


def _upward(folders: dict[str, dict[str, list[str]]]) -> list[str]:
    """Every folder edge that climbs to a higher floor, with the module edges behind it."""
    return [f"{a} (floor {FLOOR_OF[a]}) imports {b} (floor {FLOOR_OF[b]}): {', '.join(sorted(why))}"
            for a, targets in sorted(folders.items()) for b, why in sorted(targets.items())
            if FLOOR_OF[b] > FLOOR_OF[a]]


def test_every_folder_stands_on_one_floor():
    """A new package or top-level module gets its floor in ``FLOORS`` (and the docs' list)."""
    placed = [f for floor in FLOORS for f in floor]
    assert len(placed) == len(set(placed)), "a folder on two floors"
    assert set(FOLDERS) == set(placed), (f"without a floor: {sorted(set(FOLDERS) - set(placed))}; "
                                         f"no such folder: {sorted(set(placed) - set(FOLDERS))}")


def test_folders_import_only_their_floor_or_lower():
    bad = _upward(FOLDERS)
    assert not bad, "imports up the floors:\n" + "\n".join(bad)


def test_the_folder_graph_is_acyclic():
    cycle = _cycle({a: set(targets) for a, targets in FOLDERS.items()})
    assert cycle is None, "folder import cycle: " + " -> ".join(cycle)


def test_floor_check_finds_a_planted_upward_edge():
    planted = {m: set(t) for m, t in TYPED_GRAPH.items()}
    planted["drifttool.artifact.writer"].add("drifttool.runner")
    bad = _upward(_folder_graph(planted))
    assert len(bad) == 1 and bad[0].startswith("artifact/ (floor 1) imports runner")
    assert "drifttool.artifact.writer -> drifttool.runner" in bad[0]


def test_type_only_imports_count_for_the_floors():
    """``TYPED_GRAPH`` sees an import under ``if TYPE_CHECKING:`` that ``GRAPH`` leaves out."""
    assert "drifttool.capture.recorder" in TYPED_GRAPH["drifttool.runtime"]
    assert "drifttool.capture.recorder" not in GRAPH["drifttool.runtime"]


def test_the_graph_covers_the_packages():
    """The scan sees the modules the layering is about (a broken scan would pass vacuously)."""
    for m in ("drifttool.runner", "drifttool.lifecycle", "drifttool.settings",
              "drifttool.sampling.rollout", "drifttool.training.recompute", "drifttool.cli.app",
              "drifttool.probes.runner", "drifttool.artifact.writer"):
        assert m in MODULES
    assert "drifttool.sampling.rollout" in GRAPH["drifttool.runner"]
    assert "drifttool.runner" in GRAPH["drifttool.training.replay"]


def test_no_import_cycle():
    cycle = _cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    planted = {m: set(t) for m, t in GRAPH.items()}
    planted["drifttool.sampling.rollout"].add("drifttool.training.recompute")
    cycle = _cycle(planted)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert "drifttool.sampling.rollout" in cycle


@pytest.mark.parametrize("above", ["drifttool.artifact.writer", "drifttool.artifact.reader",
                                   "drifttool.diff", "drifttool.training",
                                   "drifttool.runner", "drifttool.lifecycle",
                                   "drifttool.settings", "drifttool.setting_checks",
                                   "drifttool.launch", "drifttool.cli", "drifttool.probes"])
def test_sampling_stays_below(above):
    """``sampling`` (rollout loop, noise, inputs) imports none of the layers above it, directly
    or through another module, nor the artifact's writer or reader (its records go to the
    runtime's recorder; the capture levels it reaches through the runtime are the artifact's)."""
    for m in (m for m in MODULES if m.startswith("drifttool.sampling")):
        reach = _closure(m)
        bad = sorted(r for r in reach if r == above or r.startswith(above + "."))
        assert not bad, f"{m} imports {bad}"


def test_training_is_above_sampling():
    assert not any(m.startswith("drifttool.training") for m in MODULES
                   if m.startswith("drifttool.sampling") for m in _closure(m))
    assert "drifttool.sampling.rollout" in _closure("drifttool.training.recompute")


def test_function_level_imports_are_only_the_declared_lazy_ones():
    """A function-level import of a drifttool module must say why it is lazy (``# lazy: ...``,
    the CLI's start-up cost); none may hide a cycle (test_no_import_cycle counts them too)."""
    undeclared = [f"{m}:{line}: {src.strip()}" for m, line, _, src in LOCAL if "# lazy:" not in src]
    assert not undeclared, "function-level imports without a '# lazy:' reason:\n" + "\n".join(undeclared)


def test_sampler_block_agrees_with_the_schema():
    """The sampler's constants and the torch-free schemas' copies are one value."""
    from drifttool.artifact import manifest_schema, schema
    from drifttool.sampling.config import CFG_LAYOUTS, SAMPLER_BLOCK
    from drifttool.setting_checks import DTYPES

    assert SAMPLER_BLOCK == schema.SAMPLER_BLOCK
    assert CFG_LAYOUTS == manifest_schema.CFG_LAYOUTS
    assert tuple(DTYPES) == manifest_schema.MODEL_DTYPES
