"""The SDXL family through export, run-bundle and verify-bundle (issue 63 part 1), on a tiny SDXL-shaped pipeline built
from config (arch tiny_xl), saved as a stock StableDiffusionXLPipeline folder with SDXL base's
force_zeros_for_empty_prompt: true and exported from that folder (the real loading path; tests/conftest.py `sdxl_bundle`). Both text encoders, the UNet (pooled embeddings and time ids as declared inputs) and the decoder run
fully on the GPU delegate (lavapipe); the bundle runs with no SDXL-specific runner code: its pipeline block is data.

Parity with diffusers' StableDiffusionXLPipeline (same prompt, no negative prompt: the unconditional rows are zeros
under the folder's flag, the manifest's pipeline.conditioning.zero_unconditional; DDIM, 4 steps, guidance 3,
size / crop ids (32, 32) / (0, 0) / (32, 32), the bundle's initial latents): the torch path (encode_conditioning +
ddim_sample + decode_latents) is the same arithmetic (measured bit-identical; >= 60 dB allows other CPUs' kernels);
the bundle on the CPU runs fp16-stored weights in float32 (measured 74 dB, cosine 1 - 5e-8: >= 50 dB, >= 0.9999);
on the GPU delegate it computes in fp16 (measured 56 dB, cosine 0.999996: >= 40 dB, >= 0.9995)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tiny_sdxl import SDXL_PROMPT as PROMPT, SDXL_SCALE as SCALE, SDXL_STEPS as STEPS  # tests/tiny_sdxl.py

SEED = 3


@pytest.fixture(scope="module")
def xl(sdxl_bundle):
    """{"folder": the saved tiny SDXL pipeline (force_zeros_for_empty_prompt true), "out": its bundle, "report": export's
    report.json}: tests/conftest.py's session fixture, shared with tests/web/test_node_runner_sdxl.py."""
    return sdxl_bundle


def test_the_bundle_declares_the_sdxl_pipeline(xl):
    man = json.loads((xl["out"] / "manifest.json").read_text())
    block = man["pipeline"]
    assert block["family"] == "sdxl"
    assert block["conditioning"] == {"time_ids": [32.0, 32.0, 0.0, 0.0, 32.0, 32.0], "zero_unconditional": True}  # the folder's flag
    assert [(s["stage"], s["component"], s.get("tokenizer")) for s in block["stages"]] == [
        ("encode_prompt", "text_encoder", "tokenizer"), ("encode_prompt_2", "text_encoder_2", "tokenizer_2"),
        ("denoise", "unet", None), ("decode", "vae_decoder", None)]
    assert block["stages"][1]["outputs"] == ["prompt_embeds", "pooled_embeds"]
    assert block["stages"][2]["inputs"] == {"sample": "latents", "timestep": "timestep_embedding", "encoder_hidden_states": "prompt_embeds",
                                            "text_embeds": "pooled_embeds", "time_ids": "time_ids"}
    comps = man["components"]
    assert all(c["fully_accelerated"] for c in comps.values()) and set(comps) == {"text_encoder", "text_encoder_2", "unet", "vae_decoder"}
    assert [o["shape"] for o in comps["text_encoder_2"]["outputs"]] == [[1, 77, 32], [1, 32]]
    assert [i["shape"] for i in comps["unet"]["inputs"]][2:] == [[2, 77, 64], [2, 32], [2, 6]]  # 32 + 32 wide states
    assert (xl["out"] / "tokenizer_2" / "tokenizer.json").is_file() and man["tokenizer_2"]["golden"]["prompt"] == PROMPT
    # the second encoder's parity is its worse output's (hidden states and the pooled embedding each checked)
    assert xl["report"]["components"]["text_encoder_2"]["details"]["parity"]["fp16"]["output"] in ("output_0", "output_1")


def _diffusers_image(folder, latents: np.ndarray) -> np.ndarray:
    from diffusers import StableDiffusionXLPipeline

    stock = StableDiffusionXLPipeline.from_pretrained(str(folder))
    stock.set_progress_bar_config(disable=True)
    assert stock.config.force_zeros_for_empty_prompt  # no negative prompt: zero unconditional rows
    return stock(PROMPT, num_inference_steps=STEPS, guidance_scale=SCALE, latents=torch.from_numpy(latents),
                 original_size=(32, 32), crops_coords_top_left=(0, 0), target_size=(32, 32), output_type="np").images[0]


def _torch_image(folder, latents: np.ndarray) -> np.ndarray:
    from pocketdiff.conditioning import encode_conditioning, encode_unconditional
    from pocketdiff.models import load_pipeline
    from pocketdiff.sampling import ddim_sample, decode_latents

    pipe = load_pipeline(str(folder))
    with torch.no_grad():
        cond, uncond = encode_conditioning(pipe, [PROMPT]), encode_unconditional(pipe, [""])
        assert float(uncond.prompt_embeds.abs().max()) == 0.0 and float(uncond.time_ids.abs().max()) > 0  # the flag's rule
        lat = ddim_sample(pipe.unet, pipe.scheduler, cond, uncond, steps=STEPS, guidance_scale=SCALE, latents=torch.from_numpy(latents))
        return decode_latents(pipe.vae, lat)[0].permute(1, 2, 0).numpy()


def test_torch_path_and_bundle_match_stock_sdxl_pipeline(xl):
    from pocketdiff.runtime.parity import metrics
    from pocketdiff.runtime.run_bundle import BundleRunner

    latents = np.random.default_rng(SEED).standard_normal((1, 4, 8, 8)).astype(np.float32)  # the bundle's own draw
    ref = _diffusers_image(xl["folder"], latents)
    assert ref.std() > 0.05  # a picture, not a flat field
    m = metrics(ref, _torch_image(xl["folder"], latents))
    assert m["psnr_db"] >= 60 and m["cosine"] >= 0.99999, m
    for accelerator, psnr, cosine in (("cpu", 50.0, 0.9999), ("gpu", 40.0, 0.9995)):
        with BundleRunner(xl["out"], accelerator, gpu_cache=False) as runner:
            image, stats = runner.run(PROMPT, seed=SEED, init_latents=latents)
            own, _ = runner.run(PROMPT, seed=SEED)  # the seed's latents are the ones fed
        m = metrics(ref, image)
        assert m["psnr_db"] >= psnr and m["cosine"] >= cosine, (accelerator, m)
        np.testing.assert_array_equal(own, image)
        assert stats["finite"] and (accelerator == "cpu" or stats["fully_accelerated"])


def test_verify_bundle_runs_both_text_encoders(xl):
    from pocketdiff.runtime.verify_bundle import verify_bundle

    result = verify_bundle(xl["out"])  # raises on a failed check; both of text_encoder_2's outputs are compared
    assert result["ok"] and set(result["components"]) == {"text_encoder", "text_encoder_2", "unet", "vae_decoder"}
    assert all(c["ok"] for c in result["components"].values())


def test_time_ids_of_the_wrong_length_are_refused_before_any_model_loads(xl, tmp_path, capsys):
    from pocketdiff.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(xl["out"], bad)
    man = json.loads((bad / "manifest.json").read_text())
    man["pipeline"]["conditioning"]["time_ids"] = [32.0, 32.0, 0.0, 0.0, 6.0]  # a refiner's five
    (bad / "manifest.json").write_text(json.dumps(man))
    assert main(["run-bundle", str(bad), "--prompt", "x", "--output", str(tmp_path / "img"), "--accelerator", "cpu"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("INFO", "I0000", "W0000"))]
    assert len(err) == 1 and "components.unet.inputs.time_ids" in err[0] and "pipeline.conditioning.time_ids" in err[0], err
    assert not (tmp_path / "img").exists()
