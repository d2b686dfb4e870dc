"""No function in the package folders runs over MAX_LINES lines (def to last line, docstring and
comments included): a longer one is split into named steps. Read with `ast`; nothing is imported.
The folders come from pyproject's `package-dir`, so a new stage is checked as soon as it is mapped."""
from __future__ import annotations

import ast
from pathlib import Path

from test_import_graph import ROOT, package_dirs

MAX_LINES = 100

# "file::qualified name" -> why it may still be longer, for now. The file is matched as the end of
# the path (any folder), so an entry survives a module moving between packages. An entry that no
# longer names a long function fails the test: remove it once the function is split.
ALLOWED: dict[str, str] = {}


def _allowed(key: str, entry: str) -> bool:
    return key == entry or key.endswith("/" + entry)


def long_functions(root: Path = ROOT, limit: int = MAX_LINES) -> dict[str, tuple[str, int]]:
    """'path::qualified name' -> (path:line, length) for every function over `limit` lines."""
    found: dict[str, tuple[str, int]] = {}
    for folder in sorted(set(package_dirs(root).values())):
        for path in sorted(folder.rglob("*.py")):
            if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(folder).parts):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            stack: list[tuple[ast.AST, str]] = [(node, "") for node in tree.body]
            while stack:
                node, prefix = stack.pop()
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qualname = prefix + node.name
                    length = node.end_lineno - node.lineno + 1
                    if not isinstance(node, ast.ClassDef) and length > limit:
                        rel = path.relative_to(root).as_posix()
                        found[f"{rel}::{qualname}"] = (f"{rel}:{node.lineno}", length)
                    stack += [(child, qualname + ".") for child in node.body]
    return found


def test_no_function_is_over_the_limit():
    long = long_functions()
    over = [f"{where}: {key.split('::')[1]} has {n} lines (max {MAX_LINES}); split it into named steps"
            for key, (where, n) in sorted(long.items()) if not any(_allowed(key, entry) for entry in ALLOWED)]
    assert not over, "\n".join(over)
    stale = sorted(entry for entry in ALLOWED if not any(_allowed(key, entry) for key in long))
    assert not stale, f"ALLOWED names functions that are no longer over {MAX_LINES} lines (remove them): {stale}"


def test_the_length_check_sees_methods_and_nested_functions(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"pocketdiff" = "pocketdiff"\n')
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    code = (f"def short():\n{body}"
            f"class Runner:\n    def run(self):\n{body.replace('    ', '        ')}"
            f"        def inner():\n{body.replace('    ', '            ')}\n")
    (tmp_path / "pocketdiff").mkdir()
    (tmp_path / "pocketdiff" / "mod.py").write_text(code)
    found = long_functions(tmp_path, limit=6)
    assert found == {"pocketdiff/mod.py::Runner.run": ("pocketdiff/mod.py:8", 12)}
    assert _allowed("pocketdiff/mod.py::Runner.run", "mod.py::Runner.run")
    assert not _allowed("pocketdiff/mod.py::Runner.run", "od.py::Runner.run")
    assert sorted(long_functions(tmp_path, limit=5)) == [
        "pocketdiff/mod.py::Runner.run", "pocketdiff/mod.py::Runner.run.inner", "pocketdiff/mod.py::short"]
