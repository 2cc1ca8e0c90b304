"""The lab's rooms: no Python file over MAX_LINES lines, and no import circle among the lab's own
modules (imports inside functions and relative imports included), read with `ast`, without
importing anything."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800
PACKAGES = ("kernels", "gpt2", "lm", "llama", "benchmarks", "tools")  # the lab's own code, where present
SCRIPTS = ("lab.py", "bench.py")


def lab_modules(root: Path) -> dict[str, Path]:
    """Module name -> file for every lab module under root (a package's __init__.py is the package)."""
    files = [root / s for s in SCRIPTS if (root / s).is_file()]
    for package in PACKAGES:
        if (root / package).is_dir():
            files += sorted((root / package).rglob("*.py"))
    modules = {}
    for path in files:
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lab modules that module `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(target: str) -> str | None:  # the module itself, else its nearest package that is a lab module
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # `from pkg import module` imports the module itself
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else known(source))
    found.discard(None)
    found.discard(name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = lab_modules(root)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_the_imports_it_must():
    """The graph is not empty by mistake: a relative import, a package's submodule and a function-level
    import (gpt2/generate.py imports the fast path inside generate()) are all edges."""
    graph = import_graph(ROOT)
    assert "gpt2.config" in graph["gpt2.generate"]  # from .config import GPT2Config
    assert "gpt2.fast" in graph["gpt2.generate"]  # from . import fast, inside a function
    assert "kernels.driver" in graph["gpt2.fast.plan"]  # from kernels import driver
    assert "gpt2.fast.engine" in graph["gpt2.fast"]  # from .engine import Engine
    assert "lm.engine" in graph["gpt2.fast.engine"]  # from lm.engine import FastEngine, Launch, prefetch_targets


def test_a_circle_is_found_and_named(tmp_path):
    """Two modules of a package that import each other, one of them inside a function and relatively."""
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "__init__.py").write_text("")
    (tmp_path / "gpt2" / "alpha.py").write_text("import gpt2.beta\n")
    (tmp_path / "gpt2" / "beta.py").write_text("def f():\n    from . import alpha\n    return alpha\n")
    (tmp_path / "lab.py").write_text("from gpt2.alpha import x\n")
    graph = import_graph(tmp_path)
    assert graph["lab"] == {"gpt2.alpha"} and graph["gpt2.beta"] == {"gpt2.alpha"}
    assert find_cycle(graph) == ["gpt2.alpha", "gpt2.beta", "gpt2.alpha"]
    (tmp_path / "gpt2" / "beta.py").write_text("from .gamma import y\n")  # the circle broken
    assert find_cycle(import_graph(tmp_path)) is None


def test_no_python_file_over_max_lines():
    too_long = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(part.startswith(".") for part in path.relative_to(ROOT).parts):
            continue  # .git, .venv, .cache
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            too_long.append(f"{rel} ({lines} lines)")
    assert not too_long, f"over {MAX_LINES} lines: " + ", ".join(too_long)
