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
    # a newcomer's screen: the summary fits 40 lines, and no third-party native log line is shown
    summary = r.stdout[r.stdout.index("pocketdiff demo summary"):].strip().splitlines()
    assert len(summary) <= 40, "\n".join(summary)
    native = [line for line in (r.stdout + r.stderr).splitlines()
              if re.match(r"^(INFO|WARNING|ERROR|VERBOSE): |^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\]", line)]
    assert not native, native[:5]
    assert (out / "logs" / "native.log").is_file()  # they went to the log file
