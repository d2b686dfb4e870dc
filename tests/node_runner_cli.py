"""The Node runner (web/node_runner.mjs) as the web tests call it: on Dawn, lavapipe here and the real GPU elsewhere;
and a bundle's manifest changed for one run (imported by tests/web/*, as tests/ is on sys.path)."""
from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[1] / "web" / "node_runner.mjs"


def dawn_or_skip(node: str) -> str:
    """`node`, once npm webgpu (Dawn's Node bindings) is in web/node_modules; else the test is skipped."""
    if not (RUNNER.parent / "node_modules" / "webgpu" / "package.json").is_file():
        pytest.skip("npm webgpu is not in web/node_modules (bash scripts/setup.sh installs it)")
    return node


def run_node_runner(node: str, *args: str, timeout: float = 900, skip_without_adapter: bool = False) -> subprocess.CompletedProcess:
    """node web/node_runner.mjs ARGS with the delegate's Vulkan environment (`skip_without_adapter`: the test is
    skipped where Dawn finds no Vulkan device, else that is the runner's exit 2)."""
    from pocketdiff.runtime.delegate import delegate_env

    env, _ = delegate_env()
    p = subprocess.run([node, str(RUNNER), *args], capture_output=True, text=True, env=env, timeout=timeout)
    if skip_without_adapter and p.returncode == 2 and "no WebGPU adapter" in p.stderr:
        pytest.skip("Dawn found no Vulkan device here (scripts/setup_vulkan.sh unpacks lavapipe)")
    return p


@contextlib.contextmanager
def edited_manifest(bundle: Path, edit):
    """`bundle`'s manifest.json changed by `edit(manifest)` inside the block, restored after."""
    path = bundle / "manifest.json"
    original = path.read_text()
    man = json.loads(original)
    edit(man)
    path.write_text(json.dumps(man))
    try:
        yield man
    finally:
        path.write_text(original)
