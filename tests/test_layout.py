"""The package's shape: no import cycle between its modules, modules of a readable size, nothing that
loads code (pickles, remote code) — checked on the source itself, so a change that breaks one fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "linearize"


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules=()) -> set[str]:
    """Modules of the package that ``path`` imports at module level (imports inside functions run late
    and cannot form an import-time cycle)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("linearize")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("linearize"):  # ``from pkg import sub`` depends on pkg.sub, else on pkg itself
                subs = {f"{mod}.{a.name}" for a in node.names} & set(modules)
                found |= subs if len(subs) == len(node.names) else subs | {mod}
    return found


def test_no_import_cycle():
    files = {_module(p): p for p in PKG.rglob("*.py")}
    # ``from . import sub`` names the submodule; the package itself is already being imported (every
    # submodule import runs its parents' __init__ first), so edges to one's own ancestors are not cycles
    graph = {m: {i for i in _imports(p, m, files) if i in files and i != m and not m.startswith(i + ".")}
             for m, p in files.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_modules_stay_readable():
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if "ops/triton" not in p.as_posix() and (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_nothing_loaded_can_run_code():
    for p in PKG.rglob("*.py"):
        src = p.read_text()
        assert "weights_only=False" not in src, p
        assert "trust_remote_code=True" not in src, p
        for call in re.finditer(r"\.from_pretrained\(", src):
            args = src[call.end(): call.end() + 300]
            depth, end = 1, len(args)
            for i, ch in enumerate(args):
                depth += {"(": 1, ")": -1}.get(ch, 0)
                if depth == 0:
                    end = i
                    break
            line = src[: call.start()].count("\n") + 1
            text = src[: call.start()].rsplit("\n", 1)[-1]
            if text.lstrip().startswith("#") or '"' in text or "`" in text:
                continue  # prose in a docstring or comment
            assert "trust_remote_code=False" in args[:end], f"{p.relative_to(PKG)}:{line} calls from_pretrained without trust_remote_code=False"
