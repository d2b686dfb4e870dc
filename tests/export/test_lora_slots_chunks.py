"""LoRA slots in a chunked UNet (issue 65 item 3, the phone preset's `unet_chunks`): each chunk takes the factor inputs of
the slotted projections in its stages, by the whole UNet's names (export/unet_chunks.py), so one LoRA file feeds a
chunked bundle as it feeds a whole one; the runners pass the factors through the chunks' table of named tensors.

Parity: the chunked slotted bundle (2 chunks, block cut; 3 chunks, layer cut) fed a LoRA against the bundle with the
same LoRA fused (`model.lora`) and against the whole-UNet slotted bundle fed it; with no LoRA against the plain chunked
bundle. The shipped tiny teacher at fp32 weights (text encoder and decoder conversions shared); the whole slotted and
fused bundles are test_lora_slots.py's, exported once a session for both files (tests/lora_bundles.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from lora_bundles import PROMPT, SLOTS, TEACHER, psnr  # tests/lora_bundles.py: the bundles, shared with test_lora_slots.py

from pocketdiff.cli import main as cli_main
from pocketdiff.lora_keys import slot_input_names


@pytest.mark.parametrize("k, cut", [(2, "block"), (3, "layer"), (5, "layer")])
def test_slotted_chunks_in_sequence_equal_the_whole_slotted_graph_in_torch(k, cut):
    """Each slot in exactly one chunk, its factors among that chunk's inputs by the whole graph's names; the chunks in
    sequence fed the golden factors give the whole slotted graph's output."""
    from pocketdiff.export.components import UNetGraph, time_embedding_table
    from pocketdiff.export.lora_slots import LoraSlotsConfig, add_lora_slots
    from pocketdiff.export.unet_chunks import run_chunks, split_unet
    from pocketdiff.models import ModelConfig, load_or_build

    pipe = load_or_build(ModelConfig(pretrained=TEACHER))
    unet = pipe.unet.eval()
    table = time_embedding_table(unet, 1000)
    s, gen = unet.config.sample_size, torch.Generator().manual_seed(0)
    inputs = {"sample": torch.randn(2, unet.config.in_channels, s, s, generator=gen), "timestep": torch.from_numpy(table[[500, 500]]),
              "encoder_hidden_states": torch.randn(2, 77, pipe.text_encoder.config.hidden_size, generator=gen)}
    graph, inputs, block = add_lora_slots(UNetGraph(unet, external_time_embedding=True), inputs, LoraSlotsConfig(**SLOTS))
    inputs = {n: v * 20 if n.startswith("lora_") and n.endswith("_up") else v for n, v in inputs.items()}  # a branch that shows
    with torch.no_grad():
        ref = graph(*inputs.values())
        plain = graph(*[torch.zeros_like(v) if n.startswith("lora_") else v for n, v in inputs.items()])
    chunks = split_unet(unet, k, cut)
    slots = [m for c in chunks for m in c.plan.slots]
    assert sorted(slots) == sorted(block["targets"]) and len(slots) == len(set(slots)) == 32
    for c in chunks:
        assert c.plan.inputs[-2 * len(c.plan.slots):] == [n for m in c.plan.slots for n in slot_input_names(m)] or not c.plan.slots
        assert all(m.startswith(tuple(f"{st.split('.layers.')[0]}." for st in c.plan.stages)) for m in c.plan.slots)
    _, _, final = run_chunks(chunks, inputs)
    assert float((ref - plain).abs().max()) > 1e-2 * float(ref.abs().max())  # the branch matters: not vacuous
    torch.testing.assert_close(final, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def lora(lora_bundles) -> Path:
    return lora_bundles.lora


@pytest.fixture(scope="module")
def bundles(lora_bundles) -> dict:
    """chunks (2 chunks, block cut, every chunk checked on the GPU delegate at fp16 and fp32), layered (3 chunks cut at
    layers), and the references: plain_chunks (2 chunks, no slots), fused (the LoRA in the weights) and slots (the UNet
    whole, slotted; delegate-checked), the last two test_lora_slots.py's (tests/lora_bundles.py LAYOUTS)."""
    return {name: lora_bundles[name] for name in ("chunks", "layered", "plain_chunks", "slots", "fused")}


def test_each_chunk_takes_its_slots_factors_fully_accelerated(bundles):
    man = json.loads((bundles["chunks"] / "manifest.json").read_text())
    report = json.loads((bundles["chunks"] / "report.json").read_text())
    block, chunks = man["lora_slots"], man["unet_chunks"]
    assert block["rank"] == 4 and len(block["targets"]) == 32 and "unet" not in man["components"]
    assert block == json.loads((bundles["slots"] / "manifest.json").read_text())["lora_slots"]  # one block, chunked or whole
    factor_names = {n for pair in block["inputs"].values() for n in pair}
    held = {}
    for name in chunks["components"]:
        ins = {i["name"]: i["shape"] for i in man["components"][name]["inputs"]}
        for m, (down, up) in block["inputs"].items():
            if down in ins:
                assert up in ins and ins[down][1] == 4 and ins[up][0] == 4 and m not in held
                held[m] = name
        rep = report["components"][name]
        assert rep["fully_accelerated"] is True and rep["details"]["parity"]["fp16"]["cosine"] > 0.999, name
        assert rep["ops"]["BATCH_MATMUL"] >= 2 * sum(v == name for v in held.values())
    assert set(held) == set(block["targets"]) and len(set(held.values())) == 2  # every slot in one chunk, both chunks slotted
    assert factor_names <= {i["name"] for i in chunks["inputs"]}  # the whole UNet's inputs: the runners' table starts with them
    stage = next(s for s in man["pipeline"]["stages"] if s["kind"] == "denoise")
    assert all(stage["inputs"][n] == "lora_factors" for n in factor_names)
    assert chunks["parity"]["fp32"]["cosine"] > 0.9999  # the chunks in sequence on the delegate, fed the golden factors


def _image(bundle: Path, lora_item, accelerator: str = "cpu", precision=None) -> np.ndarray:
    from pocketdiff.runtime.run_bundle import BundleRunner

    options = {"precision": precision} if precision else None
    with BundleRunner(bundle, accelerator, gpu_cache=False, gpu_options=options) as runner:
        runner.set_lora(*lora_item) if lora_item else runner.set_lora(None)
        image, stats = runner.run(PROMPT, seed=3)
    assert accelerator == "cpu" or stats["fully_accelerated"] is True
    return image


@pytest.mark.parametrize("layout", ["chunks", "layered"])
def test_a_lora_fed_to_the_chunks_matches_the_fused_bundle_and_the_whole_slotted_unet(bundles, lora, layout):
    """>= 40 dB against the fused bundle (the LoRA in the UNet's weights) and the whole slotted one fed the same LoRA, and
    with no LoRA the plain chunked bundle within 1e-5 (test_lora_slots.py's thresholds); the LoRA changes the image
    (< 30 dB): not vacuous."""
    with_lora, none = _image(bundles[layout], (lora, 1.0)), _image(bundles[layout], None)
    fused, plain, whole = _image(bundles["fused"], None), _image(bundles["plain_chunks"], None), _image(bundles["slots"], (lora, 1.0))
    assert psnr(with_lora, plain) < 30
    assert psnr(with_lora, fused) >= 40, psnr(with_lora, fused)
    assert psnr(with_lora, whole) >= 40, psnr(with_lora, whole)
    assert float(np.abs(none - plain).max()) <= 1e-5


def test_run_bundle_on_the_gpu_feeds_the_chunks(bundles, lora):
    """fp32 on lavapipe: every chunk fully accelerated, >= 40 dB against the fused bundle on the GPU."""
    got, fused = _image(bundles["chunks"], (lora, 1.0), "gpu", "fp32"), _image(bundles["fused"], None, "gpu", "fp32")
    assert psnr(got, fused) >= 40, psnr(got, fused)


def test_a_slot_missing_from_every_chunk_is_one_line(bundles, lora, tmp_path, capsys):
    bundle = tmp_path / "bundle"
    shutil.copytree(bundles["chunks"], bundle)
    man = json.loads((bundle / "manifest.json").read_text())
    ghost = "mid_block.attentions.0.transformer_blocks.0.attn1.to_r"
    man["lora_slots"]["targets"].append(ghost)
    man["lora_slots"]["inputs"][ghost] = list(slot_input_names(ghost))
    (bundle / "manifest.json").write_text(json.dumps(man))
    for flags in ([], ["--lora", str(lora)]):
        out = tmp_path / f"run{len(flags)}"
        code = cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--accelerator", "cpu", *flags])
        err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
        assert code == 2 and len(err) == 1 and ghost in err[0] and "no component declares" in err[0], err
        assert not out.exists()
