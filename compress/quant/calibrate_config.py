"""The `pocketdiff calibrate` config: `Config` and its sections (calibration data, quantization,
parity thresholds, outputs; the `recon:` section is `block_recon.ReconConfig`), validated on
construction."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from pocketdiff.config import DataConfig, deprecated
from pocketdiff.errors import require
from pocketdiff.models import ModelConfig
from pocketdiff.runtime.components import STAGE_COMPONENTS

from .block_recon import ReconConfig

DEFAULT_MIN_COSINE = {8: 0.99, 4: 0.9}
QUANTIZABLE = STAGE_COMPONENTS  # the registry's whole components (runtime/components.py), SDXL's text_encoder_2 too
CALIBRATED = ("unet", "text_encoder", "text_encoder_2", "vae_decoder")  # what calibrate itself quantizes


@dataclasses.dataclass
class CalibDataConfig:
    """Where calibration inputs come from: prompts (explicit, else captions of `data`) sampled
    by the model's own DDIM sampler."""

    prompts: list[str] = dataclasses.field(default_factory=list)  # cycled when fewer than needed
    data: DataConfig = dataclasses.field(default_factory=lambda: DataConfig(source="shapes", shapes_count=512))
    num_prompts: int = 32  # calibration trajectories
    holdout_prompts: int = 4  # held-out trajectories (other prompts and seeds) for the report
    steps: int = 25  # sampler steps (a distilled student: its step count)
    timesteps_per_trajectory: int = 0  # recorded steps per trajectory, spread evenly; 0: all
    guidance_scale: float = 3.0
    negative_prompt: str = ""
    seed: int = 1000  # trajectory i starts from noise seeded seed + i
    batch_size: int = 16  # trajectories per sampler call
    class_label: Optional[int] = None  # UNets with a class embedding: the label fed while sampling
    max_samples: Optional[int] = None  # cap on recorded calibration inputs (evenly subsampled)

    def __post_init__(self) -> None:
        require(self.num_prompts >= 1, "calib.num_prompts", f"must be >= 1 (zero calibration samples), got {self.num_prompts}")
        require(self.holdout_prompts >= 1, "calib.holdout_prompts", "must be >= 1")
        require(self.steps >= 1, "calib.steps", f"must be >= 1, got {self.steps}")
        require(self.timesteps_per_trajectory >= 0, "calib.timesteps_per_trajectory", "must be >= 0")
        require(self.batch_size >= 1, "calib.batch_size", "must be >= 1")
        require(self.max_samples is None or self.max_samples >= 1, "calib.max_samples", "must be >= 1 (zero calibration samples)")
        require(all(isinstance(p, str) for p in self.prompts), "calib.prompts", "must be strings")


@dataclasses.dataclass
class QuantConfig:
    bits: int = 8  # 8 or 4
    group_size: Optional[int] = None  # None: per output channel; else group-wise over the flattened input
    layer_bits: dict[str, int] = dataclasses.field(default_factory=dict)  # fnmatch pattern -> bits (e.g. conv_in: 8)
    skip: list[str] = dataclasses.field(default_factory=list)  # fnmatch patterns of UNet layers kept float
    # what to quantize: the UNet (block reconstruction) and optionally text_encoder(_2) / vae_decoder (RTN at
    # searched scales), as export's int8.components names them
    components: list[str] = dataclasses.field(default_factory=lambda: ["unet"])
    text_encoder: Optional[bool] = None  # deprecated: components: [unet, text_encoder]
    vae_decoder: Optional[bool] = None  # deprecated: components: [unet, vae_decoder]

    def __post_init__(self) -> None:
        for old in ("text_encoder", "vae_decoder"):
            if getattr(self, old) is not None:
                deprecated(f"quant.{old}: {str(getattr(self, old)).lower()}", f"quant.components: [unet, {old}]")
                if getattr(self, old) and old not in self.components:
                    self.components = [*self.components, old]
                setattr(self, old, None)
        for c in self.components:
            require(c in QUANTIZABLE, "quant.components", f"unknown component {c!r}; choose from {QUANTIZABLE}")
            require(c in CALIBRATED, "quant.components", f"calibrate quantizes {', '.join(CALIBRATED)}, not {c} "
                    "(export's int8.rtn quantizes any registry component)")
        require("unet" in self.components, "quant.components", "must list unet (calibrate reconstructs the UNet)")
        require(self.bits in (4, 8), "quant.bits", f"must be 4 or 8, got {self.bits}")
        require(self.group_size is None or self.group_size >= 2, "quant.group_size", "must be >= 2 or null")
        for k, v in self.layer_bits.items():
            require(v in (4, 8), f"quant.layer_bits.{k}", f"must be 4 or 8, got {v}")


@dataclasses.dataclass
class ParityConfig:
    """Named thresholds; a miss raises ParityError (no checkpoint is written)."""

    min_unet_cosine: Optional[float] = None  # held-out UNet-output cosine; None: 0.99 at W8, 0.9 at W4
    min_text_encoder_cosine: Optional[float] = None  # same defaults
    min_vae_decoder_cosine: Optional[float] = None  # same defaults
    recon_not_worse_than_rtn: bool = True  # held-out UNet cosine of reconstruction >= RTN's - 1e-4


@dataclasses.dataclass
class OutputConfig:
    rtn_pipeline: bool = True  # also write rtn/pipeline/ (a diffusers folder of the RTN baseline)
    samples: int = 4  # held-out prompts in the float / RTN / reconstruction grid (0: none)
    sample_steps: Optional[int] = None  # default: calib.steps


@dataclasses.dataclass
class Config:
    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    perturb_norms: float = 0.0  # built (random) models only: perturb_norm_affines(scale) on every component
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    cpu_threads: Optional[int] = None  # torch CPU threads (None: torch's default); 1 is much faster on a busy small box
    # GiB of device memory this process may take (CUDA: torch.cuda.set_per_process_memory_fraction); on
    # every device each block's need is checked against it before reconstruction (a clear error naming
    # the block). With recon.stream, SD-2.1 calibrates in 24.
    memory_cap_gib: Optional[float] = None
    # GiB of host memory the run may take: its need (compress/quant/host_memory.py) is predicted from the config
    # and the model's shapes before any work and must fit; streamed block caches get what the rest leaves
    # (in capture groups), or go to disk (recon.host_cache) when one block's cache does not fit.
    host_cap_gib: Optional[float] = None
    calib: CalibDataConfig = dataclasses.field(default_factory=CalibDataConfig)
    quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)
    recon: ReconConfig = dataclasses.field(default_factory=ReconConfig)
    parity: ParityConfig = dataclasses.field(default_factory=ParityConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        require(self.perturb_norms >= 0, "perturb_norms", "must be >= 0")
        require(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads", "must be >= 1 or null")
        require(self.memory_cap_gib is None or self.memory_cap_gib > 0, "memory_cap_gib", "must be > 0 or null")
        require(self.host_cap_gib is None or self.host_cap_gib > 0, "host_cap_gib", "must be > 0 or null")
        require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
                f"must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.model.pretrained:
            _check_pretrained_folder(self.model.pretrained)


def _check_pretrained_folder(source: str) -> None:
    """A local checkpoint folder must hold a diffusers UNet (checked before anything is written)."""
    path = Path(source).expanduser()
    if not path.exists():
        return  # a hub id, or a missing folder: load_pipeline reports it
    unet = path / "unet"
    require(unet.is_dir() and (unet / "config.json").is_file(), "model.pretrained",
            f"{path} has no unet/ with a config.json (not a diffusers pipeline folder with a UNet)")
    require(any(unet.glob("*.safetensors")) or any(unet.glob("*.safetensors.index.json")), "model.pretrained",
            f"{path}/unet has no *.safetensors weights")
