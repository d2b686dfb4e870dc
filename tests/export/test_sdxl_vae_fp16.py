"""SDXL's VAE decoder leaves the fp16 range (issue 63 item 2; why `sdxl-vae-fp16-fix` exists): its residual stream
grows past 65504 and the norms that read it normalise it away, so the fp32 image is fine and an fp16 one is not.
Emulated on the tiny SDXL VAE (arch tiny_xl) by multiplying its decoder's residual stream by 2^14
(`rescale_residual_stream`: every writer of the stream scaled, every norm reading it scale-invariant, so the fp32
output is the same function). Through the export verb's per-component path (`export_component`: rewrites,
litert-torch, the LiteRT GPU delegate at its default fp16, the named parity thresholds):
- with the default rewrites (fp16-safe GroupNorm moments, no stream scale) the decoder's fp16 output is not finite:
  the export stops at the fp16 parity check, naming the component;
- with the stream scale export's fp16 scan picks (`rewrites.residual_scale_auto`: `scan_pipeline` samples the
  pipeline, the power of two that brings the decoder's stream peak under 65504 / 16), it is finite and within the
  fp16 parity thresholds. The scan measures that peak in float32: fp16-emulated, the stream reads inf.
What SDXL base's real decoder does is for its real weights to show (the scan's `unmitigated` ops name any overflow
outside the stream, e.g. inside a resnet branch, which the stream scale does not reach)."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pocketdiff.errors import ParityError, PocketdiffError
from pocketdiff.export.components import VaeDecoderGraph
from pocketdiff.export.exporter import export_component
from pocketdiff.export.fp16scan import FP16_MAX, Fp16Scanner, residual_scale_for, scan_pipeline, stream_peaks
from pocketdiff.export.parity import ParityConfig
from pocketdiff.export.residual_scale import rescale_residual_stream
from pocketdiff.export.rewrites import RewriteConfig
from pocketdiff.export.verb import VerifyConfig
from pocketdiff.models import ModelConfig, build_pipeline, build_vae, perturb_norm_affines

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

HOT = 2.0 ** 14  # the stream's growth that pushes the tiny decoder's peak (about 11) past the fp16 maximum


@pytest.fixture(scope="module")
def decoders():
    """(the tiny SDXL VAE, its hot twin, latents, the plain decoder's fp32 image, the hot decoder's fp16 scan)."""
    vae = build_vae("tiny_xl", 32, 0).eval()
    perturb_norm_affines(vae, 0)  # trained-like norms (identity affines fold into ops the delegate rejects)
    hot = copy.deepcopy(vae)
    rescale_residual_stream(hot.decoder, HOT)
    z = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    scanner = Fp16Scanner()  # fp16 emulation, as export's fp16_scan
    graph = VaeDecoderGraph(copy.deepcopy(hot)).eval()
    with torch.no_grad():
        ref = VaeDecoderGraph(vae).eval()(z)
        hot_fp32 = VaeDecoderGraph(hot).eval()(z)
        scanner.attach(graph, "vae_decoder")
        emulated = graph(z)
        scanner.detach()
    # export's scan (export/verb.py): the tiny SDXL pipeline, the hot VAE in it, sampled under residual_scale_auto
    pipe = build_pipeline(ModelConfig(arch="tiny_xl"))
    pipe.register_modules(vae=hot)
    scan = scan_pipeline(pipe, ["a red circle"], steps=1, guidance_scale=3.0, seed=0,
                         rewrites=dataclasses.replace(RewriteConfig(), residual_scale_auto=True))
    return {"vae": vae, "hot": hot, "z": z, "ref": ref, "hot_fp32": hot_fp32, "emulated": emulated, "emulated_scan": scanner,
            "scan": scan}


def _export(graph, z, path, rewrites):
    return export_component("vae_decoder", graph, {"latents": z}, path, rewrites, "fp16",
                            VerifyConfig(precisions=["fp16", "fp32"]), ParityConfig())


def test_the_hot_decoder_is_the_same_image_with_its_stream_past_fp16(decoders):
    # a power of two scales exactly: the fp32 images agree to float32 rounding of the norms' eps
    torch.testing.assert_close(decoders["hot_fp32"], decoders["ref"], rtol=1e-5, atol=1e-5)
    assert not torch.isfinite(decoders["emulated"]).all()  # fp16-emulated, the image is not finite ...
    emulated_peak = stream_peaks({"stats": decoders["emulated_scan"].stats})["vae_decoder"]
    assert emulated_peak == float("inf")  # ... and the stream peak reads inf: no scale can be picked from it
    with pytest.raises(PocketdiffError, match="rewrites.residual_scale_auto: the residual stream's peak is inf"):
        residual_scale_for(emulated_peak)
    scan = decoders["scan"]  # export's scan under residual_scale_auto: float32 magnitudes
    assert scan["emulated"] is False and scan["overflowing_ops"] > 0
    peak = stream_peaks(scan)["vae_decoder"]
    assert FP16_MAX < peak < float("inf")
    s = residual_scale_for(peak)
    assert s <= 2.0 ** -5 and peak * s <= FP16_MAX / 16  # the pick: the peak at least 16x under the maximum


def test_without_the_stream_scale_the_export_stops_at_the_fp16_parity_check(decoders, gpu_delegate, tmp_path):
    with pytest.raises(ParityError, match=r"vae_decoder: \d+ NaN/Inf values in the delegate's fp16 output"):
        _export(VaeDecoderGraph(copy.deepcopy(decoders["hot"])).eval(), decoders["z"], tmp_path / "plain.tflite", RewriteConfig())


def test_the_scans_stream_scale_keeps_the_fp16_decoder_finite_and_close(decoders, gpu_delegate, tmp_path):
    s = residual_scale_for(stream_peaks(decoders["scan"])["vae_decoder"])
    rep = _export(VaeDecoderGraph(copy.deepcopy(decoders["hot"])).eval(), decoders["z"], tmp_path / "scaled.tflite",
                  dataclasses.replace(RewriteConfig(), residual_scale=s))
    assert rep["fully_accelerated"] and rep["parity_failures"] == []
    fp16 = rep["parity"]["fp16"]
    # ParityConfig's fp16 bars (cosine >= 0.999, PSNR >= 30 dB) passed; measured on lavapipe: max |diff| 0.008 of [0, 1]
    assert fp16["finite"] and fp16["cosine"] >= 0.999 and fp16["psnr_db"] >= 30.0
    assert rep["parity"]["fp32"]["psnr_db"] >= 60.0
