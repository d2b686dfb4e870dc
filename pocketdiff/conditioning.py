"""What a UNet is conditioned on besides its latents and timestep: one object, `Conditioning`.

A Stable Diffusion (1.x / 2.x) UNet takes the text encoder's hidden states as
``encoder_hidden_states``. Other families take more: an SDXL-style UNet
(``addition_embed_type="text_time"``) also takes a pooled text embedding and six "added time ids"
(original size, crop top-left, target size) through ``added_cond_kwargs={"text_embeds", "time_ids"}``.
Every UNet call in the pipeline passes ``**cond.unet_kwargs()``, and every batch operation of
classifier-free guidance (cat, expand to the latent batch, chunk, slice, device/dtype moves) is a
method here, so the extra fields travel with the prompt embeddings without the callers knowing them.

A model family is an adapter: one entry of `FAMILIES` that turns prompts into a `Conditioning`
(`encode_conditioning`) and builds placeholder inputs for shape tracing (`placeholder_conditioning`),
chosen from the UNet's config (`family_of`). The SD adapter computes exactly what
`encode_prompts` always computed (a plain tensor, kept for its callers).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .errors import PocketdiffError
from .tokenizer import warn_if_truncated

# Conditioning field -> (the UNet keyword, the key inside added_cond_kwargs or None, expected dims)
_FIELDS = {
    "prompt_embeds": ("encoder_hidden_states", None, 3),
    "pooled_embeds": ("added_cond_kwargs", "text_embeds", 2),
    "time_ids": ("added_cond_kwargs", "time_ids", 2),
}


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: tensors have no single truth value
class Conditioning:
    """The UNet's conditioning for a batch of B rows.

    - `prompt_embeds` [B, L, D]: the text encoder's hidden states (``encoder_hidden_states``);
    - `pooled_embeds` [B, P] or None: a pooled text embedding (SDXL: ``added_cond_kwargs["text_embeds"]``);
    - `time_ids` [B, K] or None: added time ids (SDXL: ``added_cond_kwargs["time_ids"]``, K = 6).
    """

    prompt_embeds: torch.Tensor
    pooled_embeds: Optional[torch.Tensor] = None
    time_ids: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for name, (_, _, dims) in _FIELDS.items():
            v = getattr(self, name)
            if v is None and name == "prompt_embeds":
                raise PocketdiffError("conditioning.prompt_embeds is required (got None)")
            if v is None:
                continue
            if not isinstance(v, torch.Tensor):
                raise PocketdiffError(f"conditioning.{name} must be a tensor, got {type(v).__name__}")
            if v.dim() != dims:
                raise PocketdiffError(f"conditioning.{name} must have {dims} dims, got shape {tuple(v.shape)}")
            if v.shape[0] != self.prompt_embeds.shape[0]:
                raise PocketdiffError(f"conditioning.{name} has batch {v.shape[0]}, prompt_embeds has {self.prompt_embeds.shape[0]}")

    # ------------------------------------------------------------------ views

    @property
    def batch_size(self) -> int:
        return int(self.prompt_embeds.shape[0])

    @property
    def device(self) -> torch.device:
        return self.prompt_embeds.device

    @property
    def dtype(self) -> torch.dtype:
        return self.prompt_embeds.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by field name."""
        return {name: getattr(self, name) for name in _FIELDS if getattr(self, name) is not None}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Conditioning":
        """`fn` applied to every field that is set."""
        return Conditioning(**{name: fn(v) for name, v in self.tensors().items()})

    def unet_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of a diffusers UNet2DConditionModel call: ``encoder_hidden_states``,
        plus ``added_cond_kwargs`` when a pooled embedding or time ids are set."""
        kwargs: dict[str, Any] = {}
        for name, v in self.tensors().items():
            keyword, key, _ = _FIELDS[name]
            if key is None:
                kwargs[keyword] = v
            else:
                kwargs.setdefault(keyword, {})[key] = v
        return kwargs

    # ------------------------------------------------------------------ batch operations

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "Conditioning":
        """Every field moved to `device` and (floating fields) cast to `dtype`."""
        def move(v: torch.Tensor) -> torch.Tensor:
            return v.to(device=device, dtype=dtype if v.is_floating_point() else None)

        return self.map(move)

    def detach(self) -> "Conditioning":
        return self.map(torch.Tensor.detach)

    def __getitem__(self, rows) -> "Conditioning":
        """The rows `rows` (an int keeps its batch dimension)."""
        if isinstance(rows, int):
            if not -self.batch_size <= rows < self.batch_size:
                raise PocketdiffError(f"conditioning row {rows} is outside its batch of {self.batch_size}")
            rows = slice(rows % self.batch_size, rows % self.batch_size + 1)
        return self.map(lambda v: v[rows])

    def __len__(self) -> int:
        return self.batch_size

    def expand(self, batch: int, name: str = "conditioning") -> "Conditioning":
        """Broadcast a batch of 1 to `batch` rows (a view, no copy); a batch of `batch` is returned as is."""
        if self.batch_size == batch:
            return self
        if self.batch_size != 1:
            raise PocketdiffError(f"{name} has batch {self.batch_size}, latents have {batch}")
        return self.map(lambda v: v.expand(batch, *v.shape[1:]))

    def repeat(self, n: int) -> "Conditioning":
        """`n` copies one after the other along the batch (``cat([c] * n)``)."""
        return Conditioning.cat([self] * n)

    def chunk(self, n: int) -> tuple["Conditioning", ...]:
        """`n` equal parts along the batch (the inverse of `cat` of n equal parts)."""
        if self.batch_size % n:
            raise PocketdiffError(f"conditioning batch {self.batch_size} does not split into {n} equal parts")
        size = self.batch_size // n
        return tuple(self[i * size:(i + 1) * size] for i in range(n))

    @staticmethod
    def cat(parts: Sequence["Conditioning"]) -> "Conditioning":
        """Row-wise concatenation, e.g. classifier-free guidance's ``cat([uncond, cond])``."""
        if not parts:
            raise PocketdiffError("conditioning.cat needs at least one part")
        names = list(parts[0].tensors())
        for p in parts[1:]:
            if list(p.tensors()) != names:
                missing = sorted(set(names) ^ set(p.tensors()))
                raise PocketdiffError(f"conditioning.{missing[0]} is set in some parts of a cat and not in others")
        return Conditioning(**{n: torch.cat([p.tensors()[n] for p in parts]) for n in names})


def as_conditioning(value: Union[Conditioning, torch.Tensor, None]) -> Optional[Conditioning]:
    """A `Conditioning` as is; a plain tensor means prompt embeddings only (the SD family's whole
    conditioning, what `encode_prompts` returns); None stays None."""
    if value is None or isinstance(value, Conditioning):
        return value
    if isinstance(value, torch.Tensor):
        return Conditioning(prompt_embeds=value)
    raise PocketdiffError(f"conditioning must be a Conditioning or a tensor of prompt embeddings, got {type(value).__name__}")


# --------------------------------------------------------------------------------------
# Family adapters: prompts -> Conditioning
# --------------------------------------------------------------------------------------

def _config_get(unet_or_config: Any, key: str, default: Any = None) -> Any:
    config = getattr(unet_or_config, "config", unet_or_config)
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def _module_device(module: Any) -> torch.device:
    d = getattr(module, "device", None)
    if isinstance(d, torch.device):
        return d
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _tokenize(tokenizer, prompts: Sequence[str]):
    """Padded to the tokenizer's length and truncated there (a longer prompt warns once, naming its token count)."""
    L = tokenizer.model_max_length
    enc = tokenizer(list(prompts), padding="max_length", max_length=L, truncation=True, return_tensors="pt")
    full = [p for p, m in zip(prompts, enc.attention_mask) if int(m.sum()) >= L]  # only these can have been cut
    if full:  # tokenized again, untruncated, to name the count: the common short prompt is tokenized once
        warn_if_truncated(tokenizer, full, L)
    return enc


@torch.no_grad()
def encode_prompts(pipe, prompts: Union[str, Sequence[str]], device=None) -> torch.Tensor:
    """Text-encoder last hidden state [B, 77, D] (tokenizer padding="max_length", truncation),
    as StableDiffusionPipeline.encode_prompt computes it; moved to `device` when given.
    The SD family's whole conditioning (`encode_conditioning` wraps it)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    tokenizer, text_encoder = pipe.tokenizer, pipe.text_encoder
    te_device = _module_device(text_encoder)
    enc = _tokenize(tokenizer, prompts)
    mask = None
    if getattr(text_encoder.config, "use_attention_mask", False):
        mask = enc.attention_mask.to(te_device)
    hidden = text_encoder(enc.input_ids.to(te_device), attention_mask=mask)[0]
    return hidden.to(device) if device is not None else hidden


def _encode_sd(pipe, prompts: Sequence[str], device, unet) -> Conditioning:
    return Conditioning(prompt_embeds=encode_prompts(pipe, prompts, device))


def sdxl_time_ids(unet, vae, batch: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[batch, 6]: (original H, W, crop top, left, target H, W) of an uncropped image at the UNet's
    native size in pixels, as StableDiffusionXLPipeline's defaults give them."""
    from .models import vae_scale_factor

    side = _config_get(unet, "sample_size")
    h, w = (side, side) if isinstance(side, int) else tuple(side)
    factor = vae_scale_factor(vae)
    row = torch.tensor([h * factor, w * factor, 0, 0, h * factor, w * factor], dtype=dtype, device=device)
    return row.expand(batch, 6).clone()


@torch.no_grad()
def _encode_sdxl(pipe, prompts: Sequence[str], device, unet) -> Conditioning:
    """Two text encoders: their penultimate hidden states side by side, the second one's projected
    pooled output, the default added time ids (StableDiffusionXLPipeline.encode_prompt's recipe)."""
    hidden, pooled = [], None
    for name in ("", "_2"):
        tokenizer, encoder = getattr(pipe, "tokenizer" + name, None), getattr(pipe, "text_encoder" + name, None)
        if tokenizer is None or encoder is None:
            raise PocketdiffError(f"pipe.text_encoder{name} / pipe.tokenizer{name} missing: an SDXL-family model needs two text encoders")
        ids = _tokenize(tokenizer, prompts).input_ids.to(_module_device(encoder))
        out = encoder(ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]
    emb = torch.cat(hidden, dim=-1)
    time_ids = sdxl_time_ids(unet, pipe.vae, emb.shape[0], emb.dtype, emb.device)
    return Conditioning(prompt_embeds=emb, pooled_embeds=pooled, time_ids=time_ids).to(device)


def _placeholder_sd(config, batch: int, tokens: int, device, dtype) -> Conditioning:
    return Conditioning(prompt_embeds=torch.zeros(batch, tokens, config.cross_attention_dim, device=device, dtype=dtype))


def _placeholder_sdxl(config, batch: int, tokens: int, device, dtype) -> Conditioning:
    time_dim = int(config.addition_time_embed_dim)
    pooled = int(config.projection_class_embeddings_input_dim) - 6 * time_dim
    return Conditioning(prompt_embeds=torch.zeros(batch, tokens, config.cross_attention_dim, device=device, dtype=dtype),
                        pooled_embeds=torch.zeros(batch, pooled, device=device, dtype=dtype),
                        time_ids=torch.zeros(batch, 6, device=device, dtype=dtype))


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's adapter: how prompts become its `Conditioning`, and placeholder inputs of the
    right shapes (zeros; e.g. on the meta device) for tracing a UNet of the family."""

    name: str
    encode: Callable[..., Conditioning]  # (pipe, prompts, device, unet) -> Conditioning
    placeholder: Callable[..., Conditioning]  # (unet config, batch, tokens, device, dtype) -> Conditioning
    fields: tuple[str, ...] = ("prompt_embeds",)  # the Conditioning fields its UNet needs


# UNet config ``addition_embed_type`` -> the family adapter
FAMILIES: dict[Optional[str], Family] = {
    None: Family("sd", _encode_sd, _placeholder_sd),
    "text_time": Family("sdxl", _encode_sdxl, _placeholder_sdxl, ("prompt_embeds", "pooled_embeds", "time_ids")),
}


def family_of(unet) -> Family:
    """The adapter of a UNet (or its config), from ``addition_embed_type``."""
    kind = _config_get(unet, "addition_embed_type", None)
    if kind not in FAMILIES:
        known = ", ".join(repr(k) for k in FAMILIES)
        raise PocketdiffError(f"unet.addition_embed_type={kind!r} has no conditioning adapter (known: {known})")
    return FAMILIES[kind]


def check_conditioning(unet, cond: Conditioning) -> Conditioning:
    """`cond` when it has every field the family of `unet` needs, else a one-line error naming the field."""
    family = family_of(unet)
    missing = [name for name in family.fields if getattr(cond, name) is None]
    if missing:
        kind = _config_get(unet, "addition_embed_type", None)
        raise PocketdiffError(f"conditioning.{missing[0]} is required by a UNet with addition_embed_type={kind!r} "
                              f"(the {family.name} family); encode prompts with encode_conditioning")
    return cond


def encode_conditioning(pipe, prompts: Union[str, Sequence[str]], device=None, unet=None) -> Conditioning:
    """Prompts -> the `Conditioning` the family of `unet` (default ``pipe.unet``) takes, on `device`."""
    if isinstance(prompts, str):
        prompts = [prompts]
    unet = pipe.unet if unet is None else unet
    return family_of(unet).encode(pipe, list(prompts), device, unet)


def placeholder_conditioning(unet, batch: int = 1, tokens: int = 77, device=None,
                             dtype: torch.dtype = torch.float32) -> Conditioning:
    """Zeros of the shapes the family of `unet` (a model or its config) takes, for shape tracing."""
    config = getattr(unet, "config", unet)
    return family_of(config).placeholder(config, batch, tokens, device, dtype)
