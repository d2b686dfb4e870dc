"""Block-removed UNets (BK-SDM's Small / Tiny shapes: no mid block, one stage fewer) in chunks: the split in torch
for both cuts, the config refusing what it cannot chunk before any conversion, and `small` / `tiny` preset bundles
exported in chunks fully accelerated on the lavapipe GPU delegate, then run through run-bundle."""
from __future__ import annotations

import functools
import json

import pytest
import torch
import yaml

from pocketdiff.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: the torch splits 0.4 s alone, 60 s two-threaded on a busy box

# model.arch=small (three stages 64, 128, 128, two layers per down stage) at 32 px, random weights with
# trained-like norms; `model.unet_blocks` gives the UNet a block-removal preset's shape
BUILT = {"seed": 0, "model": {"arch": "small"}, "perturb_norms": True, "resolution": 32, "weights": "fp16", "guidance": "cfg",
         "guidance_scale": 3.0, "steps": 2, "fp16_scan": {"enabled": False}, "components": ["text_encoder", "unet", "vae_decoder"]}


@functools.lru_cache(maxsize=None)
def _unet_inputs(preset: str):
    """(the UNet of `preset`, golden inputs, its output): built once per preset for the module's torch tests."""
    from pocketdiff.export.components import UNetGraph, time_embedding_table
    from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines

    pipe = build_pipeline(ModelConfig(arch="small", unet_blocks=preset), resolution=32)
    unet = pipe.unet.eval()
    perturb_norm_affines(unet, 0)
    table = time_embedding_table(unet, 1000)
    graph = UNetGraph(unet, external_time_embedding=True)
    s = unet.config.sample_size
    g = torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(2, 4, s, s, generator=g), "timestep": torch.from_numpy(table[[500, 500]]),
              "encoder_hidden_states": torch.randn(2, 77, pipe.text_encoder.config.hidden_size, generator=g)}
    with torch.no_grad():
        ref = graph(*inputs.values())
    return unet, inputs, ref


@pytest.fixture(scope="module", params=["small", "tiny"])
def slim_unet(request):
    return request.param, *_unet_inputs(request.param)


@pytest.mark.parametrize("cut", ["block", "layer"])
def test_chunks_of_a_unet_without_mid_block_equal_the_whole_in_torch(slim_unet, cut):
    from pocketdiff.export.unet_chunks import run_chunks, split_unet, unet_stages

    preset, unet, inputs, ref = slim_unet
    assert unet.mid_block is None and len(unet.down_blocks) == (3 if preset == "small" else 2)
    stages = unet_stages(unet, cut)
    assert "mid_block" not in [s.name for s in stages]
    for k in range(1, len(stages) + 1):
        chunks = split_unet(unet, k, cut)
        _, outs, final = run_chunks(chunks, inputs)
        assert torch.equal(final, ref), (k, cut)
        for c, out in zip(chunks, outs):
            assert len({id(v) for v in out.values()}) == len(out)  # each tensor returned once


def test_cut_between_the_last_down_and_the_first_up_block_passes_the_stream_as_the_skip():
    """No mid block: up_blocks.0 reads down_blocks.1's last skip, which is the stream that chunk returns (an alias)."""
    from pocketdiff.export.unet_chunks import plan_chunks, run_chunks, split_unet

    unet, inputs, ref = _unet_inputs("tiny")
    plans = plan_chunks(unet, 4)  # one block each: conv_in + down_blocks.0 | down_blocks.1 | up_blocks.0 | up_blocks.1
    assert [p.stages for p in plans] == [["down_blocks.0"], ["down_blocks.1"], ["up_blocks.0"], ["up_blocks.1"]]
    assert plans[1].aliases == {"skip_3": "hidden"} and plans[1].outputs == ["hidden"]
    assert plans[2].inputs == ["hidden", "skip_2", "skip_3", "timestep", "encoder_hidden_states"]
    assert plans[3].inputs[:3] == ["hidden", "skip_0", "skip_1"]
    _, _, final = run_chunks(split_unet(unet, 4), inputs)
    assert torch.equal(final, ref)


@pytest.mark.parametrize("overrides,message", [
    (["model.arch=small", "model.unet_blocks=tiny", "unet_chunks=5"], "unet_chunks: 5 chunks, but the UNet has 4 blocks"),
    (["model.arch=small", "model.unet_blocks=tiny", "unet_chunks=9", "unet_chunk_cut=layer"], "unet_chunks: 9 chunks, but the UNet has 8 stages"),
    (["model.arch=tiny", "model.unet_blocks=small", "unet_chunks=5"], "unet_chunks: 5 chunks, but the UNet has 4 blocks"),
    (["model.arch=small", "model.unet_blocks=huge"], "model.unet_blocks: must be one of base, small, tiny"),
])
def test_config_refuses_chunks_a_slim_unet_cannot_make_before_any_work(export_config_error, overrides, message):
    assert message in export_config_error(overrides)


def test_a_pretrained_folder_without_mid_block_is_chunk_checked_from_its_config(tmp_path, export_config_error):
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    folder = tmp_path / "slim"
    save_pipeline(build_pipeline(ModelConfig(arch="small", unet_blocks="small"), resolution=32), folder)
    assert "but the UNet has 6 blocks" in export_config_error([f"model.pretrained={folder}", "unet_chunks=7"])
    from pocketdiff.config import load_config
    from pocketdiff.export.verb import Config

    assert load_config(Config, None, [f"model.pretrained={folder}", "unet_chunks=6"]).unet_chunks == 6


@pytest.fixture(scope="module")
def slim_bundles(gpu_delegate, tmp_path_factory):
    """The `small` preset in 3 block chunks (its UNet alone: only the chunks are checked) and the `tiny` preset in 4
    layer chunks with the text encoder and decoder (run-bundle makes an image from it)."""
    root = tmp_path_factory.mktemp("slim_chunks")
    out = {}
    for name, extra in (("small", {"model": {"arch": "small", "unet_blocks": "small"}, "unet_chunks": 3, "components": ["unet"]}),
                        ("tiny", {"model": {"arch": "small", "unet_blocks": "tiny"}, "unet_chunks": 4, "unet_chunk_cut": "layer"})):
        (root / f"{name}.yaml").write_text(yaml.safe_dump({**BUILT, **extra}))
        out[name] = root / f"bundle_{name}"
        assert cli_main(["export", "--config", str(root / f"{name}.yaml"), "--output", str(out[name])]) == 0
    return out


@pytest.mark.parametrize("name,cut", [("small", "block"), ("tiny", "layer")])
def test_slim_chunks_fully_accelerated_and_match_the_whole_unet(slim_bundles, name, cut):
    man = json.loads((slim_bundles[name] / "manifest.json").read_text())
    block = man["unet_chunks"]
    stages = [s for c in block["stages"] for s in c]
    assert "mid_block" not in stages and (("layers." in " ".join(stages)) == (cut == "layer"))
    assert stages[-1].startswith("up_blocks.")
    rep = json.loads((slim_bundles[name] / "report.json").read_text())["components"]
    for comp in block["components"]:
        assert rep[comp]["fully_accelerated"] is True and rep[comp]["cosine"] >= 0.999, comp
    e2e = rep["unet"]["details"]["end_to_end_parity"]
    assert e2e["fp16"]["cosine"] >= 0.999 and e2e["fp32"]["psnr_db"] >= 60, e2e


def test_run_bundle_on_the_tiny_preset_chunks(slim_bundles, tmp_path, monkeypatch):
    import numpy as np
    from PIL import Image

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert cli_main(["run-bundle", str(slim_bundles["tiny"]), "--prompt", "a red circle", "--output", str(out), "--seed", "1",
                     "--accelerator", "gpu", "--pipelined"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["fully_accelerated"] is True
    img = np.asarray(Image.open(report["image"]), dtype=np.float64)
    assert img.shape[:2] == (32, 32) and np.isfinite(img).all() and img.std() > 0


def test_verify_bundle_on_the_tiny_preset_chunks(slim_bundles, tmp_path):
    # every component of the mid-block-free, lowest-stage-free bundle through verify-bundle's checks on the delegate
    out = tmp_path / "verify.json"
    assert cli_main(["verify-bundle", str(slim_bundles["tiny"]), "--accelerator", "gpu", "--precisions", "fp16",
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failures"] == []
    chunks = [n for n in report["components"] if n.startswith("unet.")]
    assert len(chunks) == 4 and all(report["components"][n]["ok"] for n in chunks)


def test_chunk_counts_the_loaded_models_cannot_make_are_refused_before_any_conversion(tmp_path, capsys, monkeypatch):
    """Checked on the loaded models right after loading (a hub id's shapes are first known there): no scan, no
    conversion has run when the one-line refusal comes."""
    from pocketdiff.export import exporter

    def no_conversion(*a, **k):
        raise AssertionError("a conversion ran before the chunk plans were checked")

    monkeypatch.setattr(exporter, "convert_job", no_conversion)
    out = tmp_path / "never"
    assert cli_main(["export", "--output", str(out), "model.arch=tiny", "resolution=32", "text_encoder_chunks=3",
                     "fp16_scan.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "text_encoder_chunks: 3 chunks, but the text encoder has 2 layers" in err and len(err.strip().splitlines()) == 1
