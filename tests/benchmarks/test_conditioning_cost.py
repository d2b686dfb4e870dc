"""benchmarks/conditioning_cost.py measures the SDXL-style added embedding as its own graph: it must be the layers the
UNet computes (checked against diffusers' UNet on the tiny SDXL model), and it runs fully on the GPU delegate."""
from __future__ import annotations

import torch
from script_module import load_script  # tests/script_module.py
from tiny_sdxl import POOLED, TIME_DIM, xl_cond, xl_unet


def test_the_measured_graph_is_the_unets_added_embedding():
    cc = load_script("benchmarks/conditioning_cost.py", "conditioning_cost_bench")
    unet = xl_unet()
    width = unet.add_embedding.linear_2.out_features
    module = cc.added_embedding_module(POOLED, width, time_channels=TIME_DIM)
    missing = module.load_state_dict(unet.state_dict(), strict=False).missing_keys
    assert missing == []  # every layer of the measured graph is one of the UNet's, by name
    cond = xl_cond(2, seed=5)
    row = torch.randn(2, width, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = row + unet.get_aug_embed(row, cond.prompt_embeds, {"text_embeds": cond.pooled_embeds,
                                                                 "time_ids": cond.time_ids})
        got = module(row, cond.pooled_embeds, cond.time_ids)
        moved = module(row, cond.pooled_embeds, cond.time_ids + 8.0)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)  # the same float32 ops in the same order
    assert (moved - got).abs().max() > 1e-4  # the time ids reach the output


def test_it_exports_and_runs_fully_on_the_gpu_delegate(gpu_delegate, tmp_path):
    cc = load_script("benchmarks/conditioning_cost.py", "conditioning_cost_bench")
    cc.export(tmp_path, widths={"small": (16, 32)})  # the same code path at toy width
    res = cc.measure(tmp_path, _smoke_bundle(), tmp_path / "r.json", repeats=2)
    assert [r["graph"] for r in res["rows"]] == ["added_embedding_small"]  # what export made, not the module's table
    row = res["rows"][0]
    assert row["fully_accelerated"] and row["cosine_vs_torch"] > 0.999
    assert row["unet_step_ms"] > 0 and len(res["unet_step"]) == 1


def _smoke_bundle():
    from script_module import ROOT
    return ROOT / "tests" / "web" / "smoke_bundle"
