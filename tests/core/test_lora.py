"""A user's LoRA fused into the model (pocketdiff/lora.py, `model.lora`): parity with diffusers'
`load_lora_weights` + `fuse_lora` for the diffusers / PEFT and kohya formats, the other key spellings,
and refusals (pickles, corrupt files, a LoRA of another base) that leave the model unchanged.

The LoRA files are made here: PEFT adapters with random factors on the tiny UNet (attention
projections, a 1x1 and a 3x3 conv) and text encoder, saved with diffusers' `save_lora_weights`;
the kohya files are the same factors under kohya's names with per-layer alphas.
"""
from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pocketdiff.errors import ConfigError, PocketdiffError
from pocketdiff.lora import LoraSpec, fuse_loras
from pocketdiff.models import ModelConfig, build_pipeline, load_or_build, load_pipeline, perturb_norm_affines, save_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CAPTIONS = ["a red circle on a white background", "a blue square", "a green star on a black background"]
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "ff.net.2"]  # linear, 1x1 conv, 3x3 conv
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]
# Both sides add a float32 delta to float32 weights of size ~0.1-1; they differ only in the order
# of the rounding steps (scale * alpha / rank folded before or after the product): a few float32
# ulps of the weights. 1e-5 leaves ~30x room above that, 1000x below the deltas themselves.
MAX_WEIGHT_DIFF = 1e-5
MAX_OUTPUT_DIFF = 1e-4  # the UNet's output through ~20 layers of such weights


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    pipe = build_pipeline(ModelConfig(vocab_size=600), captions=CAPTIONS, resolution=32)
    for i, comp in enumerate((pipe.unet, pipe.text_encoder, pipe.vae)):
        perturb_norm_affines(comp, i, scale=0.3)
    return save_pipeline(pipe, tmp_path_factory.mktemp("lora") / "base")


def _peft_layers(base: Path, seed: int) -> tuple[dict, dict, dict, dict]:
    """(unet factors, text encoder factors, unet config dict, te config dict): random PEFT LoRA factors
    in diffusers' naming (module.lora_A.weight / lora_B.weight, no component prefix)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = load_pipeline(str(base))
    torch.manual_seed(seed)
    unet_cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=UNET_TARGETS,
                          alpha_pattern={"conv1": 2})
    te_cfg = LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=TE_TARGETS)
    pipe.unet.add_adapter(unet_cfg)
    pipe.text_encoder.add_adapter(te_cfg)
    layers = []
    for module in (pipe.unet, pipe.text_encoder):
        layers.append({k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(module).items()})
    return layers[0], layers[1], unet_cfg.to_dict(), te_cfg.to_dict()


@pytest.fixture(scope="module")
def peft_factors(base):
    return _peft_layers(base, seed=1)


@pytest.fixture(scope="module")
def peft_file(base, peft_factors, tmp_path_factory) -> Path:
    from diffusers import StableDiffusionPipeline

    unet, te, unet_meta, te_meta = peft_factors
    folder = tmp_path_factory.mktemp("peft")
    StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=unet, text_encoder_lora_layers=te,
                                              unet_lora_adapter_metadata=copy.deepcopy(unet_meta),
                                              text_encoder_lora_adapter_metadata=copy.deepcopy(te_meta),
                                              weight_name="style.safetensors")
    return folder / "style.safetensors"


def _kohya_state(unet: dict, te: dict, alphas) -> dict:
    """The same factors under kohya's names: lora_unet_<module with _>.lora_down / lora_up / alpha."""
    out = {}
    for prefix, layers in (("lora_unet_", unet), ("lora_te_", te)):
        for k, v in layers.items():
            if ".lora_A." not in k:
                continue
            module = k.split(".lora_A.")[0]
            name = prefix + module.replace(".", "_")
            out[f"{name}.lora_down.weight"] = v
            out[f"{name}.lora_up.weight"] = layers[k.replace(".lora_A.", ".lora_B.")]
            out[f"{name}.alpha"] = torch.tensor(float(alphas(module, v)))
    return out


@pytest.fixture(scope="module")
def kohya_file(base, tmp_path_factory) -> Path:
    unet, te, _, _ = _peft_layers(base, seed=2)
    path = tmp_path_factory.mktemp("kohya") / "kohya_style.safetensors"
    # kohya's two alphas: network_alpha for linear and 1x1 layers, conv_alpha for 3x3 convs (LoCon). diffusers
    # maps one alpha per file plus exceptions by name; per-layer alphas are tested against the formula below
    state = _kohya_state(unet, te, lambda module, down: 1.0 if down.dim() == 4 and down.shape[-1] == 3 else 3.0)
    save_file(state, str(path), metadata={"ss_network_module": "networks.lora"})
    return path


def _diffusers_fused(base: Path, files_scales: list[tuple[Path, float]]):
    """The reference: stock diffusers, each LoRA loaded, fused at its scale and unloaded in turn."""
    pipe = load_pipeline(str(base))
    for path, scale in files_scales:
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=path.stem)
        pipe.fuse_lora(lora_scale=scale, adapter_names=[path.stem])
        pipe.unload_lora_weights()
    return pipe


def _max_diff(a, b) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def _changed(a, b, tol: float = 1e-3) -> int:
    sa, sb = a.state_dict(), b.state_dict()
    return sum(int(float((sa[k] - sb[k]).abs().max()) > tol) for k in sa)


def _unet_out(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 4, 4, generator=g)
    ids = pipe.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        states = pipe.text_encoder(ids)[0]
        return pipe.unet(x, torch.tensor([500]), encoder_hidden_states=states).sample


def _assert_parity(ours, ref, plain, min_changed_unet: int, min_changed_te: int) -> None:
    for comp, need in (("unet", min_changed_unet), ("text_encoder", min_changed_te)):
        assert _max_diff(getattr(ours, comp), getattr(ref, comp)) <= MAX_WEIGHT_DIFF, comp
        assert _changed(getattr(ours, comp), getattr(plain, comp)) >= need, f"{comp}: the LoRA changed too few weights"
    out, out_ref, out_plain = _unet_out(ours), _unet_out(ref), _unet_out(plain)
    assert float((out - out_ref).abs().max()) <= MAX_OUTPUT_DIFF
    assert float((out - out_plain).abs().max()) > 1e-2  # the LoRA does change what the model computes


def test_peft_lora_matches_diffusers_fuse(base, peft_file):
    ours = load_or_build(ModelConfig(pretrained=str(base), lora=[{"path": str(peft_file), "scale": 0.7}]))
    ref = _diffusers_fused(base, [(peft_file, 0.7)])
    # 7 target kinds in 5 attention blocks (2 projections per attention each) + resnets' conv1: dozens of tensors
    _assert_parity(ours, ref, load_pipeline(str(base)), min_changed_unet=40, min_changed_te=8)


def test_kohya_lora_with_alphas_matches_diffusers_fuse(base, kohya_file):
    ours = load_or_build(ModelConfig(pretrained=str(base), lora=[LoraSpec(path=str(kohya_file), scale=1.3)]))
    ref = _diffusers_fused(base, [(kohya_file, 1.3)])
    _assert_parity(ours, ref, load_pipeline(str(base)), min_changed_unet=40, min_changed_te=8)


def test_two_loras_add_as_diffusers_fusing_one_after_the_other(base, peft_file, kohya_file):
    specs = [{"path": str(peft_file), "scale": 0.5}, {"path": str(kohya_file), "scale": -0.8}]
    ours = load_or_build(ModelConfig(pretrained=str(base), lora=specs))
    ref = _diffusers_fused(base, [(peft_file, 0.5), (kohya_file, -0.8)])
    _assert_parity(ours, ref, load_pipeline(str(base)), min_changed_unet=40, min_changed_te=8)
