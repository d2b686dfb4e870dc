"""The conditioning seam in calibration: an SDXL-style UNet's pooled embeddings and time ids are recorded
with the other UNet inputs (cond and uncond halves) and replayed by `unet_forward`."""
from __future__ import annotations

import pytest
import torch

from tiny_sdxl import POOLED, ddim_scheduler, xl_cond as _xl_cond, xl_unet  # tests/tiny_sdxl.py

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_text_time_calibration_records_and_replays_every_field():
    from pocketdiff.compress.quant.blocks import unet_forward
    from pocketdiff.compress.quant.calib_data import collect_unet_inputs

    unet, sched = xl_unet(), ddim_scheduler()
    cond, uncond = _xl_cond(2, 6), _xl_cond(1, 7)
    calib = collect_unet_inputs(unet, sched, cond, uncond, steps=2, guidance_scale=3.0, latent_shape=(4, 8, 8), seed=0)
    assert len(calib) == 8 and calib.text_embeds.shape == (8, POOLED) and calib.time_ids.shape == (8, 6)
    assert torch.equal(calib.time_ids[:2], uncond.time_ids.expand(2, 6)) and torch.equal(calib.time_ids[2:4], cond.time_ids)
    b = calib.batch_kwargs(0, 4, "cpu", torch.float32)
    with torch.no_grad():
        ref = unet(b["sample"], b["timestep"], encoder_hidden_states=b["encoder_hidden_states"],
                      added_cond_kwargs={"text_embeds": b["text_embeds"], "time_ids": b["time_ids"]}).sample
        assert torch.equal(unet_forward(unet, b), ref)
    assert set(calib.select(torch.tensor([0, 5])).tensors()) >= {"text_embeds", "time_ids"}
