"""A user's LoRA fused into the model (pocketdiff/lora.py, `model.lora`): parity with diffusers'
`load_lora_weights` + `fuse_lora` for the diffusers / PEFT and kohya formats, the other key spellings,
and refusals (pickles, corrupt files, a LoRA of another base) that leave the model unchanged.

The LoRA files are made here: PEFT adapters with random factors on the tiny UNet (attention
projections, a 1x1 and a 3x3 conv) and text encoder, saved with diffusers' `save_lora_weights`;
the kohya files are the same factors under kohya's names with per-layer alphas.
"""
from __future__ import annotations

import copy
import re
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
            name = prefix + (f"text_model.{module}" if prefix == "lora_te_" else module).replace(".", "_")  # CLIP's text_model
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


# ----------------------------------------------------------------------------- key spellings and the formula


def _spellings(unet: dict, te: dict, alpha) -> dict[str, dict]:
    """The same factors and alphas in each key spelling pocketdiff reads."""
    kohya = _kohya_state(unet, te, alpha)
    old, processor, peft_prefixed = {}, {}, {}
    for comp, layers in (("unet", unet), ("text_encoder", te)):
        for k, v in layers.items():
            if ".lora_A." not in k:
                continue
            module, up = k.split(".lora_A.")[0], layers[k.replace(".lora_A.", ".lora_B.")]
            a = torch.tensor(float(alpha(module, v)))
            module = f"text_model.{module}" if comp == "text_encoder" else module  # as files made with transformers 4 name it
            mid = "lora" if comp == "unet" else "lora_linear_layer"
            old.update({f"{comp}.{module}.{mid}.down.weight": v, f"{comp}.{module}.{mid}.up.weight": up, f"{comp}.{module}.alpha": a})
            attn = re.match(r"(.*\.attn[12])\.(to_q|to_k|to_v|to_out)(\.0)?$", module)
            name = f"{comp}.{attn.group(1)}.processor.{attn.group(2)}_lora" if attn else f"{comp}.{module}.lora"
            processor.update({f"{name}.down.weight": v, f"{name}.up.weight": up,
                              f"{name.removesuffix('_lora').removesuffix('.lora')}.alpha": a})
            if comp == "unet":
                peft_prefixed.update({f"base_model.model.{module}.lora_A.weight": v, f"base_model.model.{module}.lora_B.weight": up,
                                      f"base_model.model.{module}.alpha": a})
    return {"kohya": kohya, "diffusers_old": old, "attention_processors": processor, "peft_unet_only": peft_prefixed}


def test_every_key_spelling_fuses_the_formula(base, peft_factors, tmp_path):
    unet, te, _, _ = peft_factors
    alpha = lambda module, down: 1.0 + len(module) % 5  # noqa: E731  per-layer alphas (kohya files may carry them)
    plain = load_pipeline(str(base))
    for name, state in _spellings(unet, te, alpha).items():
        path = tmp_path / f"{name}.safetensors"
        save_file(state, str(path))
        pipe = load_pipeline(str(base))
        fuse_loras(pipe, [LoraSpec(str(path), 0.6)])
        comps = ("unet",) if name == "peft_unet_only" else ("unet", "text_encoder")
        for comp, layers in zip(("unet", "text_encoder"), (unet, te)):
            if comp not in comps:
                assert _max_diff(getattr(pipe, comp), getattr(plain, comp)) == 0.0, name
                continue
            params, params_plain = dict(getattr(pipe, comp).named_parameters()), dict(getattr(plain, comp).named_parameters())
            for k, down in layers.items():
                if ".lora_A." not in k:
                    continue
                module = k.split(".lora_A.")[0]
                up = layers[k.replace(".lora_A.", ".lora_B.")]
                want = 0.6 * alpha(module, down) / down.shape[0] * (up.flatten(1) @ down.flatten(1))
                got = params[f"{module}.weight"] - params_plain[f"{module}.weight"]
                assert float((got - want.reshape(got.shape)).abs().max()) <= MAX_WEIGHT_DIFF, (name, module)


def test_a_conv_lora_acts_as_its_down_conv_then_its_up_conv(base, peft_factors, tmp_path):
    """The fused 3x3 conv equals the layer plus the LoRA branch run as convolutions (LoCon's definition)."""
    unet, _, _, _ = peft_factors
    module = "down_blocks.0.resnets.0.conv1"
    down, up = unet[f"{module}.lora_A.weight"], unet[f"{module}.lora_B.weight"]
    assert down.shape[-2:] == (3, 3) and up.shape[-2:] == (1, 1)
    path = tmp_path / "conv.safetensors"
    save_file({f"lora_unet_{module.replace('.', '_')}.lora_down.weight": down,
               f"lora_unet_{module.replace('.', '_')}.lora_up.weight": up,
               f"lora_unet_{module.replace('.', '_')}.alpha": torch.tensor(2.0)}, str(path))
    plain, pipe = load_pipeline(str(base)), load_pipeline(str(base))
    fuse_loras(pipe, [LoraSpec(str(path), 0.9)])
    layer, fused = plain.unet.get_submodule(module), pipe.unet.get_submodule(module)
    x = torch.randn(1, layer.in_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        branch = torch.nn.functional.conv2d(torch.nn.functional.conv2d(x, down, padding=1), up)
        want = layer(x) + 0.9 * 2.0 / down.shape[0] * branch
        assert float((fused(x) - want).abs().max()) <= 1e-4  # float32 sums of 9 * 32 products, two orders
        assert float((branch).abs().max()) > 1e-2


# ----------------------------------------------------------------------------- refusals


class _Evil:
    """Unpickling this writes a file: the proof that nothing was unpickled is that file's absence."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _snapshot(pipe) -> dict:
    return {c: {k: v.clone() for k, v in getattr(pipe, c).state_dict().items()} for c in ("unet", "text_encoder")}


def _unchanged(pipe, snap) -> bool:
    return all(torch.equal(v, getattr(pipe, c).state_dict()[k]) for c, sd in snap.items() for k, v in sd.items())


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin", ".safetensors"])
def test_a_pickle_is_refused_unopened(tmp_path, suffix):
    marker = tmp_path / "unpickled"
    path = tmp_path / f"evil{suffix}"
    path.write_bytes(pickle.dumps({"lora_unet_x.lora_down.weight": _Evil(marker)}, protocol=4))
    with pytest.raises(ConfigError, match="pickle") as e:
        ModelConfig(lora=[{"path": str(path), "scale": 1.0}])
    assert "model.lora[0]" in str(e.value) and "\n" not in str(e.value)
    if suffix == ".safetensors":  # a torch zip archive named .safetensors too
        torch.save({"w": torch.zeros(2)}, str(path))
        with pytest.raises(ConfigError, match="pickle"):
            ModelConfig(lora=[{"path": str(path)}])
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "header"])
def test_a_corrupt_file_is_refused_in_one_line(tmp_path, kohya_file, damage):
    path = tmp_path / "bad.safetensors"
    data = kohya_file.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00not safetensors" * 64, "empty": b"",
                      "header": data[:8] + b"[" + data[9:]}[damage])
    with pytest.raises(PocketdiffError, match="not a valid safetensors file") as e:
        ModelConfig(lora=[{"path": str(path)}])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("entry,match", [
    ({"path": "missing.safetensors"}, "not found"),
    ({"path": "x.txt"}, "must be a .safetensors file"),
    ({"path": ""}, "must name a .safetensors LoRA file"),
    ({"path": "K", "scale": float("nan")}, "scale: must be a finite number"),
    ({"path": "K", "scale": float("inf")}, "scale: must be a finite number"),
    ({"path": "K", "weight": 1.0}, "unknown key 'weight'"),
])
def test_bad_entries_are_refused_naming_the_key(kohya_file, entry, match):
    entry = {k: (str(kohya_file) if v == "K" else v) for k, v in entry.items()}
    with pytest.raises(ConfigError, match=match) as e:
        ModelConfig(lora=[entry])
    assert str(e.value).startswith("model.lora[0]")


def _mismatch_states() -> dict[str, tuple[dict, str]]:
    """LoRAs of another base: (state dict, what the refusal must name)."""
    down, up = torch.randn(4, 320), torch.randn(320, 4)
    q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    return {
        "missing layer": ({"lora_unet_down_blocks_3_attentions_0_proj_in.lora_down.weight": down,
                           "lora_unet_down_blocks_3_attentions_0_proj_in.lora_up.weight": up},
                          "lora_unet_down_blocks_3_attentions_0_proj_in.lora_down.weight"),
        "shape": ({f"{q}.lora_down.weight": down, f"{q}.lora_up.weight": up}, "(4, 320) x up (320, 4) does not fit"),
        "sdxl te2": ({"lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": down,
                      "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": up}, "second text encoder"),
        "loha": ({f"{q}.hada_w1_a": down, f"{q}.hada_w1_b": up}, "LoHa"),
        "not lora": ({"model.diffusion_model.input_blocks.0.0.weight": down}, "is not a LoRA factor"),
        "no up": ({f"{q}.lora_down.weight": down}, "has no up factor"),
        "diff": ({f"{q}.diff": down}, "a full weight difference"),
    }


@pytest.mark.parametrize("case", ["missing layer", "shape", "sdxl te2", "loha", "not lora", "no up", "diff"])
def test_a_lora_of_another_base_is_refused_and_the_model_is_unchanged(base, kohya_file, tmp_path, case):
    state, named = _mismatch_states()[case]
    path = tmp_path / "other.safetensors"
    save_file(state, str(path))
    pipe = load_pipeline(str(base))
    snap = _snapshot(pipe)
    # a good LoRA first: nothing of it may be fused either when the second one is refused
    with pytest.raises(PocketdiffError) as e:
        fuse_loras(pipe, [LoraSpec(str(kohya_file), 1.0), LoraSpec(str(path), 1.0)])
    assert named in str(e.value) and "model.lora[1]" in str(e.value) and "\n" not in str(e.value)
    assert _unchanged(pipe, snap)


def test_one_by_one_factors_fit_a_linear_and_flat_factors_a_one_by_one_conv(base, tmp_path):
    """SD 1.x's proj_in is a 1x1 conv, SD 2.x's a linear: files store either shape; both fuse as the same matrix."""
    g = torch.Generator().manual_seed(3)
    to_q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"  # Linear 32 -> 32
    proj_in = "down_blocks.0.attentions.0.proj_in"  # Conv2d 1x1 32 -> 32
    down_q, up_q, down_p, up_p = (torch.randn(2, 32, generator=g) for _ in range(4))
    state = {f"lora_unet_{to_q.replace('.', '_')}.lora_down.weight": down_q[:, :, None, None],
             f"lora_unet_{to_q.replace('.', '_')}.lora_up.weight": up_q.T[:, :, None, None].contiguous(),
             f"lora_unet_{proj_in.replace('.', '_')}.lora_down.weight": down_p,
             f"lora_unet_{proj_in.replace('.', '_')}.lora_up.weight": up_p.T.contiguous()}
    path = tmp_path / "mixed.safetensors"
    save_file(state, str(path))
    plain, pipe = load_pipeline(str(base)), load_pipeline(str(base))
    fuse_loras(pipe, [LoraSpec(str(path), 1.0)])  # no alpha: alpha = rank, scale 1
    for name, down, up in ((to_q, down_q, up_q.T), (proj_in, down_p, up_p.T)):
        got = pipe.unet.get_submodule(name).weight - plain.unet.get_submodule(name).weight
        assert float((got.reshape(32, 32) - up @ down).abs().max()) <= MAX_WEIGHT_DIFF, name
