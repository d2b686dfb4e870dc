"""No code path unpickles without weights_only=True or enables remote code (static check)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("pocketdiff", "train", "compress", "evaluate", "export", "benchmarks") for p in (ROOT / d).rglob("*.py")]


def calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
            yield node, owner, name


def test_sources_found():
    assert len(SOURCES) > 30


def test_torch_load_always_weights_only_and_no_pickle_or_remote_code():
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node, owner, name in calls(tree):
            kw = {k.arg: k.value for k in node.keywords}
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if owner == "torch" and name == "load":
                v = kw.get("weights_only")
                if not (isinstance(v, ast.Constant) and v.value is True):
                    bad.append(f"{where}: torch.load without weights_only=True")
            if owner in ("pickle", "dill", "cloudpickle") and name in ("load", "loads"):
                bad.append(f"{where}: {owner}.{name}")
            v = kw.get("trust_remote_code")
            if v is not None and not (isinstance(v, ast.Constant) and v.value is False):
                bad.append(f"{where}: trust_remote_code")
            if name == "from_pretrained" and isinstance(kw.get("use_safetensors"), ast.Constant) and kw["use_safetensors"].value is False:
                bad.append(f"{where}: from_pretrained(use_safetensors=False)")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_bad_call():
    tree = ast.parse("import torch\ntorch.load('x.pt')\n")
    found = [(o, n) for _, o, n in calls(tree)]
    assert ("torch", "load") in found
