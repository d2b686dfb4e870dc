"""benchmarks/startup_tables.py: the start-up levers / app / SD-2.1-size img2img blocks follow their result files, and
the README's hand-written image-to-image sentence carries the file's figures."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("startup_tables", ROOT / "benchmarks" / "startup_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_targets_sentence_names_the_best_rows_within_the_budget(monkeypatch):
    t = _module()
    d = t.load(t.STARTUP)
    text = t.startup_targets()
    within = [r for r in d["rows"] if r["host_plus_gpu_peak_at_once_mb"] <= t.BUDGET_MB and r["launch"] == "warm"]
    best = min(within, key=lambda r: r["total_s"])
    assert f"`{best['mode']}` {best['total_s']:.1f} s" in text
    # a best warm row under 5 s would read as met
    fake = json.loads(json.dumps(d))
    next(r for r in fake["rows"] if r is not None and r["mode"] == best["mode"] and r["launch"] == "warm")["total_s"] = 4.0
    monkeypatch.setattr(t, "load", lambda name: fake if name == t.STARTUP else json.loads((t.RESULTS / name).read_text()))
    assert "met warm" in t.startup_targets() and "not met warm" not in t.startup_targets()


def test_skipped_configurations_are_not_rows():
    t = _module()
    d = t.load(t.STARTUP)
    table = t.startup_levers()
    for m in {s.split()[0] for s in d["skipped"]} & set(d["configs"]) - set(t._modes(d)):
        assert f"| `{' '.join(d['configs'][m])}` |" not in table
        assert f"`{' '.join(d['configs'][m])}`" in table.split("Not measured", 1)[1]


def test_readme_img2img_sentence_carries_the_file_figures():
    t = _module()
    d = t.load(t.I2I)
    cold, warm = (t._i2i_stage(d[k]["per_model"], "vae_encoder") for k in ("img2img", "img2img_warm"))
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if "banded encoder's load + run adds" in l)
    assert f"{sum(warm):.1f} s warm / {sum(cold):.1f} s cold" in line
    assert f"{d['img2img_warm']['host_plus_gpu_peak_at_once_mb']:,.0f} MB warm" in line
    assert d["within_budget_at_once"] and "within 4 GB at once" in line
