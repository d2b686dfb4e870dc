"""benchmarks/img2img_openmoji.py end to end on the CPU in seconds: the shipped shapes teacher, the tiny LCM student
(tests/conftest.py `lcm_student`), its W8 in calibrate's layout (unet_int8.safetensors + recipe, pipeline/) and the
shipped shapes CLIP, whose pocketdiff_clip.json names the held-out split the inputs come from."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from script_module import load_script  # tests/script_module.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

FIELDS = {"model", "steps", "strength", "fd_vs_teacher64", "fd_vs_real", "clip_score", "psnr_to_input", "ssim_to_input", "n"}


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/img2img_openmoji.py", "img2img_openmoji_bench")


@pytest.fixture(scope="module")
def w8(lcm_student, tmp_path_factory):
    """The student's UNet rounded to nearest per output channel, laid out as `pocketdiff calibrate` writes it (what
    load_quantized_pipeline reads): the codes and recipe beside a pipeline/ folder."""
    from diffusers import UNet2DConditionModel

    from pocketdiff.compress.quant.calibrate_outputs import UNET_FILE
    from pocketdiff.compress.quant.int8_format import save_quantized
    from pocketdiff.export.int8 import rtn_checkpoint

    out = tmp_path_factory.mktemp("w8") / "calib"
    shutil.copytree(lcm_student, out / "pipeline")
    q = rtn_checkpoint(UNet2DConditionModel.from_pretrained(str(lcm_student / "unet")), "unet", 8)
    save_quantized(q.state, q.recipe, out / UNET_FILE)
    return out


@pytest.fixture(scope="module")
def result(bench, lcm_student, w8, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--teacher", "pocketdiff:shapes-teacher", "--student", str(lcm_student), "--w8", str(w8),
            "--clip", "pocketdiff:clip-shapes", "--n", "8", "--teacher-steps", "8", "--batch-size", "4",
            "--out-dir", str(out), "--tag", "test"]
    assert bench.main(argv) == 0
    return out, json.loads((out / "img2img_openmoji_test.json").read_text())


def test_rows_are_complete(result):
    _, res = result
    rows = res["rows"]
    assert {(r["model"], r["strength"]) for r in rows} == {(m, s) for m in ("teacher", "student", "student_w8")
                                                          for s in (0.3, 0.5, 0.7)}
    for r in rows:
        assert FIELDS <= set(r) and r["n"] == 8
        assert r["steps"] == (8 if r["model"] == "teacher" else 2)
        for key in FIELDS - {"model", "steps", "strength", "n", "fd_vs_teacher64"}:
            assert isinstance(r[key], float) and r[key] == r[key], (r["model"], key)
        assert (r["fd_vs_teacher64"] is None) == (r["model"] == "teacher")
        assert 0 < r["clip_score"] <= 100 and 0 < r["ssim_to_input"] <= 1
    assert res["samplers"]["student"]["sampler"] == "consistency" and res["samplers"]["teacher"]["sampler"] == "ddim"
    assert res["metrics"]["fd"] == "FD (shapes-CLIP)" and any("LPIPS" in n for n in res["notes"])
    assert res["data"]["clip_holdout"] == 512 and res["data"]["items"] == "0..7 of the seeded order"


def test_outputs_drift_from_the_input_as_strength_rises(result):
    """More strength, more noise on the picture: every model's PSNR (and SSIM) to its input falls from 0.3 to 0.7, and
    none beats the VAE's own round trip."""
    _, res = result
    by = {(r["model"], r["strength"]): r for r in res["rows"]}
    for m in ("teacher", "student", "student_w8"):
        assert by[(m, 0.3)]["psnr_to_input"] > by[(m, 0.7)]["psnr_to_input"], m
        assert by[(m, 0.3)]["ssim_to_input"] > by[(m, 0.7)]["ssim_to_input"], m
        assert by[(m, 0.3)]["psnr_to_input"] < res["reference"]["vae_roundtrip_psnr"] + 0.5, m


def test_grid_and_provenance(result, lcm_student):
    from PIL import Image

    out, res = result
    grid = Image.open(out / res["grid"])
    assert grid.size[0] == 4 * 64  # input | teacher | student | W8, 32 px tiles at scale 2
    prov = res["provenance"]
    sha = hashlib.sha256((lcm_student / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    assert prov["folders"]["student"]["weights_sha256"]["unet/diffusion_pytorch_model.safetensors"] == sha
    assert "unet_int8.safetensors" in prov["folders"]["student_w8"]["weights_sha256"]
    assert prov["torch"] and prov["date"].endswith("Z") and "--n 8" in prov["command"]
    assert "/tmp" not in json.dumps(res) and str(out) not in json.dumps(res)


def test_a_missing_folder_is_one_line_and_exit_2(bench, tmp_path, capsys):
    argv = ["--teacher", str(tmp_path / "nope"), "--student", str(tmp_path), "--w8", str(tmp_path),
            "--clip", "pocketdiff:clip-shapes", "--out-dir", str(tmp_path / "out")]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"img2img_openmoji: --teacher: {tmp_path / 'nope'} does not exist"
    assert not (tmp_path / "out").exists()
