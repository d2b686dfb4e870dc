"""benchmarks/app_images.py on the CPU: one runner drawing several images (the UNet kept loads once, the text
encoder and decoder every image; the same seed the same image in every mode), and the summary of a mode's rows."""
from __future__ import annotations

import json

import pytest
from script_module import load_script  # tests/script_module.py


@pytest.fixture(scope="module")
def app():
    return load_script("benchmarks/app_images.py", "app_images_bench")


def test_keep_unet_loads_the_unet_once_and_draws_plain_images(app, tmp_path):
    out = tmp_path / "rows.json"
    for mode in ("plain", "keep_unet"):
        assert app.main(["--smoke", "--accelerator", "cpu", "--mode", mode, "--images", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["image"]) for r in rows] == [("plain", 0), ("plain", 1), ("keep_unet", 0), ("keep_unet", 1)]
    kept = [r for r in rows if r["mode"] == "keep_unet"]
    assert any(n.startswith("unet") for n in kept[0]["loads"])
    assert sorted(kept[1]["loads"]) == ["text_encoder", "vae_decoder"]  # the UNet stayed
    assert rows[2]["latency_s"]["unet_steps"] > 0 and "unet_load" not in kept[1]["latency_s"]
    assert rows[1]["loads"] == {}  # plain: nothing loads after the first image
    for seed in (0, 1):  # one seed, one image, whatever the loading policy
        assert len({r["image_sha256"] for r in rows if r["seed"] == seed}) == 1
    assert rows[0]["image_sha256"] != rows[1]["image_sha256"]


def test_refusals_write_nothing(app, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert app.main(["--accelerator", "cpu", "--mode", "plain", "--out", str(out)]) == 2
    assert app.main(["--smoke", "--accelerator", "cpu", "--mode", "plain", "--images", "0", "--out", str(out)]) == 2
    assert app.main(["--smoke", "--accelerator", "cpu", "--out", str(out)]) == 2
    assert not out.exists()
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def _row(mode, image, seconds, latency, once):
    return {"mode": mode, "keep": ["unet"], "launch": "warm", "image": image, "seed": image, "seconds": seconds,
            "runner_ready_s": 0.5 if image == 0 else None, "latency_s": latency, "loads": {}, "host_peak_mb": 1000.0,
            "gpu_peak_mb": 2000.0, "host_plus_gpu_peak_mb": 3000.0, "host_plus_gpu_peak_at_once_mb": once,
            "image_sha256": str(image), "litert": "x", "prompt": "p"}


def test_summary_splits_a_later_image_into_loads_runs_and_the_rest(app, tmp_path):
    later = {"text_encoder.0_load": 0.5, "text_encoder.1_load": 0.25, "text_encoder_load": 0.75,  # the parts' sum too
             "text_encoder_run": 0.05, "unet_steps": 0.3, "vae_decoder_head_load": 0.5, "vae_up_tile.0_load": 0.5,
             "vae_decoder_head_run": 0.05, "vae_up_tiles_run": 0.1, "total": 2.5}
    rows = [_row("keep_unet", 0, 8.0, {"unet_load": 2.0, "total": 8.0}, 3100.0), _row("keep_unet", 1, 2.5, later, 3200.0),
            _row("keep_unet", 2, 2.0, later, 3900.0)]
    (s,) = app.summarize(rows)
    assert (s["first_s"], s["second_s"], s["last_s"], s["later_min_s"], s["later_max_s"]) == (8.0, 2.5, 2.0, 2.0, 2.5)
    assert s["later_phases_mean_s"] == {"text_encoder_load": 0.75, "unet_load": 0.0, "decoder_load": 1.0, "runs": 0.5,
                                        "rest": 0.25, "total": 2.5}
    assert s["host_plus_gpu_peak_at_once_mb"] == 3900.0 and s["at_once_within_4gb"] and not s["later_within_1s"]
    assert app.load_s({"unet_load": 1.5}, "unet") == 1.5  # a whole model: its own key
