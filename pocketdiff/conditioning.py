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


def _encode_sd(pipe, prompts: Sequence[str], device, unet, resolution=None) -> Conditioning:
    return Conditioning(prompt_embeds=encode_prompts(pipe, prompts, device))


def _from_ids_sd(encoders, ids: Sequence[torch.Tensor], unet, size) -> Conditioning:
    """The SD family from token ids (no attention mask: the text encoders we build use none), with autograd as
    the caller has it (train-teacher trains the encoder through this)."""
    return Conditioning(prompt_embeds=encoders[0](ids[0])[0])


def _side(resolution) -> tuple[int, int]:
    return (int(resolution), int(resolution)) if isinstance(resolution, (int, float)) else tuple(int(v) for v in resolution)


def sdxl_time_ids(unet, vae, batch: int, dtype: torch.dtype = torch.float32, device=None,
                  resolution=None) -> torch.Tensor:
    """[batch, 6]: (original H, W, crop top, left, target H, W) as StableDiffusionXLPipeline's defaults give them:
    original size = target size = the generation resolution (`resolution`, pixels: an int or (H, W); default the
    UNet's native size times the VAE factor), crop (0, 0)."""
    h, w = _native_size(unet, vae) if resolution is None else _side(resolution)
    row = torch.tensor([h, w, 0, 0, h, w], dtype=dtype, device=device)
    return row.expand(batch, 6).clone()


def _from_ids_sdxl(encoders, ids: Sequence[torch.Tensor], unet, size) -> Conditioning:
    """Two text encoders: their penultimate hidden states side by side, the second one's projected pooled output,
    the added time ids at `size` (StableDiffusionXLPipeline.encode_prompt's recipe), autograd as the caller has it."""
    hidden, pooled = [], None
    for encoder, tokens in zip(encoders, ids):
        out = encoder(tokens, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]
    emb = torch.cat(hidden, dim=-1)
    return Conditioning(prompt_embeds=emb, pooled_embeds=pooled,
                        time_ids=sdxl_time_ids(unet, None, emb.shape[0], emb.dtype, emb.device, resolution=size))


def _towers(pipe, family: "Family") -> list[tuple[Any, Any]]:
    """(tokenizer, text encoder) of each of the family's text towers, or a one-line error naming the missing one."""
    towers = []
    for name in family.towers:
        tokenizer, encoder = getattr(pipe, "tokenizer" + name, None), getattr(pipe, "text_encoder" + name, None)
        if tokenizer is None or encoder is None:
            raise PocketdiffError(f"pipe.text_encoder{name} / pipe.tokenizer{name} missing: the {family.name} family "
                                  f"needs {len(family.towers)} text encoder(s)")
        towers.append((tokenizer, encoder))
    return towers


def _native_size(unet, vae) -> tuple[int, int]:
    from .models import vae_scale_factor

    factor = vae_scale_factor(vae)
    return tuple(v * factor for v in _side(_config_get(unet, "sample_size")))


@torch.no_grad()
def _encode_sdxl(pipe, prompts: Sequence[str], device, unet, resolution=None) -> Conditioning:
    towers = _towers(pipe, FAMILIES["text_time"])
    ids = [_tokenize(tok, prompts).input_ids.to(_module_device(enc)) for tok, enc in towers]
    size = _native_size(unet, pipe.vae) if resolution is None else resolution
    return _from_ids_sdxl([enc for _, enc in towers], ids, unet, size).to(device)


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
    encode: Callable[..., Conditioning]  # (pipe, prompts, device, unet, resolution) -> Conditioning
    placeholder: Callable[..., Conditioning]  # (unet config, batch, tokens, device, dtype) -> Conditioning
    fields: tuple[str, ...] = ("prompt_embeds",)  # the Conditioning fields its UNet needs
    from_ids: Optional[Callable[..., Conditioning]] = None  # (encoders, ids per tower, unet, (H, W)) -> Conditioning
    towers: tuple[str, ...] = ("",)  # suffixes of its (tokenizer, text_encoder) attributes: "" and "_2" for SDXL
    uncond_fields: tuple[str, ...] = ("prompt_embeds",)  # the fields a zero unconditional row zeroes (text outputs)


# UNet config ``addition_embed_type`` -> the family adapter
FAMILIES: dict[Optional[str], Family] = {
    None: Family("sd", _encode_sd, _placeholder_sd, from_ids=_from_ids_sd),
    "text_time": Family("sdxl", _encode_sdxl, _placeholder_sdxl, ("prompt_embeds", "pooled_embeds", "time_ids"),
                        from_ids=_from_ids_sdxl, towers=("", "_2"), uncond_fields=("prompt_embeds", "pooled_embeds")),
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


def encode_conditioning(pipe, prompts: Union[str, Sequence[str]], device=None, unet=None,
                        resolution=None) -> Conditioning:
    """Prompts -> the `Conditioning` the family of `unet` (default ``pipe.unet``) takes, on `device`, for images of
    `resolution` pixels (an int or (H, W); default the UNet's native size: SDXL's time ids carry it)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    unet = pipe.unet if unet is None else unet
    return family_of(unet).encode(pipe, list(prompts), device, unet, resolution)


def zero_unconditional(pipe) -> bool:
    """Whether an empty unconditional prompt is zeros rather than the encoding of "": the pipeline folder's
    ``force_zeros_for_empty_prompt`` (SDXL base sets it; StableDiffusionPipeline has no such flag: False)."""
    return bool(getattr(pipe, "config", None) is not None and _config_get(pipe, "force_zeros_for_empty_prompt", False))


def encode_unconditional(pipe, negative_prompts: Union[str, Sequence[str]], device=None, unet=None,
                         resolution=None) -> Conditioning:
    """The unconditional rows of classifier-free guidance. The rule (the bundle's ``conditioning.zero_unconditional``
    and the runners follow it): when `zero_unconditional(pipe)`, an empty negative prompt's row is zeros in the text
    fields (prompt and pooled embeddings; time ids as for the prompt), as StableDiffusionXLPipeline does with no
    negative prompt; a non-empty negative prompt is always encoded."""
    if isinstance(negative_prompts, str):
        negative_prompts = [negative_prompts]
    cond = encode_conditioning(pipe, negative_prompts, device, unet, resolution)
    empty = torch.tensor([p == "" for p in negative_prompts], device=cond.device)
    if not zero_unconditional(pipe) or not bool(empty.any()):
        return cond
    return zero_rows(cond, empty, family_of(pipe.unet if unet is None else unet))


def zero_rows(cond: Conditioning, rows: torch.Tensor, family: "Family") -> Conditioning:
    """`cond` with the text fields (``family.uncond_fields``) of the rows where `rows` (bool [B]) is true zeroed."""
    out = {}
    for name, v in cond.tensors().items():
        if name in family.uncond_fields:
            keep = (~rows).to(v.dtype).view(-1, *([1] * (v.dim() - 1)))
            v = v * keep
        out[name] = v
    return Conditioning(**out)


def pixel_size(latents: torch.Tensor, vae) -> tuple[int, int]:
    """(H, W) in pixels of the images that `latents` [B, C, h, w] decode to: the resolution their time ids carry."""
    from .models import vae_scale_factor

    factor = vae_scale_factor(vae)
    return int(latents.shape[-2]) * factor, int(latents.shape[-1]) * factor


def text_encoders(pipe, unet=None) -> list:
    """The text encoders of the family of `unet` (default ``pipe.unet``), in tower order (SDXL: two)."""
    unet = pipe.unet if unet is None else unet
    return [encoder for _, encoder in _towers(pipe, family_of(unet))]


def tokenize_prompts(pipe, prompts: Sequence[str], unet=None) -> tuple[torch.Tensor, ...]:
    """Token ids [B, 77] per text tower of the family of `unet` (default ``pipe.unet``), for `conditioning_from_ids`."""
    unet = pipe.unet if unet is None else unet
    return tuple(_tokenize(tok, list(prompts)).input_ids for tok, _ in _towers(pipe, family_of(unet)))


def conditioning_from_ids(encoders, ids: Sequence[torch.Tensor], unet, resolution) -> Conditioning:
    """The family's `Conditioning` from `tokenize_prompts`' ids and the text encoders (one per tower, in order),
    with autograd as the caller has it (a trained text encoder gets its gradients); `resolution`: the images'
    size in pixels (an int or (H, W)), SDXL's time ids."""
    family = family_of(unet)
    if len(encoders) != len(family.towers) or len(ids) != len(family.towers):
        raise PocketdiffError(f"the {family.name} family takes {len(family.towers)} text encoder(s) and id tensor(s), "
                              f"got {len(encoders)} and {len(ids)}")
    return family.from_ids(list(encoders), list(ids), unet, resolution)


def placeholder_conditioning(unet, batch: int = 1, tokens: int = 77, device=None,
                             dtype: torch.dtype = torch.float32) -> Conditioning:
    """Zeros of the shapes the family of `unet` (a model or its config) takes, for shape tracing."""
    config = getattr(unet, "config", unet)
    return family_of(config).placeholder(config, batch, tokens, device, dtype)


def drawn_conditioning(unet, batch: int, draw: Callable[[torch.Tensor], torch.Tensor], resolution,
                       tokens: int = 77) -> Conditioning:
    """Random conditioning for benchmarks and calibration sets: every field of `placeholder_conditioning` drawn by
    `draw` (a field's zeros -> its values, in field order), then a family's time ids replaced by those
    StableDiffusionXLPipeline gives `resolution`-pixel images (`sdxl_time_ids`); an SD family's as drawn."""
    cond = placeholder_conditioning(unet, batch, tokens).map(draw)
    if cond.time_ids is None:
        return cond
    return dataclasses.replace(cond, time_ids=sdxl_time_ids(unet, None, len(cond), resolution=resolution))
