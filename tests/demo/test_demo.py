"""`pocketdiff demo --smoke`: the whole chain on the embedded default, as the README runs it."""
import json
import subprocess
import sys


def test_demo_smoke_runs_the_chain_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "demo", "--smoke", "--output", str(out)],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["student"]["steps"] == 4
    assert report["calibrate"]["bits"] == 8 and report["calibrate"]["unet_cosine"] > 0.99
    assert report["prune"]["params_after"] < report["prune"]["params_before"]
    models = {m["model"] for m in report["metrics"]}
    assert {"student 4", "student W8 4", "pruned student 4"} <= models
    assert all(m["clip_score"] is not None and m["fd"] is not None for m in report["metrics"])
    comps = report["bundle"]["components"]
    assert set(comps) == {"text_encoder", "unet", "vae_decoder"}
    assert all(c["fully_accelerated"] for c in comps.values())
    assert report["run_bundle"]["fully_accelerated"] is True
    assert (out / "index.html").is_file() and (out / "run-bundle" / "image.png").is_file()
    assert "pocketdiff demo summary" in r.stdout
