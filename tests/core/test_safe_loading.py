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


def violations(tree, where: str) -> list[str]:
    bad = []
    for node, owner, name in calls(tree):
        kw = {k.arg: k.value for k in node.keywords}
        at = f"{where}:{node.lineno}"
        if owner == "torch" and name == "load":
            v = kw.get("weights_only")
            if not (isinstance(v, ast.Constant) and v.value is True):
                bad.append(f"{at}: torch.load without weights_only=True")
        if owner in ("pickle", "dill", "cloudpickle") and name in ("load", "loads"):
            bad.append(f"{at}: {owner}.{name}")
        v = kw.get("trust_remote_code")
        if v is not None and not (isinstance(v, ast.Constant) and v.value is False):
            bad.append(f"{at}: trust_remote_code")
        if name == "from_pretrained" and isinstance(kw.get("use_safetensors"), ast.Constant) and kw["use_safetensors"].value is False:
            bad.append(f"{at}: from_pretrained(use_safetensors=False)")
    return bad


def test_torch_load_always_weights_only_and_no_pickle_or_remote_code():
    bad = [v for path in SOURCES for v in violations(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(ROOT)))]
    assert not bad, "\n".join(bad)


def test_the_checker_flags_each_unsafe_form():
    snippet = (
        "import torch, pickle\n"
        "torch.load('a.pt')\n"
        "torch.load('b.pt', weights_only=False)\n"
        "torch.load('c.pt', weights_only=True)\n"
        "pickle.loads(b'')\n"
        "M.from_pretrained('x', trust_remote_code=True)\n"
        "M.from_pretrained('x', use_safetensors=False)\n"
    )
    found = violations(ast.parse(snippet), "snippet")
    assert [f.split(": ", 1)[0] for f in found] == ["snippet:2", "snippet:3", "snippet:5", "snippet:6", "snippet:7"]
