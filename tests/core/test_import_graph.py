"""The dependency rules of the package, checked on its import graph (every `import` statement,
lazy ones inside functions included, read with `ast`; nothing is imported).

- the core (`pocketdiff/`) imports no stage and no orchestration (cli, demo);
- a stage imports the core, itself, and another stage only through that stage's declared
  interfaces (`INTERFACES`); never the orchestration;
- the stages' dependency graph has no cycle, and neither has the modules' (no two modules
  import each other, directly or through others; lazy and TYPE_CHECKING imports count);
- code imports through the `pocketdiff.` namespace only, never a bare `train` / `export`;
- every package folder is listed in pyproject's `packages` (a regular install has it);
- the runtime (`pocketdiff.runtime`, what runs a bundle) imports the core and itself only, and
  outside pocketdiff only the standard library and the runtime's own dependencies (numpy,
  ai-edge-litert, tokenizers, PIL): never the converter side, torch or diffusers.

Stages and their folders come from pyproject's `package-dir`, so a new stage is checked
as soon as it is mapped.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

# Orchestration: knows every stage, known by none. `pocketdiff.demo` is the demo chain: issue 20
# moves it out of the core folder (pocketdiff/demo.py -> a top-level demo/ mapped to
# pocketdiff.demo); in either place it orchestrates, so it is allowed to import every stage.
ORCHESTRATION = ("pocketdiff.cli", "pocketdiff.__main__", "pocketdiff.demo")

# Stage areas, most specific first: compress holds two unrelated stages.
SUBSTAGES = ("pocketdiff.compress.quant", "pocketdiff.compress.prune")

# importer area -> {module of another stage it may import: why}. A module name allows that
# module only (not its siblings); the crossings docs/CONTRIBUTING.md declares.
INTERFACES: dict[str, dict[str, str]] = {
    "pocketdiff.export": {
        "pocketdiff.compress.quant.int8_format": "export carries compress's int8 checkpoint format bit-exact",
        "pocketdiff.runtime.bundle": "export checks the bundle it wrote with the runner's own manifest reader",
        "pocketdiff.runtime.manifest_check": "export writes the manifest the contract defines (the tiled decoder's names)",
        "pocketdiff.runtime.tflite_file": "the converter's weight storage extends the runtime's .tflite reader",
        "pocketdiff.runtime.parity": "export's parity gate uses the metrics a bundle's golden tolerances mean",
        "pocketdiff.runtime.delegate": "export judges each graph on the GPU delegate the runtime runs it on",
        "pocketdiff.runtime.tiled_decode": "the tiled decoder is exported for the runtime's numpy tile driver",
        "pocketdiff.runtime.onepass_decode": "the one-pass tiled decoder is exported for the runtime's numpy one-pass driver (scheme name, tile area)",
        "pocketdiff.runtime.run_bundle": "export's tokenizer golden and tiled parity come from the reference runner",
        "pocketdiff.runtime.verify_bundle": "export runs verify-bundle's no-run checks on the bundle it wrote",
        "pocketdiff.runtime.memory": "export measures each component's peak RSS as the runner measures its own",
        "pocketdiff.runtime.chunks": "a chunked UNet or text encoder is exported under the names and order the runner passes tensors by",
        "pocketdiff.runtime.components": "export converts the components the registry lists (names, inputs, splits, int8 prefixes)",
        "pocketdiff.runtime.pipeline_spec": "export writes the manifest's pipeline block (stages, roles) the runners read",
    },
    "pocketdiff.compress.prune": {
        "pocketdiff.train.loop": "recovery distillation reuses train's loop",
        "pocketdiff.train.losses": "recovery and Taylor importance use train's diffusion target",
        "pocketdiff.evaluate": "prune measures FD / CLIP through evaluate's public API",
        "pocketdiff.runtime.memory": "prune's report gives the host peak RSS read as the runner reads its own",
    },
    "pocketdiff.compress.quant": {
        "pocketdiff.runtime.memory": "calibrate checks its host cap and reports its host peak with the runner's RSS readers",
        "pocketdiff.runtime.components": "calibrate quantizes components by the registry's names",
    },
    "pocketdiff.train": {
        "pocketdiff.evaluate": "distill evaluates its rounds through evaluate's public API",
        "pocketdiff.runtime.memory": "the loop's report gives the host peak RSS read as the runner reads its own",
    },
    "pocketdiff.evaluate": {
        "pocketdiff.runtime.bundle_images": "evaluate's kind: bundle runs exported bundles",
    },
    "pocketdiff.web": {
        "pocketdiff.runtime.bundle": "the page reads the bundle's manifest with the runtime's reader",
        "pocketdiff.runtime.run_bundle": "the page's reference image is run-bundle's, from the same latents",
        "pocketdiff.runtime.cli_checks": "`web` checks its prompt and timeout flags, `serve` its --reports folder, as the bundle runners do",
        "pocketdiff.runtime.image_tasks": "the page's picture reference is run-bundle's image-to-image run (same flags, same picture reading)",
        "pocketdiff.runtime.lora_slots": "the page's LoRA reference is run-bundle's swapped-LoRA run (same flags and file checks)",
    },
}

# The runtime runs a bundle on a phone-lab box or an app's backend: what it may import from
# outside pocketdiff, besides the standard library (torch, diffusers and the converter never).
RUNTIME = "pocketdiff.runtime"
RUNTIME_THIRD_PARTY = ("numpy", "ai_edge_litert", "flatbuffers", "tokenizers", "PIL")


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """pyproject's package-dir: package name -> folder."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    return {pkg: root / folder for pkg, folder in mapping.items()}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the mapped folders."""
    dirs = package_dirs(root)
    modules: dict[str, Path] = {}
    # deepest mapping first, so pocketdiff.train's files are not also read as pocketdiff.<...>
    for pkg, folder in sorted(dirs.items(), key=lambda kv: -kv[0].count(".")):
        for path in folder.rglob("*.py"):
            if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(folder).parts):
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            modules.setdefault(name, path)
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, relative ones resolved;
    `from pkg import a, b` counts as pkg.a / pkg.b where those are modules, else as pkg."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
            found += [(sub, node.lineno) for sub in submodules]
            if len(submodules) < len(node.names):  # names defined in target itself
                found.append((target, node.lineno))
    return found


def area(module: str, stages: list[str]) -> str:
    """'orchestration', 'core', a stage package name, or '' (outside pocketdiff)."""
    if not (module == "pocketdiff" or module.startswith("pocketdiff.")):
        return ""
    if any(module == o or module.startswith(o + ".") for o in ORCHESTRATION):
        return "orchestration"
    for stage in stages:
        if module == stage or module.startswith(stage + "."):
            return stage
    return "core"


def stages_of(root: Path = ROOT) -> list[str]:
    names = [pkg for pkg in package_dirs(root) if pkg != "pocketdiff" and pkg not in ORCHESTRATION]
    return sorted([*names, *SUBSTAGES], key=lambda s: -s.count("."))


def violations(root: Path = ROOT) -> tuple[list[str], dict[str, set[str]]]:
    """(broken rules, one line each; the stage graph: area -> areas it imports)."""
    stages = stages_of(root)
    modules = module_files(root)
    bare = {folder.name for pkg, folder in package_dirs(root).items() if pkg != "pocketdiff"}
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, path in sorted(modules.items()):
        src = area(name, stages)
        where = path.relative_to(root).as_posix()
        for target, line in imports_of(name, path, modules):
            top = target.split(".")[0]
            if top in bare:
                problems.append(f"{where}:{line}: imports bare '{target}'; import through pocketdiff.{top}")
                continue
            dst = area(target, stages)
            if not dst or dst == src or dst == "core" or src == "orchestration":
                continue  # outside pocketdiff, within one area, the shared core, or the CLI / demo
            if dst == "orchestration":
                problems.append(f"{where}:{line}: {src} imports {target}, the orchestration (cli / demo knows every stage, none knows it)")
            elif src == "core":
                problems.append(f"{where}:{line}: the core imports {target} (stage {dst}); the core knows no stage")
            elif target in INTERFACES.get(src, {}):  # a declared module; not its package's other modules
                graph.setdefault(src, set()).add(dst)
            else:
                problems.append(f"{where}:{line}: stage {src} imports {target} of stage {dst}, which is not a declared "
                                f"interface (declare it in INTERFACES with its reason, or meet through files)")
    return problems, graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle in the graph as a list of nodes (first == last), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if not state.get(nxt):
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if not state.get(node):
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import statement, lazy ones and those under
    TYPE_CHECKING included: a cycle hidden behind either is still two modules that need each other)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target, _line in imports_of(name, path, modules):
            if target in modules and target != name:
                graph.setdefault(name, set()).add(target)
    return graph


def test_no_two_modules_import_each_other():
    cycle = find_cycle(module_graph())
    assert not cycle, "module import cycle: " + " -> ".join(cycle)


def test_the_package_keeps_its_dependency_rules():
    problems, graph = violations()
    assert not problems, "\n".join(problems)
    cycle = find_cycle(graph)
    assert not cycle, " -> ".join(cycle)


def _top_level_imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """The imports a module runs when it is imported (not those inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    lines = {n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
    return [(t, line) for t, line in imports_of(name, path, modules) if line in lines]


def runtime_import_problems(root: Path = ROOT) -> list[str]:
    """What the runtime would pull in beyond the core, the standard library and its own
    dependencies: every import of its modules (lazy ones included), and the import-time imports
    of the core modules it reaches, transitively (a core module's lazy torch import stays lazy)."""
    modules = module_files(root)
    stages = stages_of(root)
    allowed = set(sys.stdlib_module_names) | set(RUNTIME_THIRD_PARTY) | {"pocketdiff"}
    problems: list[str] = []
    todo = [(n, True) for n in modules if n == RUNTIME or n.startswith(RUNTIME + ".")]
    seen: set[str] = set()
    while todo:
        name, every = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        path = modules[name]
        where = path.relative_to(root).as_posix()
        found = imports_of(name, path, modules) if every else _top_level_imports(path, name, modules)
        for target, line in found:
            top = target.split(".")[0]
            dst = area(target, stages)
            if top not in allowed:
                problems.append(f"{where}:{line}: the runtime imports {target} (outside pocketdiff it may import the "
                                f"standard library and {', '.join(RUNTIME_THIRD_PARTY)} only)")
            elif top == "pocketdiff" and dst not in ("core", RUNTIME):
                problems.append(f"{where}:{line}: the runtime imports {target} ({dst or 'pocketdiff'}); it knows the core only")
            elif top == "pocketdiff":
                todo.append((target, dst == RUNTIME))
    return problems


def test_the_runtime_imports_no_converter_and_no_torch():
    problems = runtime_import_problems()
    assert not problems, "\n".join(problems)


def test_the_runtime_check_catches_converter_and_torch_imports(tmp_path):
    """A runtime importing the converter, torch (directly or through a core module at import
    time) and diffusers lazily: each is reported; a core module's lazy torch import is not."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pocketdiff"]\n'
        '[tool.setuptools.package-dir]\n"pocketdiff" = "pocketdiff"\n"pocketdiff.export" = "export"\n'
        '"pocketdiff.runtime" = "runtime"\n')
    _write(tmp_path, "pocketdiff/__init__.py")
    _write(tmp_path, "pocketdiff/errors.py", "import json\ndef f():\n    import torch\n")  # lazy: fine
    _write(tmp_path, "pocketdiff/models.py", "import torch\n")
    _write(tmp_path, "export/__init__.py")
    _write(tmp_path, "export/convert.py", "import torch\n")
    _write(tmp_path, "runtime/__init__.py")
    _write(tmp_path, "runtime/run.py", "import numpy\nfrom pocketdiff.errors import f\nfrom pocketdiff.export import convert\n"
                                         "def g():\n    import diffusers\n")
    _write(tmp_path, "runtime/load.py", "from . import run\nfrom pocketdiff import models\n")
    text = "\n".join(runtime_import_problems(tmp_path))
    assert "runtime/run.py:3: the runtime imports pocketdiff.export.convert (pocketdiff.export)" in text
    assert "runtime/run.py:5: the runtime imports diffusers" in text
    assert "pocketdiff/models.py:1: the runtime imports torch" in text
    assert len(text.splitlines()) == 3, text


def test_declared_interfaces_exist():
    modules = module_files()
    missing = [f"{src} -> {target}" for src, allowed in INTERFACES.items() for target in allowed if target not in modules]
    assert not missing, f"INTERFACES names modules that do not exist: {missing}"


def test_every_package_folder_is_installed():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    packages = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert packages <= listed, f"package folders missing from pyproject's packages list: {sorted(packages - listed)}"


def _write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_catches_each_broken_rule(tmp_path):
    """A small tree breaking every rule once: each is reported (the check can fail)."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pocketdiff"]\n'
        '[tool.setuptools.package-dir]\n"pocketdiff" = "pocketdiff"\n"pocketdiff.train" = "train"\n'
        '"pocketdiff.export" = "export"\n"pocketdiff.evaluate" = "evaluate"\n"pocketdiff.runtime" = "runtime"\n')
    _write(tmp_path, "pocketdiff/__init__.py")
    _write(tmp_path, "pocketdiff/cli.py", "import pocketdiff.train.loop\n")  # fine: orchestration
    _write(tmp_path, "pocketdiff/models.py", "def f():\n    from pocketdiff.train import loop\n")  # core -> stage
    _write(tmp_path, "train/__init__.py")
    _write(tmp_path, "train/loop.py", "from pocketdiff.models import f\nfrom pocketdiff.cli import main\n")  # stage -> cli
    _write(tmp_path, "export/__init__.py")
    _write(tmp_path, "runtime/__init__.py")
    _write(tmp_path, "runtime/bundle_images.py", "from pocketdiff.models import f\n")
    _write(tmp_path, "export/run.py", "import train.loop\n")  # bare import
    _write(tmp_path, "evaluate/__init__.py")
    _write(tmp_path, "evaluate/generation.py",
           "from pocketdiff.runtime.bundle_images import g\n"  # declared: fine
           "from pocketdiff.export.run import main\n")  # undeclared crossing
    problems, graph = violations(tmp_path)
    text = "\n".join(problems)
    assert "pocketdiff/models.py:2: the core imports pocketdiff.train" in text
    assert "train/loop.py:2: pocketdiff.train imports pocketdiff.cli" in text
    assert "export/run.py:1: imports bare 'train.loop'" in text
    assert "evaluate/generation.py:2: stage pocketdiff.evaluate imports pocketdiff.export.run" in text
    assert len(problems) == 4, text
    assert graph == {"pocketdiff.evaluate": {"pocketdiff.runtime"}}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) == []


def test_the_module_cycle_check_sees_lazy_and_type_checking_imports(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["pocketdiff"]\n[tool.setuptools.package-dir]\n"pocketdiff" = "pocketdiff"\n')
    _write(tmp_path, "pocketdiff/__init__.py")
    _write(tmp_path, "pocketdiff/config.py", "def check():\n    from .pruning import precheck\n")
    _write(tmp_path, "pocketdiff/pruning.py", "from .config import Config\n")
    _write(tmp_path, "pocketdiff/rounds.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import Config\n")
    _write(tmp_path, "pocketdiff/plan.py", "from pocketdiff.rounds import plan_rounds\n")
    graph = module_graph(tmp_path)
    assert find_cycle(graph) == ["pocketdiff.config", "pocketdiff.pruning", "pocketdiff.config"]
    del graph["pocketdiff.config"]
    assert find_cycle(graph) == ["pocketdiff.plan", "pocketdiff.rounds", "pocketdiff.plan"]
