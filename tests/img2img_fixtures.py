"""The image-to-image test material shared by tests/runtime/test_image_tasks.py and tests/web/test_check_img2img.py:
the shipped shapes teacher's VAE encoder exported alone (`components: [vae_encoder]`), grafted onto a copy of the web
smoke bundle (the same model and size), and the pictures and masks the tests feed. Importable as `img2img_fixtures`
(tests/conftest.py puts this folder on sys.path); tests/conftest.py's session fixture `smoke_encoder_export` exports
the encoder once per worker. The torch sampler's tests (tests/core/test_img2img_sampling.py,
test_inpaint_unet_sampling.py) share `torch_picture`, `torch_half_mask` and `psnr_unit_range`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml

TASKS = ("text_to_image", "image_to_image", "inpaint")


def export_smoke_encoder(root: Path) -> Path:
    """The shapes teacher's encoder-only export in `root / "enc"` (fully on the delegate, golden, parity gate)."""
    from pocketdiff.cli import main as cli_main

    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["vae_encoder"],
           "tasks": ["image_to_image", "inpaint"], "weights": "fp16", "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
           "fp16_scan": {"enabled": False}}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "enc")]) == 0
    return root / "enc"


def graft_encoder(bundle: Path, encoder_export: Path, tasks=TASKS) -> None:
    """An encoder-only export's vae_encoder copied into `bundle` (same model and size), the image tasks declared."""
    from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION, derive_pipeline

    man = json.loads((bundle / "manifest.json").read_text())
    enc = json.loads((encoder_export / "manifest.json").read_text())["components"]["vae_encoder"]
    for rel in (enc["path"], enc["golden"]["path"]):
        shutil.copy(encoder_export / rel, bundle / rel)
    man["components"]["vae_encoder"] = enc
    man["schema_version"] = PIPELINE_SCHEMA_VERSION
    man["pipeline"] = derive_pipeline(man, tasks=tuple(tasks))
    (bundle / "manifest.json").write_text(json.dumps(man, indent=1))


def make_pictures(d: Path) -> Path:
    """In `d`: a 32 px picture (the bundle's size), the same at 64 px, a wide one, a mask (the right half repainted),
    a mask of another size and a file that is not an image."""
    from PIL import Image

    low = np.random.default_rng(0).uniform(0, 255, (4, 4, 3)).astype(np.uint8)
    Image.fromarray(low).resize((32, 32), Image.BILINEAR).save(d / "pic.png")
    Image.fromarray(low).resize((64, 64), Image.BILINEAR).save(d / "pic64.png")
    Image.fromarray(low).resize((48, 32), Image.BILINEAR).save(d / "wide.png")
    mask = np.zeros((32, 32), np.uint8)
    mask[:, 16:] = 255
    Image.fromarray(mask).save(d / "mask.png")
    Image.fromarray(mask[:16, :16]).save(d / "mask16.png")
    (d / "not_an_image.png").write_text("hello")
    return d


def torch_picture(seed: int = 0):
    """A 32 px picture [1, 3, 32, 32] in [0, 1] (a torch tensor): smooth colour fields."""
    import torch

    low = torch.rand(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.interpolate(low, size=(32, 32), mode="bilinear", align_corners=False)


def torch_half_mask():
    """[1, 1, 32, 32] (a torch tensor): repaint the right half."""
    import torch

    m = torch.zeros(1, 1, 32, 32)
    m[..., 16:] = 1.0
    return m


def psnr_unit_range(a, b) -> float:
    """PSNR in dB of two torch images in [0, 1] (peak 1); inf when identical."""
    mse = float(((a.float() - b.float()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def save_inpaint_folder(out: Path) -> Path:
    """A StableDiffusionInpaintPipeline folder: the shapes teacher with a 9-channel UNet (latents + mask + masked-picture
    latents) whose first four input channels keep the teacher's conv_in weights and the five new ones small random
    weights (seed 1), the rest of the UNet the teacher's: an inpainting UNet of SD-2-inpainting's layout, 32 px."""
    import torch
    from diffusers import StableDiffusionInpaintPipeline, UNet2DConditionModel

    from pocketdiff.models import ModelConfig, load_or_build, save_pipeline

    teacher = load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))
    unet = UNet2DConditionModel(**{**dict(teacher.unet.config), "in_channels": 9}).eval()
    own = teacher.unet.state_dict()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, v in unet.state_dict().items():
            if k == "conv_in.weight":
                v[:, :4].copy_(own[k])
                v[:, 4:].copy_(torch.randn(v[:, 4:].shape, generator=gen) * 0.05)
            else:
                v.copy_(own[k])
    pipe = StableDiffusionInpaintPipeline(**{**teacher.components, "unet": unet, "safety_checker": None, "feature_extractor": None},
                                          requires_safety_checker=False)
    save_pipeline(pipe, out)
    return out


INPAINT_EXPORT = {"seed": 0, "tasks": ["inpaint"], "weights": "fp16", "guidance": "cfg", "guidance_scale": 3.0, "steps": 4,
                  "fp16_scan": {"enabled": False}}


def export_inpaint_bundle(root: Path) -> dict:
    """save_inpaint_folder's model exported with `tasks: [inpaint]` (fully on the delegate), and make_pictures' pictures:
    {model, bundle, pictures}."""
    from pocketdiff.cli import main as cli_main

    model = save_inpaint_folder(root / "model")
    (root / "export.yaml").write_text(yaml.safe_dump({**INPAINT_EXPORT, "model": {"pretrained": str(model)}}))
    assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "bundle")]) == 0
    (root / "pics").mkdir()
    return {"model": model, "bundle": root / "bundle", "pictures": make_pictures(root / "pics")}
