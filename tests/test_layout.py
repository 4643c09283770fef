"""The package's shape, read from its source: imports point down the layers and never in a
circle, only jaxkv.ops names a backend, modules stay short, and measurements live in docs/."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxkv"
# Each subpackage's floor: a module imports only from lower floors and from its own subpackage
# (jaxkv itself, the top, re-exports everything). Subpackages on one floor do not import each
# other.
FLOORS = {"ops": 0, "core": 1, "models": 2, "formats": 3, "decoding": 3, "training": 3,
          "front": 4, "": 5}
BACKENDS = ("jaxkv.ops.xla", "jaxkv.ops.cpu")
MAX_LINES = 450
TIMING = re.compile(r"[0-9.]+ ?(ms|us|µs|GB/s|tokens/s|ms/token)\b|[0-9.]+x (faster|slower)|"
                    r"-> [0-9.]+ ?(ms|s|GB/s)\b")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set:
    """The jaxkv modules a module imports, at its top or inside its functions."""
    found = set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "jaxkv"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.split(".")[0] != "jaxkv":
                continue
            for alias in node.names:  # `from jaxkv.core import cache`: the module, if it is one
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return found - {name}


GRAPH = {name: imports(name) for name in MODULES}


def floor(name: str):
    parts = name.split(".")
    return (parts[1] if len(parts) > 1 and parts[1] in FLOORS else ""), FLOORS.get(
        parts[1] if len(parts) > 1 else "", 5)


def test_the_modules_are_found():
    assert {"jaxkv.ops", "jaxkv.core.decoder", "jaxkv.decoding.generate", "jaxkv.front.cli"} <= \
        set(MODULES)


def test_no_import_circle():
    state = {}

    def visit(name, path):
        if state.get(name) == "open":
            raise AssertionError("import circle: " + " -> ".join(path[path.index(name):] +
                                                                 [name]))
        if state.get(name) == "done":
            return
        state[name] = "open"
        for other in sorted(GRAPH[name]):
            visit(other, path + [name])
        state[name] = "done"

    for name in sorted(GRAPH):
        visit(name, [])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    """A module imports its own subpackage and lower floors only (jaxkv's own __init__ and
    __main__, the top, may import anything), and the top package itself, which imports no
    module of jaxkv when it loads (its names are imported when first used)."""
    mine, level = floor(name)
    for other in GRAPH[name] - {"jaxkv"}:
        theirs, other_level = floor(other)
        assert theirs == mine or other_level < level, (
            f"{name} (floor {level}) imports {other} (floor {other_level})")


def test_the_top_package_imports_nothing_of_jaxkv_when_it_loads():
    assert GRAPH["jaxkv"] == set()


def test_only_ops_names_a_backend():
    for name, imported in GRAPH.items():
        if not name.startswith("jaxkv.ops"):
            assert not [m for m in imported if m.startswith(BACKENDS)], name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_short(name):
    assert len(MODULES[name].read_text().splitlines()) <= MAX_LINES


def test_measurements_live_in_docs():
    """Figures and variants tried belong in docs/ (design-notes.md, kernels.md, performance*):
    the package's comments say what and why. At most 5 lines may quote a timing."""
    quoting = [f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
               for path in sorted(PACKAGE.rglob("*")) if path.suffix in (".py", ".cc", ".h")
               for i, line in enumerate(path.read_text().splitlines(), 1)
               if TIMING.search(line)]
    assert len(quoting) <= 5, "\n".join(quoting)
