"""`vae_tiling.up_parts` against the decoder's shape alone, at config time (before any model is built or scanned).

A one-pass decoder's up path (export/onepass_vae.up_path_layers) is, per up block, its `layers_per_block + 1`
resnets and (all but the last block) one upsampler, then the output head: that many layers to cut between. The
shape comes from the VAE's config.json (`model.vae`, else `model.pretrained`'s or the int8 checkpoint's pipeline's
vae/), or from the built arch; a hub id or an unreadable config is left to plan_up_parts once the model is loaded.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pocketdiff.errors import require


def up_path_length(vae_conf: dict) -> int:
    """The number of layers `up_path_layers` lists for an AutoencoderKL with this config."""
    blocks = len(vae_conf["block_out_channels"])
    return blocks * (int(vae_conf.get("layers_per_block", 1)) + 1) + (blocks - 1) + 1


def _config_json(source: str) -> Optional[dict]:
    from pocketdiff.shipped import resolve_shipped

    folder = Path(resolve_shipped(str(source))).expanduser()
    for path in (folder / "vae" / "config.json", folder / "config.json"):
        try:
            conf = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(conf, dict) and isinstance(conf.get("block_out_channels"), list):
            return conf
    return None


def vae_shape(model_cfg, int8_checkpoint: Optional[str]) -> Optional[dict]:
    """The VAE config the export will build or load, where it can be read without loading a model."""
    source = model_cfg.vae or model_cfg.pretrained
    if source is None and int8_checkpoint and (Path(int8_checkpoint) / "pipeline").is_dir():
        source = str(Path(int8_checkpoint) / "pipeline")
    if source is not None:
        return _config_json(source)
    from pocketdiff.archs import vae_config

    return vae_config(model_cfg.arch)


def precheck_up_parts(model_cfg, int8_checkpoint: Optional[str], parts: int) -> None:
    if parts <= 1:
        return
    conf = vae_shape(model_cfg, int8_checkpoint)
    if conf is None:
        return
    n = up_path_length(conf)
    require(parts <= n, "vae_tiling.up_parts", f"{parts}, but this decoder's up path has {n} layers to cut between "
                                               f"(at most {n} parts)")
