"""`pocketdiff demo --smoke`: the whole chain on the embedded default, as the README runs it."""
import json
import re
import subprocess
import sys


def test_demo_smoke_runs_the_chain_end_to_end(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "demo", "--smoke", "--output", str(out)],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    # progressive distillation goes to 2 steps; the 4-step student is kept for the comparison
    assert report["student"]["steps"] == 2 and set(report["students"]) == {"4", "2"}
    assert report["calibrate"]["bits"] == 8 and report["calibrate"]["unet_cosine"] > 0.99
    assert report["prune"]["params_after"] < report["prune"]["params_before"]
    rows = {(m["model"], m["steps"]) for m in report["metrics"]}
    assert {("teacher DDIM", 2), ("teacher DDIM", 4), ("teacher DDIM", 16), ("teacher DDIM trailing", 2),
            ("teacher DDIM trailing", 4), ("student 4", 4), ("student 2", 2), ("student W8 2", 2),
            ("pruned student 2", 2)} == rows
    assert all(m["clip_score"] is not None and m["fd"] is not None for m in report["metrics"])
    comps = report["bundle"]["components"]
    assert set(comps) == {"text_encoder", "unet", "vae_decoder"}
    assert all(c["fully_accelerated"] for c in comps.values())
    assert report["run_bundle"]["fully_accelerated"] is True
    assert (out / "index.html").is_file() and (out / "run-bundle" / "image.png").is_file()
    assert "pocketdiff demo summary" in r.stdout
    # a newcomer's screen: the summary fits 40 lines, and no third-party native log line is shown
    summary = r.stdout[r.stdout.index("pocketdiff demo summary"):].strip().splitlines()
    assert len(summary) <= 40, "\n".join(summary)
    # one line per stage: what it buys and the quality it keeps
    stages = [line.split()[0] for line in summary if re.match(r"^  (distill|quantize|prune|export) ", line)]
    assert stages == ["distill", "distill", "quantize", "prune", "export"], "\n".join(summary)
    assert "16 -> 2 steps: 32 -> 2 UNet passes/image (16x fewer)" in r.stdout
    assert "16 -> 4 steps: 32 -> 4 UNet passes/image (8x fewer)" in r.stdout
    assert "n/a" not in "\n".join(line for line in summary if line.startswith("  ") and line.split()[0] in set(stages))
    native = [line for line in (r.stdout + r.stderr).splitlines()
              if re.match(r"^(INFO|WARNING|ERROR|VERBOSE): |^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\]", line)]
    assert not native, native[:5]
    assert (out / "logs" / "native.log").is_file()  # they went to the log file
