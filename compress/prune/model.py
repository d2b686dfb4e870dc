"""The pruned UNet's on-disk format and loaders (no pickles).

A pruned UNet folder is what `UNet2DConditionModel.save_pretrained` writes (``config.json``
with the *stock* architecture, ``diffusion_pytorch_model.safetensors``) plus
``pruning.json``, which records the shape of every module that differs from the stock
architecture::

    {"format": "pocketdiff-pruned-unet", "version": 1, "base_class": "UNet2DConditionModel",
     "modules": {"up_blocks.1.resnets.0.conv1": {"type": "Conv2d", "in_channels": 192,
                 "out_channels": 40, "kernel_size": [3, 3], ...},
                 "up_blocks.1.resnets.0.norm2": {"type": "GroupNorm", "num_groups": 5, "num_channels": 40, ...}}}

Per-block channel counts do not fit `UNet2DConditionModel`'s config, so stock diffusers
cannot load the weights on its own. `load_pruned_unet(dir)` builds the stock UNet from
``config.json`` on the meta device, replaces the recorded modules by modules of the
recorded shapes, and assigns the safetensors weights (strict: every tensor must match).

Pipelines: the UNet class is `PrunedUNet2DConditionModel` (a `UNet2DConditionModel`
subclass whose `from_pretrained` is that loader), and a saved pipeline's
``model_index.json`` names it as ``["pocketdiff.compress.prune.model",
"PrunedUNet2DConditionModel"]``. Diffusers resolves that entry from already-imported
modules only, so a stock ``StableDiffusionPipeline.from_pretrained(dir)`` works once this
module is imported; `load_pruned_pipeline(dir)` does exactly that. The text encoder, VAE,
tokenizer and scheduler folders are stock.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

import torch
from diffusers import UNet2DConditionModel
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  (diffusers looks this name up here)
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import atomic_write_text, read_safetensors

SPEC_FILE = "pruning.json"
FORMAT = "pocketdiff-pruned-unet"
VERSION = 1
WEIGHTS = "diffusion_pytorch_model.safetensors"
MODULE_NAME = __name__  # "pocketdiff.compress.prune.model": what model_index.json records


# --------------------------------------------------------------------------------------
# Module shapes
# --------------------------------------------------------------------------------------

def _describe(m: nn.Module) -> Optional[dict]:
    if isinstance(m, nn.Conv2d):
        return {"type": "Conv2d", "in_channels": m.in_channels, "out_channels": m.out_channels,
                "kernel_size": list(m.kernel_size), "stride": list(m.stride), "padding": list(m.padding)
                if not isinstance(m.padding, str) else m.padding, "dilation": list(m.dilation), "groups": m.groups,
                "bias": m.bias is not None, "padding_mode": m.padding_mode}
    if isinstance(m, nn.Linear):
        return {"type": "Linear", "in_features": m.in_features, "out_features": m.out_features, "bias": m.bias is not None}
    if isinstance(m, nn.GroupNorm):
        return {"type": "GroupNorm", "num_groups": m.num_groups, "num_channels": m.num_channels, "eps": m.eps, "affine": m.affine}
    return None


def _build(desc: dict) -> nn.Module:
    kind = desc.get("type")
    try:
        if kind == "Conv2d":
            pad = desc["padding"]
            return nn.Conv2d(int(desc["in_channels"]), int(desc["out_channels"]), tuple(desc["kernel_size"]),
                             tuple(desc["stride"]), pad if isinstance(pad, str) else tuple(pad), tuple(desc["dilation"]),
                             int(desc["groups"]), bool(desc["bias"]), str(desc["padding_mode"]))
        if kind == "Linear":
            return nn.Linear(int(desc["in_features"]), int(desc["out_features"]), bias=bool(desc["bias"]))
        if kind == "GroupNorm":
            return nn.GroupNorm(int(desc["num_groups"]), int(desc["num_channels"]), eps=float(desc["eps"]), affine=bool(desc["affine"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PocketdiffError(f"{SPEC_FILE}: bad {kind} entry {desc}: {e}") from None
    raise PocketdiffError(f"{SPEC_FILE}: unsupported module type {kind!r}")


def _stock_meta(config: dict) -> UNet2DConditionModel:
    with torch.device("meta"):
        return UNet2DConditionModel.from_config(_clean_config(config))


def _clean_config(config: Any) -> dict:
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def shape_spec(unet: nn.Module, config: Optional[dict] = None) -> dict:
    """The pruning.json content for `unet`: every Conv2d / Linear / GroupNorm whose shape
    differs from the stock UNet built from `config` (default: ``unet.config``)."""
    stock = _stock_meta(dict(config if config is not None else unet.config))
    stock_mods = dict(stock.named_modules())
    modules = {}
    for name, m in unet.named_modules():
        d = _describe(m)
        if d is None:
            continue
        ref = stock_mods.get(name)
        if ref is None or _describe(ref) is None:
            raise PocketdiffError(f"module {name} does not exist in the stock UNet of this config")
        if d != _describe(ref):
            modules[name] = d
    return {"format": FORMAT, "version": VERSION, "base_class": "UNet2DConditionModel", "modules": modules}


def apply_shape_spec(unet: nn.Module, spec: dict) -> None:
    """Replace every module named in `spec` by a fresh module of the recorded shape (same
    device and dtype as the module it replaces)."""
    if spec.get("format") != FORMAT:
        raise PocketdiffError(f"{SPEC_FILE}: format is {spec.get('format')!r}, expected {FORMAT!r}")
    if int(spec.get("version", 0)) > VERSION:
        raise PocketdiffError(f"{SPEC_FILE}: version {spec.get('version')} is newer than this pocketdiff reads ({VERSION})")
    mods = dict(unet.named_modules())
    for name, desc in dict(spec.get("modules", {})).items():
        old = mods.get(name)
        if old is None or _describe(old) is None or _describe(old)["type"] != desc.get("type"):
            raise PocketdiffError(f"{SPEC_FILE}: {name} is not a {desc.get('type')} of this UNet config")
        p = next(old.parameters(), None)
        with torch.device(p.device if p is not None else "cpu"):
            new = _build(desc)
        if p is not None:
            new = new.to(p.dtype)
        for m in unet.modules():  # every reference (aliases such as Downsample2D's Conv2d_0 too)
            for k, child in list(m._modules.items()):
                if child is old:
                    m._modules[k] = new
    sync_channel_attributes(unet)


def sync_channel_attributes(unet: nn.Module) -> None:
    """Make the channel counts diffusers blocks record (and Downsample2D / Upsample2D assert on)
    agree with their modules after block-output (stream) channels were pruned."""
    from diffusers.models.downsampling import Downsample2D
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    from diffusers.models.upsampling import Upsample2D

    for m in unet.modules():
        if isinstance(m, ResnetBlock2D) and isinstance(m.conv1, nn.Conv2d) and isinstance(m.conv2, nn.Conv2d):
            m.in_channels, m.out_channels = m.conv1.in_channels, m.conv2.out_channels
        elif isinstance(m, (Downsample2D, Upsample2D)) and isinstance(getattr(m, "conv", None), nn.Conv2d):
            m.channels, m.out_channels = m.conv.in_channels, m.conv.out_channels
        elif isinstance(m, Transformer2DModel) and isinstance(getattr(m, "norm", None), nn.GroupNorm):
            m.in_channels = m.norm.num_channels
            proj = getattr(m, "proj_out", None)
            if isinstance(proj, nn.Conv2d):
                m.out_channels = proj.out_channels
            elif isinstance(proj, nn.Linear):
                m.out_channels = proj.out_features


# --------------------------------------------------------------------------------------
# The model class
# --------------------------------------------------------------------------------------

def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    single = folder / WEIGHTS
    if single.is_file():
        return read_safetensors(single)
    index = folder / (WEIGHTS + ".index.json")
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise PocketdiffError(f"{index}: unreadable weight index ({type(e).__name__}: {e})") from None
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(read_safetensors(folder / f))
        return state
    raise PocketdiffError(f"{folder}: no {WEIGHTS} (pruned UNets load from safetensors only)")


def build_pruned_unet(config: dict, spec: dict, state_dict: Optional[dict] = None) -> "PrunedUNet2DConditionModel":
    """Stock UNet from `config` on the meta device, shrunk to `spec`; weights assigned from
    `state_dict` (strict) when given, else left on the meta device (shape-only model)."""
    with torch.device("meta"):
        model = PrunedUNet2DConditionModel.from_config(_clean_config(config))
    apply_shape_spec(model, spec)
    model.pruning_spec = spec
    if state_dict is not None:
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = {k: tuple(v.shape) for k, v in state_dict.items()}
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
        if missing or extra or wrong:
            parts = []
            if missing:
                parts.append(f"missing {missing[:3]}")
            if extra:
                parts.append(f"unexpected {extra[:3]}")
            if wrong:
                parts.append(f"shape mismatch {wrong[0]}: weights {got[wrong[0]]} vs spec {expected[wrong[0]]}")
            raise PocketdiffError("pruned UNet weights do not match config + pruning.json: " + "; ".join(parts))
        model.load_state_dict(state_dict, strict=True, assign=True)
    return model


def to_pruned(unet: nn.Module) -> "PrunedUNet2DConditionModel":
    """Wrap an (in-place pruned) UNet2DConditionModel as a PrunedUNet2DConditionModel
    sharing its tensors."""
    spec = shape_spec(unet)
    model = build_pruned_unet(dict(unet.config), spec, dict(unet.state_dict()))
    model.train(unet.training)
    for p_new, p_old in zip(model.parameters(), unet.parameters()):
        p_new.requires_grad_(p_old.requires_grad)
    return model


class PrunedUNet2DConditionModel(UNet2DConditionModel):
    """A UNet2DConditionModel whose modules may be slimmer than its config says.

    `pruning_spec` (the pruning.json content) records the differing shapes;
    `save_pretrained` writes it next to the stock config and safetensors weights, and
    `from_pretrained` is `load_pruned_unet`.
    """

    pruning_spec: dict = {"format": FORMAT, "version": VERSION, "base_class": "UNet2DConditionModel", "modules": {}}

    def save_pretrained(self, save_directory, *args, **kwargs):  # noqa: D401
        kwargs["safe_serialization"] = True
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            spec = shape_spec(self)  # from the modules themselves, never stale
            path = Path(save_directory) / SPEC_FILE
            atomic_write_text(path, json.dumps(spec, indent=1) + "\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: Optional[str] = None, torch_dtype=None, **kwargs):
        folder = Path(pretrained_model_name_or_path)
        if subfolder:
            folder = folder / subfolder
        return load_pruned_unet(folder, torch_dtype=torch_dtype, device=kwargs.get("device"))


def is_pruned_unet_dir(folder: Union[str, Path]) -> bool:
    return (Path(folder) / SPEC_FILE).is_file()


def load_pruned_unet(folder: Union[str, Path], torch_dtype=None, device=None) -> PrunedUNet2DConditionModel:
    """Load a pruned UNet folder: stock config -> shrink to pruning.json -> safetensors (strict)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PocketdiffError(f"{folder}: not a folder")
    cfg_path, spec_path = folder / "config.json", folder / SPEC_FILE
    if not cfg_path.is_file():
        raise PocketdiffError(f"{folder}: no config.json (not a UNet folder)")
    if not spec_path.is_file():
        raise PocketdiffError(f"{folder}: no {SPEC_FILE} (not a pocketdiff pruned UNet; load it with diffusers)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PocketdiffError(f"{folder}: unreadable config.json / {SPEC_FILE}: {e}") from None
    state = _read_weights(folder)
    model = build_pruned_unet(config, spec, state)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    if device is not None:
        model = model.to(device)
    model.pruning_spec = spec
    return model.eval()


def is_pruned_pipeline(folder: Union[str, Path]) -> bool:
    """True for a pipeline folder whose unet/ is a pocketdiff pruned UNet."""
    return is_pruned_unet_dir(Path(folder) / "unet")


def load_pruned_pipeline(folder: Union[str, Path], torch_dtype=None):
    """A StableDiffusionPipeline from a pruned pipeline folder (stock components + pruned unet/).

    Goes through the shared `pocketdiff.models.load_pipeline` (stock
    `StableDiffusionPipeline.from_pretrained`); importing this module is what lets diffusers
    resolve the ``["pocketdiff.compress.prune.model", "PrunedUNet2DConditionModel"]`` entry
    of model_index.json. A stock (unpruned) pipeline folder loads too.
    """
    from pocketdiff.models import load_pipeline

    folder = Path(folder)
    pipe = load_pipeline(str(folder), torch_dtype=torch_dtype)
    if is_pruned_pipeline(folder) and not isinstance(pipe.unet, PrunedUNet2DConditionModel):
        raise PocketdiffError(f"{folder}: unet/ has {SPEC_FILE} but model_index.json does not name "
                              f"[{MODULE_NAME!r}, 'PrunedUNet2DConditionModel']")
    return pipe


def fix_model_index(folder: Union[str, Path]) -> None:
    """Point model_index.json's unet entry at PrunedUNet2DConditionModel (idempotent)."""
    path = Path(folder) / "model_index.json"
    index = json.loads(path.read_text(encoding="utf-8"))
    index["unet"] = [MODULE_NAME, "PrunedUNet2DConditionModel"]
    atomic_write_text(path, json.dumps(index, indent=2, sort_keys=True) + "\n")
