"""The exported UNet graph takes its family's conditioning fields as inputs (issue 61 item 2): an SDXL-style UNet
(`addition_embed_type: text_time`) takes the pooled text embedding and the six size / crop time ids, and computes its
prompt-dependent added embedding inside the graph, beside the timestep's table row fed from outside. Checked here on
the tiny SDXL-style UNet: the graph equals diffusers' UNet called with added_cond_kwargs, and through litert-torch it
runs fully on the LiteRT GPU delegate (lavapipe) with those inputs by name, within a stated tolerance of torch."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tiny_sdxl import xl_cond, xl_unet

from pocketdiff.export.components import UNetGraph, added_conditioning_inputs, time_embedding_table
from pocketdiff.export.synthetic import round_norm_affines


def _perturbed_unet():
    """The tiny SDXL UNet with non-identity norm affines (identity ones fold into BROADCAST_TO, DESIGN.md)."""
    unet = xl_unet()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in unet.modules():
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) and m.weight is not None:
                m.weight.add_(0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=g))
    round_norm_affines(unet)
    return unet


def _inputs(unet, batch: int = 2):
    cond = xl_cond(batch, seed=3)
    x = torch.randn(batch, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    t = 501
    row = torch.from_numpy(time_embedding_table(unet, 1000)[[t] * batch])
    return cond, x, t, row


def test_an_sdxl_unet_graph_takes_pooled_embeddings_and_time_ids_and_equals_diffusers():
    unet = _perturbed_unet()
    assert added_conditioning_inputs(unet) == ("text_embeds", "time_ids")
    cond, x, t, row = _inputs(unet)
    with torch.no_grad():
        ref = unet(x, torch.full((2,), t), encoder_hidden_states=cond.prompt_embeds, return_dict=False,
                   added_cond_kwargs={"text_embeds": cond.pooled_embeds, "time_ids": cond.time_ids})[0]
        graph = UNetGraph(copy.deepcopy(unet), external_time_embedding=True)
        assert graph.extra_inputs == ("text_embeds", "time_ids")
        got = graph(x, row, cond.prompt_embeds, cond.pooled_embeds, cond.time_ids)
        other = graph(x, row, cond.prompt_embeds, cond.pooled_embeds, cond.time_ids + 16.0)  # the ids reach the output
    # the same arithmetic in another order (the table row vs the in-graph time MLP): float32 rounding only
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert (other - got).abs().max() > 1e-4


def test_the_sdxl_unet_graph_runs_fully_on_the_gpu_delegate_with_its_conditioning_inputs(gpu_delegate, tmp_path):
    from pocketdiff.export.convert import to_tflite
    from pocketdiff.runtime.delegate import run_on_delegate
    from pocketdiff.runtime.manifest_check import tflite_io
    from pocketdiff.runtime.parity import metrics

    unet = _perturbed_unet()
    cond, x, t, row = _inputs(unet)
    graph = UNetGraph(copy.deepcopy(unet), external_time_embedding=True).eval()
    inputs = {"sample": x, "timestep": row, "encoder_hidden_states": cond.prompt_embeds,
              "text_embeds": cond.pooled_embeds, "time_ids": cond.time_ids}
    with torch.no_grad():
        ref = graph(*inputs.values()).numpy()
    path = tmp_path / "unet.tflite"
    to_tflite(graph, tuple(inputs.values()), path)
    io = tflite_io(path)
    assert [i["shape"] for i in io["inputs"]] == [list(v.shape) for v in inputs.values()]
    run = run_on_delegate(path, [v.numpy() for v in inputs.values()], precisions=["fp32"])
    assert run.compiled and run.fully_accelerated, [f"{r.op}: {r.reason}" for r in run.rejected]
    m = metrics(ref, run.outputs["fp32"][0])
    assert m["cosine"] > 0.9999, m  # the delegate's float32 kernels against torch: rounding only
