"""benchmarks/sdxl_bundle_rows.py turns scripts/gpu/sdxl_bundle.sh's launches (startup_levers rows of run-bundle on an
SDXL-family bundle) into result rows: the per-stage table from run-bundle's latency_s (chunks summed, both text
encoders apart), the targets checked per launch, and a clear refusal of missing inputs."""
from __future__ import annotations

import json
from pathlib import Path

from script_module import load_script  # tests/script_module.py

CHUNKED_MANIFEST = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle_chunked" / "manifest.json"  # an exported bundle's
rows_script = load_script("benchmarks/sdxl_bundle_rows.py", "sdxl_bundle_rows")

LATENCY = {"tokenize": 0.001, "text_encoder_load": 1.5, "text_encoder_run": 0.02, "text_encoder_2_load": 6.0,
           "text_encoder_2_run": 0.05, "unet.0_load": 2.0, "unet.1_load": 3.0, "unet_load": 5.0, "unet_steps": 0.8,
           "vae_decoder_head_load": 1.0, "vae_decoder_head_run": 0.03, "vae_up_tile.0_load": 2.0, "vae_up_tile.1_load": 2.5,
           "vae_up_tile.0_run": 0.1, "vae_up_tile.1_run": 0.2}


def test_stages_sum_chunks_once_and_keep_the_two_text_encoders_apart():
    t = rows_script.stage_table(LATENCY)
    assert t["unet"] == {"load_s": 5.0, "run_s": 0.8}  # the chunks, not chunks + their total
    assert t["text_encoder"]["load_s"] == 1.5 and t["text_encoder_2"]["load_s"] == 6.0
    assert t["vae_up_tile"] == {"load_s": 4.5, "run_s": 0.3}


def test_rows_check_the_targets_per_launch(tmp_path):
    runs = {"device": "gpu", "rows": [
        {"layout": "k", "mode": "pipelined", "launch": "cold", "total_s": 29.0, "host_plus_gpu_peak_at_once_mb": 4100.0,
         "latency_s": LATENCY},
        {"layout": "k", "mode": "pipelined", "launch": "warm", "total_s": 16.0, "host_plus_gpu_peak_at_once_mb": 3900.0,
         "latency_s": LATENCY},
        {"layout": "k", "mode": "overlap", "launch": "cold", "error": "timeout after 200 s"}]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    out = tmp_path / "rows.json"
    assert rows_script.main([str(tmp_path / "runs.json"), "--manifest", str(CHUNKED_MANIFEST), "--preset",
                             "koala_700m", "--resolution", "768", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["targets"] for r in rows[:2]] == [{"at_once_within_4gb": False, "image_within_30s": True},
                                                {"at_once_within_4gb": True, "image_within_15s": False}]
    assert rows[0]["unet_chunks"] == 2 and rows[0]["steps"] == 4 and rows[0]["resolution"] == 768  # read from a real export's manifest
    assert rows[2]["error"] == "timeout after 200 s"


def test_a_missing_runs_file_is_named(tmp_path, capsys):
    assert rows_script.main([str(tmp_path / "nope.json"), "--manifest", str(tmp_path / "m.json"), "--preset", "p",
                             "--resolution", "768", "--out", str(tmp_path / "o.json")]) == 2
    assert "nope.json is not a file" in capsys.readouterr().err
