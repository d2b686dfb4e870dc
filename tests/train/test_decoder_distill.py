"""`pocketdiff distill-decoder`: fold, fine-tune, held-out PSNR, a norm-free VAE folder, resume."""
from __future__ import annotations

import json

import pytest

from pocketdiff.cli import main as cli_main
from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.models import load_vae
from pocketdiff.normfree import has_group_norm_up_path, norm_free_names

SMOKE = "configs/smoke/distill-decoder.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dd") / "out"
    assert cli_main(["distill-decoder", "--config", SMOKE, "--output", str(out), "train.max_steps=3", "train.lr=1e-5"]) == 0
    return out


def test_report_page_and_folder(run):
    rep = json.loads((run / "report.json").read_text())
    assert rep["steps"] == 3 and rep["folded_norms"] > 0
    assert rep["data"]["train_items"] == 32 and rep["data"]["held_out_items"] == 8
    for k in ("folded", "fine_tuned"):
        assert rep["held_out_psnr_db"][k]["mean"] > 10.0
    assert (run / "side_by_side.png").is_file() and "side_by_side.png" in (run / "index.html").read_text()
    vae = load_vae(str(run / "vae"))
    assert not has_group_norm_up_path(vae)
    assert len(norm_free_names(run / "vae")) == rep["folded_norms"]


def test_resume_continues_from_the_checkpoint(run):
    assert cli_main(["distill-decoder", "--config", SMOKE, "--output", str(run), "--resume", "latest",
                     "train.max_steps=4", "train.lr=1e-5"]) == 0
    logged = [r["step"] for r in map(json.loads, (run / "logs.jsonl").read_text().splitlines()) if "loss" in r]
    assert logged and max(logged) == 4 and logged.count(4) == 1  # steps 1-3 came from the checkpoint, not again
    assert json.loads((run / "report.json").read_text())["steps"] == 4


def test_generated_latents_train_beside_the_images(tmp_path):
    from pocketdiff.shipped import resolve_shipped

    teacher = resolve_shipped("pocketdiff:shapes-teacher")
    out = tmp_path / "out"
    assert cli_main(["distill-decoder", "--config", SMOKE, "--output", str(out), "arch=null", f"vae={teacher}",
                     f"samples.pipeline={teacher}", "samples.count=8", "samples.steps=2", "train.max_steps=2", "train.lr=1e-5"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["data"]["train_latents"] == 32 + 8 and rep["samples"]["count"] == 8
    psnr = rep["held_out_samples_psnr_db"]
    assert set(psnr) == {"folded", "fine_tuned"} and psnr["fine_tuned"]["mean"] > 20.0  # the 8 held-out captions' latents
    assert "generated latents" in (out / "index.html").read_text()


@pytest.mark.parametrize("over, field", [({"vae": "x", "arch": "tiny"}, "vae"), ({"student": "tiny"}, "student"),
                                         ({"holdout": 0}, "holdout")])
def test_config_errors_name_the_field(over, field):
    from pocketdiff.config import DataConfig
    from pocketdiff.train.decoder_distill import Config

    base = {"arch": "tiny", "data": DataConfig(max_samples=8)}
    with pytest.raises(ConfigError, match=field):
        Config(**{**base, **over})


def test_a_bad_samples_field_is_named():
    from pocketdiff.train.decoder_distill import SamplesConfig

    with pytest.raises(ConfigError, match="samples.count"):
        SamplesConfig(pipeline="x", count=0)


def test_generated_latents_of_another_shape_are_refused(monkeypatch):
    import torch

    import pocketdiff.sampling
    from pocketdiff.config import DataConfig
    from pocketdiff.shipped import resolve_shipped
    from pocketdiff.train.decoder_distill import Config, SamplesConfig, generated_latents

    teacher = str(resolve_shipped("pocketdiff:shapes-teacher"))
    monkeypatch.setattr(pocketdiff.sampling, "generate", lambda *a, **k: torch.zeros(2, 8, 8, 8))  # 8 latent channels
    cfg = Config(vae=teacher, data=DataConfig(source="shapes", resolution=32, max_samples=8), samples=SamplesConfig(pipeline=teacher))
    with pytest.raises(PocketdiffError, match=r"samples.pipeline: .* generates latents \(8, 8, 8\), the VAE .* encodes \(4, 8, 8\)"):
        generated_latents(cfg, ["a", "b"], torch.zeros(2, 4, 8, 8))
