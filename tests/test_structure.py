"""The import structure of ``kspeed/``, read from the source: no circle, no import between the
daemons, and nothing of production importing the test support package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kspeed

ROOT = Path(kspeed.__file__).resolve().parent
GENERATED = {"kspeed.proto.kspeed_pb2_grpc"}  # grpc_tools' output imports its sibling by its own rule

#: Each daemon's and the client library's package, and what it must never import.
APART = {
    "kspeed.server": ("kspeed.manager", "kspeed.client", "kspeed.cli"),
    "kspeed.manager": ("kspeed.server", "kspeed.client", "kspeed.cli"),
    "kspeed.client": ("kspeed.server", "kspeed.manager", "kspeed.cli"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The kspeed modules ``name`` imports anywhere in its file (under ``TYPE_CHECKING`` and inside
    functions too: a circle through a type is still a circle a reader has to hold)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import name``: the module pkg.name where there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import pkg.mod.attr`` names pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("kspeed"):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items() if name not in GENERATED}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_kspeed_has_no_import_circle():
    assert circles(_graph()) == []


def test_daemons_and_the_client_never_import_each_other():
    crossings = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for home, banned in APART.items()
        if name == home or name.startswith(home + ".")
        for target in targets
        if any(target == b or target.startswith(b + ".") for b in banned)
    ]
    assert crossings == []


def test_production_code_never_imports_the_test_support_package():
    users = [
        name
        for name, targets in _graph().items()
        if not name.startswith("kspeed.testing")
        and any(t == "kspeed.testing" or t.startswith("kspeed.testing.") for t in targets)
    ]
    assert users == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_circle_finder_finds_circles(graph, expected):
    assert sorted(circles(graph)) == expected


def test_imports_are_read_from_every_form(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import kspeed.errors\n"
        "from kspeed.rdma import base\n"
        "from .sibling import thing\n"
        "if TYPE_CHECKING:\n"
        "    from kspeed.client.dataset import KSpeedDataset\n"
        "def later():\n"
        "    from kspeed import grants\n"
    )
    known = {"kspeed", "kspeed.errors", "kspeed.grants", "kspeed.rdma", "kspeed.rdma.base", "kspeed.client.dataset"}
    known |= {"kspeed.pkg", "kspeed.pkg.sibling"}
    assert imports_of("kspeed.pkg.mod", source, known) == {
        "kspeed.errors",
        "kspeed.rdma.base",  # a module named in a from-import, not its package
        "kspeed.pkg.sibling",  # relative to the importer's package
        "kspeed.client.dataset",  # under TYPE_CHECKING too
        "kspeed.grants",  # inside a function too
    }


def test_the_exception_tree_drawn_in_errors_names_every_error_and_its_parent():
    import inspect

    from kspeed import errors

    drawn = {}
    parents: list[str] = []
    lines = [line for line in (errors.__doc__ or "").splitlines() if "── " in line]
    top = lines[0].index("── ")  # KSpeedError's children; each "│   " further in is a level deeper
    for line in lines:
        depth = (line.index("── ") - top) // 4
        name = line.split("── ", 1)[1].split()[0]
        del parents[depth:]
        drawn[name] = parents[-1] if parents else "KSpeedError"
        parents.append(name)
    classes = {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.KSpeedError) and cls is not errors.KSpeedError
    }
    assert set(drawn) == set(classes)
    assert {name: cls.__mro__[1].__name__ for name, cls in classes.items()} == drawn
