"""LoRA slots (issue 65 item 3): `export lora_slots: {rank, targets}` makes the UNet's attention projections take LoRA
factors as graph inputs (fully accelerated on the GPU delegate, lavapipe, at fp16 and fp32: the export enforces it);
run-bundle `--lora FILE [--lora-scale S]` / `BundleRunner.set_lora` feed a LoRA's factors by role, no model reloaded.

Parity: the slotted bundle fed a LoRA against a bundle exported with the same LoRA fused (`model.lora`), and the
slotted bundle with no LoRA against the plain bundle. All three bundles are the shipped tiny teacher at fp32 weights
(the text encoder and decoder conversions shared: tests/conftest.py), exported once a session for this file and
test_lora_slots_chunks.py (tests/lora_bundles.py). Bad input: one line, exit 2, nothing written.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from lora_bundles import PROMPT, peft_lora, psnr  # tests/lora_bundles.py: the bundles, shared with test_lora_slots_chunks.py
from safetensors.torch import save_file

from pocketdiff.cli import main as cli_main


@pytest.fixture(scope="module")
def lora(lora_bundles) -> Path:
    return lora_bundles.lora


@pytest.fixture(scope="module")
def bundles(lora_bundles) -> dict:
    """slots (rank 4 on every attention projection; delegate-checked at fp16 and fp32), plain and fused (the LoRA in
    the weights): tests/lora_bundles.py LAYOUTS. The reference bundles skip the delegate check: they only draw reference
    images. Exported here (once a session: test_lora_slots_chunks.py reads slots and fused too)."""
    return {name: lora_bundles[name] for name in ("slots", "plain", "fused")}


def _images(bundle: Path, accelerator: str, loras: list, precision=None) -> list:
    """One image per LoRA setting (path, scale) or None, all from one runner (the LoRA swapped between images)."""
    from pocketdiff.runtime.run_bundle import BundleRunner

    out = []
    options = {"precision": precision} if precision else None
    with BundleRunner(bundle, accelerator, gpu_cache=False, gpu_options=options) as runner:
        for item in loras:
            runner.set_lora(*item) if item is not None else runner.set_lora(None)
            image, stats = runner.run(PROMPT, seed=3)
            out.append((image, stats))
    return out


def test_the_slotted_unet_takes_every_attention_projections_factors_fully_accelerated(bundles):
    man = json.loads((bundles["slots"] / "manifest.json").read_text())
    report = json.loads((bundles["slots"] / "report.json").read_text())
    block = man["lora_slots"]
    assert block["rank"] == 4 and len(block["targets"]) == 32  # 4 transformer blocks x (attn1, attn2) x (q, k, v, out)
    # every target is an attention projection's Linear: to_out's first module (to_out.0), never the to_out list itself
    projections = tuple(f".{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0"))
    assert all(t.endswith(projections) for t in block["targets"]), block["targets"]
    unet = report["components"]["unet"]
    assert unet["fully_accelerated"] is True  # the export requires it: on lavapipe, at fp16 and fp32 (verify.precisions)
    parity = unet["details"]["parity"]
    assert set(parity) == {"fp16", "fp32"} and parity["fp16"]["cosine"] > 0.9999
    assert unet["ops"]["BATCH_MATMUL"] >= 2 * 32  # the two factor matmuls of each slot (the attention's own besides)
    ins = {i["name"]: i["shape"] for i in man["components"]["unet"]["inputs"]}
    stage = next(s for s in man["pipeline"]["stages"] if s["kind"] == "denoise")
    for module, (down, up) in block["inputs"].items():
        assert ins[down][1] == 4 and ins[up][0] == 4 and stage["inputs"][down] == stage["inputs"][up] == "lora_factors"
    golden = np.load(bundles["slots"] / "golden" / "unet.npz")
    assert float(np.abs(golden[f"input_{block['inputs'][block['targets'][0]][1]}"]).max()) > 0  # the parity ran the branch


@pytest.mark.parametrize("accelerator,precision", [("cpu", None), ("gpu", "fp32"), ("gpu", None)])
def test_a_swapped_lora_matches_the_fused_bundle_and_no_lora_the_plain_one(bundles, lora, accelerator, precision):
    """One slotted runner: no LoRA, the LoRA, no LoRA again (swapped between images), against the fused bundle's image
    and the plain bundle's. On the CPU and on the GPU at fp32 (measured > 100 dB with a stronger LoRA): >= 40 dB, and with
    no LoRA the plain image within 1e-5 (the same graph but for zero branches: summation order only). On the GPU at its
    default fp16 precision two different programs differ by fp16's own error, which this LoRA's images have at ~30 dB
    even within one bundle (fp16 vs fp32 precision): the slots must add nothing to it (within 3 dB)."""
    (none_1, _), (with_lora, stats), (none_2, _) = _images(bundles["slots"], accelerator, [None, (lora, 1.0), None], precision)
    [(fused, _)] = _images(bundles["fused"], accelerator, [None], precision)
    [(plain, _)] = _images(bundles["plain"], accelerator, [None], precision)
    assert psnr(with_lora, plain) < 30  # the LoRA changes the image: the parity below is not vacuous
    assert np.array_equal(none_1, none_2)  # back to zero factors: the first image again
    if accelerator == "gpu":
        assert stats["fully_accelerated"] is True
    if accelerator == "cpu" or precision == "fp32":
        assert psnr(with_lora, fused) >= 40, psnr(with_lora, fused)
        assert float(np.abs(none_1 - plain).max()) <= 1e-5
        return
    [(fused_fp32, _)] = _images(bundles["fused"], "cpu", [None])
    floor = psnr(fused, fused_fp32)  # fp16's own error on the fused bundle
    assert psnr(with_lora, fused) >= min(40.0, floor - 3.0), (psnr(with_lora, fused), floor)
    assert psnr(none_1, plain) >= min(40.0, psnr(plain, _images(bundles["plain"], "cpu", [None])[0][0]) - 3.0)


def test_run_bundle_lora_flag_writes_the_lora_in_its_report(bundles, lora, tmp_path):
    out = tmp_path / "run"
    code = cli_main(["run-bundle", str(bundles["slots"]), "--prompt", PROMPT, "--output", str(out), "--lora", str(lora),
                     "--lora-scale", "0.5", "--accelerator", "cpu", "--no-gpu-cache"])
    report = json.loads((out / "report.json").read_text())
    assert code == 0 and report["lora"] == {"file": str(lora.resolve()), "scale": 0.5, "layers": 32}


def test_a_smaller_rank_is_zero_padded_and_a_kohya_file_reads_the_same(bundles, tmp_path):
    """A rank-2 diffusers file and the same factors in kohya's names (with alpha keys) feed the same factors, padded."""
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.lora_slots import LoraFeeds

    man = load_manifest(bundles["slots"])
    some = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q", "up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0"]
    peft = peft_lora(tmp_path / "r2.safetensors", rank=2, modules=some)
    from safetensors.torch import load_file

    state = load_file(str(peft))
    kohya = {}
    for k, v in state.items():
        base = "lora_unet_" + k.removeprefix("unet.").rsplit(".lora_", 1)[0].replace(".", "_")
        kohya[f"{base}.lora_{'down' if '.lora_A.' in k else 'up'}.weight"] = v
        kohya[f"{base}.alpha"] = torch.tensor(4.0)
    save_file(kohya, str(tmp_path / "r2_kohya.safetensors"))
    a, b = LoraFeeds(man, "b"), LoraFeeds(man, "b")
    a.load(peft, 1.0)
    b.load(tmp_path / "r2_kohya.safetensors", 1.0)
    for name in a.feeds:
        np.testing.assert_allclose(a.feeds[name], b.feeds[name], rtol=1e-6, atol=0)
    from pocketdiff.lora_keys import slot_input_names

    down, up = slot_input_names(some[0])
    assert a.feeds[down].shape == (32, 4) and not a.feeds[down][:, 2:].any() and a.feeds[down][:, :2].any()
    np.testing.assert_allclose(a.feeds[up][:2], state[f"unet.{some[0]}.lora_B.weight"].numpy().T * 2.0, rtol=1e-6)  # alpha 4 / r 2
    untouched = slot_input_names("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k")
    assert not any(a.feeds[n].any() for n in untouched)


def _refusal(capsys, bundle: Path, out: Path, *flags) -> str:
    code = cli_main(["run-bundle", str(bundle), "--prompt", PROMPT, "--output", str(out), "--accelerator", "cpu", *flags])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert not out.exists()
    return err[0]


def test_bad_loras_are_refused_in_one_line_and_nothing_is_written(bundles, lora, tmp_path, capsys):
    slots, out = bundles["slots"], tmp_path / "run"
    pickle = tmp_path / "style.ckpt"
    pickle.write_bytes(b"\x80\x04K\x01.")  # never opened: refused by its name
    assert "pickle" in _refusal(capsys, slots, out, "--lora", str(pickle))
    disguised = tmp_path / "disguised.safetensors"
    disguised.write_bytes(b"\x80\x04\x95" + bytes(40))  # a pickle's first bytes
    assert "pickle" in _refusal(capsys, slots, out, "--lora", str(disguised))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(lora.read_bytes()[:-100])
    assert "truncated" in _refusal(capsys, slots, out, "--lora", str(corrupt))
    # another base: SD-1.5 sized factors on a module this UNet has, then a module it has not
    key = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    save_file({f"{key}.lora_down.weight": torch.ones(4, 320), f"{key}.lora_up.weight": torch.ones(320, 4)}, str(tmp_path / "sd15.safetensors"))
    line = _refusal(capsys, slots, out, "--lora", str(tmp_path / "sd15.safetensors"))
    assert f"{key}.lora_down.weight" in line and "does not fit" in line
    other = "unet.down_blocks.2.attentions.1.transformer_blocks.0.attn1.to_q"
    save_file({f"{other}.lora_A.weight": torch.ones(4, 32), f"{other}.lora_B.weight": torch.ones(32, 4)}, str(tmp_path / "o.safetensors"))
    line = _refusal(capsys, slots, out, "--lora", str(tmp_path / "o.safetensors"))
    assert f"{other}.lora_A.weight" in line and "no LoRA slot" in line
    # a rank over the slots'
    line = _refusal(capsys, slots, out, "--lora", str(peft_lora(tmp_path / "r8.safetensors", rank=8)))
    assert "rank 8, over the bundle's slots' rank 4" in line
    # a text-encoder LoRA, a plain bundle, a scale without a LoRA
    te = "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    save_file({f"{te}.lora_down.weight": torch.ones(4, 64), f"{te}.lora_up.weight": torch.ones(64, 4)}, str(tmp_path / "te.safetensors"))
    assert "adapts the text_encoder" in _refusal(capsys, slots, out, "--lora", str(tmp_path / "te.safetensors"))
    assert "no LoRA slots" in _refusal(capsys, bundles["plain"], out, "--lora", str(lora))
    assert "--lora-scale" in _refusal(capsys, slots, out, "--lora-scale", "0.5")


def test_a_refused_swap_keeps_the_lora_fed_before(bundles, lora, tmp_path):
    from pocketdiff.errors import PocketdiffError
    from pocketdiff.runtime.bundle import load_manifest
    from pocketdiff.runtime.lora_slots import LoraFeeds

    feeds = LoraFeeds(load_manifest(bundles["slots"]), "b")
    feeds.load(lora, 0.7)
    before = {k: v.copy() for k, v in feeds.feeds.items()}
    with pytest.raises(PocketdiffError, match="rank 8"):
        feeds.load(peft_lora(tmp_path / "r8.safetensors", rank=8), 1.0)
    assert feeds.loaded["scale"] == 0.7 and all(np.array_equal(before[k], feeds.feeds[k]) for k in before)


def test_export_refuses_bad_lora_slots_in_one_line(export_config_error):
    assert "lora_slots.rank" in export_config_error(["lora_slots={rank: 0, targets: [attn]}"])
    assert "lora_slots.targets" in export_config_error(["lora_slots={rank: 4, targets: [ff]}"])
    line = export_config_error(["lora_slots={rank: 4, targets: [attn]}", "components=[text_encoder,vae_decoder]"])
    assert line.count("\n") == 0 and "lora_slots" in line and "components" in line  # a chunked UNet takes slots: test_lora_slots_chunks.py
