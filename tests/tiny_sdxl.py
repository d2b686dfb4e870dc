"""A tiny SDXL-style UNet (``addition_embed_type="text_time"``) and conditionings for it, shared by the
conditioning-seam tests (tests/core, tests/train, tests/compress/quant); the tiny SDXL bundle's export
(`export_tiny_sdxl`: tests/conftest.py's session fixture `sdxl_bundle`, read by tests/export/test_sdxl_bundle.py and
tests/web/test_node_runner_sdxl.py). Importable as `tiny_sdxl`: tests/conftest.py puts this folder on sys.path."""
from __future__ import annotations

import torch
from diffusers import DDIMScheduler, UNet2DConditionModel

from pocketdiff.conditioning import Conditioning
from pocketdiff.models import scheduler_config

POOLED, TIME_DIM, CROSS = 8, 4, 16  # pooled text embedding width, time-id embedding width, cross-attention width


def xl_unet(**extra) -> UNet2DConditionModel:
    """Random weights (seed 0), 8x8 latents, 4 channels; `extra` adds config (e.g. time_cond_proj_dim)."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=CROSS, attention_head_dim=2, norm_num_groups=4, addition_embed_type="text_time",
        addition_time_embed_dim=TIME_DIM, projection_class_embeddings_input_dim=POOLED + 6 * TIME_DIM, **extra).eval()


def xl_cond(batch: int, seed: int) -> Conditioning:
    """Random prompt embeddings [batch, 5, CROSS], pooled [batch, POOLED], time ids near (64, 64, 0, 0, 64, 64)."""
    g = torch.Generator().manual_seed(seed)
    time_ids = torch.tensor([64.0, 64.0, 0.0, 0.0, 64.0, 64.0]).expand(batch, 6) + torch.randint(0, 8, (batch, 6), generator=g)
    return Conditioning(torch.randn(batch, 5, CROSS, generator=g), torch.randn(batch, POOLED, generator=g), time_ids)


def noise(n: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


def ddim_scheduler() -> DDIMScheduler:
    return DDIMScheduler(**scheduler_config())


SDXL_PROMPT, SDXL_STEPS, SDXL_SCALE = "a red circle on a white background", 4, 3.0
SDXL_CAPTIONS = ["a red circle on a white background", "a blue square", "a green star on a black background"]


def export_tiny_sdxl(root) -> dict:
    """A tiny SDXL pipeline (arch tiny_xl, trained-like norms) saved as a stock StableDiffusionXLPipeline folder with
    SDXL base's `force_zeros_for_empty_prompt: true`, and `pocketdiff export` of that folder (cfg guidance, DDIM 4
    steps, an fp16 scan). {"folder", "out": the bundle, "report": export's report.json}."""
    import json

    import yaml

    from pocketdiff.cli import main
    from pocketdiff.models import ModelConfig, build_pipeline, perturb_norm_affines, save_pipeline

    pipe = build_pipeline(ModelConfig(arch="tiny_xl"), captions=SDXL_CAPTIONS)
    for i, name in enumerate(("unet", "vae", "text_encoder", "text_encoder_2")):  # trained-like norms (identity ones
        perturb_norm_affines(getattr(pipe, name), i)  # fold into BROADCAST_TO, which the delegate rejects)
    pipe.register_to_config(force_zeros_for_empty_prompt=True)  # SDXL base's setting: the unconditional rows are zeros
    save_pipeline(pipe, root / "xl")
    cfg = {"seed": 0, "model": {"pretrained": str(root / "xl")}, "guidance": "cfg", "guidance_scale": SDXL_SCALE,
           "steps": SDXL_STEPS, "golden_prompt": SDXL_PROMPT, "fp16_scan": {"enabled": True, "prompts": ["a red circle"], "steps": 1}}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "bundle"
    assert main(["export", "--config", str(root / "export.yaml"), "--output", str(out)]) == 0
    return {"folder": root / "xl", "out": out, "report": json.loads((out / "report.json").read_text())}


SDXL_CHUNKINGS = {2: "block", 3: "layer"}  # the tiny SDXL UNet's chunked exports: unet_chunks -> unet_chunk_cut


class ChunkedSdxlBundles(dict):
    """{k: the tiny SDXL folder's bundle with its UNet in k chunks (SDXL_CHUNKINGS' cut)}, each exported the first time a
    test reads it (a worker that needs one chunking pays for one export): `pocketdiff export` with no fp16 scan (it changes
    no graph); the text encoders and decoder are converted once (tests/conftest.py `shared_conversions`)."""

    def __init__(self, folder, root, shared_conversions):
        super().__init__()
        self.folder, self.root, self.shared_conversions = folder, root, shared_conversions

    def __missing__(self, k: int):
        import yaml

        from pocketdiff.cli import main

        cfg = {"seed": 0, "model": {"pretrained": str(self.folder)}, "guidance": "cfg", "guidance_scale": SDXL_SCALE,
               "steps": SDXL_STEPS, "golden_prompt": SDXL_PROMPT, "fp16_scan": {"enabled": False}, "unet_chunks": k,
               "unet_chunk_cut": SDXL_CHUNKINGS[k]}
        (self.root / f"export_{k}.yaml").write_text(yaml.safe_dump(cfg))
        out = self.root / f"bundle_{k}"
        with self.shared_conversions.of("text_encoder", "text_encoder_2", "vae_decoder"):
            assert main(["export", "--config", str(self.root / f"export_{k}.yaml"), "--output", str(out)]) == 0
        self[k] = out
        return out
