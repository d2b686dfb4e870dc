"""Inception FID offline: seeded random Inception-v3 weights saved as .pth and .safetensors,
run through MetricSetup and `pocketdiff evaluate` with features=inception and no network:
self-distance ~0, growth with a controlled shift, honest names, safe loading, one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pocketdiff.cli import main
from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError
from pocketdiff.evaluate import MetricConfig, MetricSetup
from pocketdiff.evaluate import inception
from pocketdiff.evaluate.features import inception_label
from pocketdiff.evaluate.inception import FIDInceptionV3, load_fid_inception, tf1_resize_bilinear
from pocketdiff.outputs import sha256_file

REF = DataConfig(source="shapes", shapes_count=8, resolution=32)  # Inception at 299 px: keep sets small


def _darken(images: torch.Tensor, amount: float) -> torch.Tensor:
    return (images.float() * (1.0 - amount)).round().to(torch.uint8)


def _setup(weights, cache_dir, reference=REF):
    cfg = MetricConfig(features="inception", inception_weights=str(weights), clip_score=False, cache_dir=str(cache_dir), batch_size=8)
    return MetricSetup(cfg, reference=reference)


def test_inception_fd_offline_self_zero_grows_with_shift_and_is_named_honestly(inception_files, cache_dir, shapes_uint8, no_network):
    setup = _setup(inception_files["pth"], cache_dir)
    # random weights are not the FID network: an FD named by its weights file, never "FID"
    assert setup.fd_label == "FD (Inception-v3 pool3, 2048-d; weights random-inception.pth, not the standard FID weights)"
    assert setup.feature_dim == 2048
    images, _ = shapes_uint8(8)  # exactly the reference images
    self_fd = setup.fd(images)
    shifted = [setup.fd(_darken(images, a)) for a in (0.2, 0.6)]
    assert shifted[0] > 0 and shifted[0] < shifted[1], shifted
    assert abs(self_fd) < 1e-3 * shifted[0], (self_fd, shifted)
    described = setup.describe()
    assert described["fd"] == setup.fd_label and described["fd_inception_weights"]["standard"] is False
    assert described["fd_inception_weights"]["sha256"] == sha256_file(inception_files["pth"])
    assert not (no_network / "hub").exists()  # nothing was fetched into the hub cache


def test_safetensors_and_pth_weights_give_the_same_network(inception_files, no_network):
    a, info_a = load_fid_inception(str(inception_files["pth"]))
    b, info_b = load_fid_inception(str(inception_files["safetensors"]))
    x = torch.randint(0, 256, (2, 3, 40, 24), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    fa, fb = a(x), b(x)
    assert fa.shape == (2, 2048) and fa.dtype == torch.float32 and fa.abs().mean() > 1e-3  # features neither vanish nor explode
    assert torch.equal(fa, fb)
    assert torch.equal(a(x.float()), fa)  # float input is read as [0, 255] pixel values
    assert not info_a["standard"] and not info_b["standard"]
    assert not a.training and not any(p.requires_grad for p in a.parameters())


def test_only_the_standard_weights_make_it_fid(inception_files, monkeypatch, no_network):
    assert inception_label({"weights": "/x/weights-inception-2015-12-05-6726825d.pth", "standard": True}) == "FID (Inception-v3 pool3, 2048-d)"
    # a file whose sha256 is the standard one is recognised (pretend the random file is it)
    monkeypatch.setattr(inception, "STANDARD_SHA256", sha256_file(inception_files["pth"]))
    _, info = load_fid_inception(str(inception_files["pth"]))
    assert info["standard"] and inception_label(info) == "FID (Inception-v3 pool3, 2048-d)"


def test_default_weights_come_from_the_torch_hub_cache_without_download(inception_files, no_network):
    import shutil

    cached = no_network / "hub" / "checkpoints" / inception.WEIGHTS_FILE
    cached.parent.mkdir(parents=True)
    shutil.copy(inception_files["pth"], cached)
    _, info = load_fid_inception(None)
    assert info["weights"] == str(cached) and not info["standard"]


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


def test_no_weights_and_no_network_is_one_clear_line(monkeypatch, no_network, cache_dir):
    # offline flags: the download is not even tried (the fixture's refusal would raise AssertionError)
    with pytest.raises(PocketdiffError) as e:
        MetricSetup(MetricConfig(features="inception", clip_score=False, cache_dir=str(cache_dir)), reference=REF)
    assert "pass metrics.inception_weights=FILE" in _one_line(e)
    # online flags, but the network is down: the failed download becomes the same one-line advice
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "POCKETDIFF_OFFLINE"):
        monkeypatch.delenv(var)
    calls = []

    def no_route(url, dst):
        calls.append(url)
        raise OSError("[Errno 101] Network is unreachable\nmore detail")

    monkeypatch.setattr(inception, "_download", no_route)
    with pytest.raises(PocketdiffError) as e:
        MetricSetup(MetricConfig(features="inception", clip_score=False, cache_dir=str(cache_dir)), reference=REF)
    text = _one_line(e)
    assert calls == [inception.WEIGHTS_URL]
    assert "cannot get the Inception weights (OSError: [Errno 101] Network is unreachable)" in text
    assert "pass metrics.inception_weights=FILE" in text
    assert not list((no_network / "hub" / "checkpoints").iterdir())  # no partial file left behind


def test_weights_files_are_read_safely_and_checked(tmp_path, inception_files):
    bad = tmp_path / "code.pth"
    torch.save({"a.weight": torch.ones(1), "obj": np.random.default_rng(0)}, bad)  # arbitrary objects: refused, never run
    with pytest.raises(PocketdiffError, match=r"weights_only=True"):
        load_fid_inception(str(bad))
    with pytest.raises(PocketdiffError, match="is not a file"):
        load_fid_inception(str(tmp_path / "missing.pth"))
    other = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.ones(2, 2)}, other)
    with pytest.raises(PocketdiffError, match=r"not an Inception-v3 FID state dict .*missing .*unexpected \(e\.g\. conv\.weight\)"):
        load_fid_inception(str(other))
    state = torch.load(inception_files["pth"], weights_only=True)
    state["fc.weight"] = torch.zeros(1000, 2048)  # torchvision's 1000-class head, not the TF graph's 1008
    wrong = tmp_path / "wrong.pth"
    torch.save(state, wrong)
    with pytest.raises(PocketdiffError, match=r"fc\.weight has shape \(1000, 2048\), Inception-v3 has \(1008, 2048\)"):
        load_fid_inception(str(wrong))


def test_tf1_bilinear_resize_samples_without_half_pixel_offset():
    x = torch.tensor([[[[0.0, 10.0]]]])  # 1 x 2 -> 2 x 4: samples at 0, 0.5, 1, 1.5 (clamped)
    out = tf1_resize_bilinear(x.expand(1, 1, 1, 2), 4)
    assert torch.equal(out, torch.tensor([0.0, 5.0, 10.0, 10.0]).expand(1, 1, 4, 4))
    y = torch.rand(1, 3, 299, 299)
    assert torch.equal(tf1_resize_bilinear(y, 299), y)


def test_matches_torch_fidelity_where_it_is_installed(inception_files):
    pytest.importorskip("torchvision", reason="torch-fidelity needs torchvision (no CPU build for torch 2.13 here)")
    tf = pytest.importorskip("torch_fidelity.feature_extractor_inceptionv3")
    ref = tf.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(inception_files["pth"]))
    ours, _ = load_fid_inception(str(inception_files["pth"]))
    x = torch.randint(0, 256, (2, 3, 64, 48), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.allclose(ours(x), ref(x)[0], atol=1e-5)


def test_evaluate_verb_with_inception_features_offline(tmp_path, tiny_pipeline_dir, tiny_clip_dir, inception_files, no_network):
    cfg = tmp_path / "e.yaml"
    cfg.write_text(
        f"models:\n  - {{name: teacher, path: {tiny_pipeline_dir}}}\n"
        "reference: {source: shapes, shapes_count: 12, resolution: 32}\n"
        "prompts: {from_reference: 4}\n"
        f"metrics: {{features: inception, inception_weights: {inception_files['safetensors']}, clip: {tiny_clip_dir}, "
        f"cache_dir: {tmp_path / 'cache'}, reference_clip_samples: 4, batch_size: 8}}\n"
        "steps: [1]\nseeds: [0]\nguidance_scale: 2.0\ngrid_prompts: 2\ndevice: cpu\n"
    )
    out = tmp_path / "run"
    assert main(["evaluate", "--config", str(cfg), "--output", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    (res,) = rep["results"]
    label = "FD (Inception-v3 pool3, 2048-d; weights random-inception.safetensors, not the standard FID weights)"
    assert res["features"] == label and res["fd"] > 0 and res["clip_score"] is not None and res["num_samples"] == 4
    assert rep["metrics"]["fd_inception_weights"]["weights"] == str(inception_files["safetensors"])
    assert any("4 samples per seed <= 2048 feature dimensions" in w for w in rep["warnings"])
    assert label in (out / "index.html").read_text()
