"""The fp16 overflow scan names the ops whose values or intermediate sums leave fp16."""
from __future__ import annotations

import torch
from torch import nn

from pocketdiff.export.fp16scan import FP16_MAX, Fp16Scanner
from pocketdiff.export.rewrites import RewriteConfig


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(8, 8)
        self.norm = nn.GroupNorm(2, 8)
        self.act = nn.GELU(approximate="tanh")
        self.small = nn.Linear(8, 4)
        with torch.no_grad():
            self.big.weight.fill_(300.0)  # 8 * 300 * 30 = 72000 > 65504
            self.big.bias.zero_()

    def forward(self, x):
        h = self.big(x)  # [N, 8]
        h = self.norm(h[:, :, None])[:, :, 0]
        return self.small(self.act(h * 150.0))


def test_scan_names_overflowing_ops_and_their_mitigation():
    net = Net()
    x = torch.full((2, 8), 30.0)
    x[1] = torch.linspace(-30, 30, 8)
    sc = Fp16Scanner(emulate=True)
    sc.attach(net, "net")
    with torch.no_grad():
        net(x)
    sc.detach()
    rep = sc.report(RewriteConfig())
    ops = {e["module"]: e for e in rep["ops"]}
    assert "net.big" in ops and ops["net.big"]["over"]["max_abs"] > FP16_MAX
    assert "accumulation" in ops["net.big"]["over"]
    assert rep["first_overflow"].startswith("net.big")
    assert not ops["net.big"]["mitigated_by"]  # an activation above 65504: no rewrite removes it
    assert rep["overflowing_ops"] >= 1 and rep["unmitigated"] >= 1


def test_scan_flags_norm_squares_and_gelu_cubes_with_their_rewrites():
    net = Net()
    with torch.no_grad():
        net.big.weight.copy_(torch.eye(8))
    x = torch.zeros(1, 8)
    x[0, :2] = 1000.0  # a group [1000, 1000, 0, 0]: deviations 500, squares 2.5e5
    sc = Fp16Scanner(emulate=False)
    sc.attach(net, "net")
    with torch.no_grad():
        net(x)
    rep = sc.report(RewriteConfig())
    ops = {e["module"]: e for e in rep["ops"]}
    assert "square" in ops["net.norm"]["over"]
    assert ops["net.norm"]["mitigated_by"] == ["rewrites.group_norm_fp16_safe"]
    assert "cube" in ops["net.act"]["over"]  # GELU input ~ +-150: 0.044715 x^3 > 65504
    assert ops["net.act"]["mitigated_by"] == ["rewrites.clipped_gelu"]
    none = sc.report(RewriteConfig.none())
    assert none["ops"] and all(not e["mitigated_by"] for e in none["ops"])  # the same ops, none mitigated


def test_scan_of_a_pipeline_reports_attention_logits():
    from pocketdiff.export.fp16scan import scan_pipeline
    from pocketdiff.models import ModelConfig, load_or_build

    pipe = load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))
    rep = scan_pipeline(pipe, ["a red circle"], steps=1, guidance_scale=3.0, seed=0, rewrites=RewriteConfig())
    assert rep["modules_scanned"] > 100 and rep["images_finite"]
    peaks = rep["peaks"]
    for key in ("max_abs", "accumulation", "square", "sum_squares", "logits", "logits_unscaled"):
        assert key in peaks, key
    assert ".attn" in peaks["logits"]["module"]
    assert peaks["logits"]["value"] < peaks["logits_unscaled"]["value"]


def test_residual_scale_for_the_stream_peak():
    from pocketdiff.export.fp16scan import residual_scale_for

    assert residual_scale_for(100.0) == 1.0
    assert residual_scale_for(6.7e4) == 2.0 ** -5  # 6.7e4 / 32 < 4094 (= 65504 / 16)
    assert residual_scale_for(6.7e4, target=65504) == 0.5
