"""The FID network, Inception-v3 as TensorFlow's 2015-12-05 graph computes it, for torchmetrics.

torchmetrics' built-in Inception (`FrechetInceptionDistance(feature=2048)`) comes from
torch-fidelity, and `import torch_fidelity` imports torchvision. No torchvision build exists
for the pinned CPU torch 2.13 on the package registries (PyPI's torchvision 0.28.0 is the CUDA
build: its `_C.so` links libtorch_cuda.so / libc10_cuda.so, and `import torchvision` then fails
with "operator torchvision::nms does not exist"; download.pytorch.org is not reachable). So
pocketdiff carries the network itself and hands it to torchmetrics as a custom feature module:

- `FIDInceptionV3`: the FID variant of Inception-v3 (pool3, 2048-d): images resized to 299 x 299
  with TensorFlow 1.x bilinear sampling (`tf1_resize_bilinear`), scaled to [-1, 1], average
  pools that exclude padding and a max pool in the last block, as in the TF graph. Its
  parameter names are those of the published PyTorch port of the TF weights
  (torch-fidelity's `weights-inception-2015-12-05-6726825d.pth`, pytorch-fid's
  `pt_inception-2015-12-05-6726825d.pth`), so those files load as they are.
- `inception_state_dict(path)`: the weights, read safely (safetensors, or
  ``torch.load(weights_only=True)``: never an unpickler that runs code); without a path, the
  torch-fidelity file from the torch hub cache, downloaded once when missing.
- `STANDARD_SHA256`: the sha256 of that file; only those weights make the distance "FID".
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.outputs import atomic_path, read_safetensors, sha256_file

INPUT_SIZE = 299
NUM_FEATURES = 2048
WEIGHTS_URL = "https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/weights-inception-2015-12-05-6726825d.pth"
WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
# sha256 of the PyTorch port of TF's inception-2015-12-05 (95,628,359 bytes); torch hub names
# such files by their sha256 prefix (-6726825d), which pytorch-fid's copy shares
STANDARD_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
KEY = "metrics.inception_weights"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- resizing


def _tf1_axis(x: torch.Tensor, out: int, dim: int) -> torch.Tensor:
    """Resize one spatial axis the TF 1.x way (align_corners=False, no half-pixel offset):
    output index i samples input position i * in / out, linearly between its two neighbours."""
    n = x.shape[dim]
    if n == out:
        return x
    # float32 positions, as TF computes them (float64 would move samples by up to ~1e-5 px)
    pos = torch.arange(out, dtype=torch.float32, device=x.device) * torch.tensor(n / out, dtype=torch.float32)
    lo = pos.long().clamp_(max=n - 1)
    hi = (lo + 1).clamp_(max=n - 1)
    w = (pos - lo.float()).to(x.dtype)
    shape = [1] * x.dim()
    shape[dim] = out
    w = w.view(shape)
    a, b = x.index_select(dim, lo), x.index_select(dim, hi)
    return a + (b - a) * w


def tf1_resize_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """[N, C, H, W] float -> [N, C, size, size], TensorFlow 1.x `resize_bilinear` sampling
    (along the rows first, then between them, as TF does)."""
    return _tf1_axis(_tf1_axis(x, size, 3), size, 2)


# ----------------------------------------------------------------------------- network


class BasicConv2d(nn.Module):
    """conv (no bias) -> batch norm (eps 1e-3, TF's) -> ReLU."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg3(x: torch.Tensor) -> torch.Tensor:  # TF's SAME average pool: padding not counted
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):  # 35 x 35 blocks (Mixed_5b-d)
    def __init__(self, cin: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch1x1(x), b5, b3, self.branch_pool(_avg3(x))], 1)


class InceptionB(nn.Module):  # 35 -> 17 (Mixed_6a)
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):  # 17 x 17 blocks with factorised 7 x 7 convolutions (Mixed_6b-e)
    def __init__(self, cin: int, c7: int) -> None:
        super().__init__()
        row, col = dict(kernel=(1, 7), padding=(0, 3)), dict(kernel=(7, 1), padding=(3, 0))
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, **row)
        self.branch7x7_3 = BasicConv2d(c7, 192, **col)
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, **row)
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, **row)
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            d = layer(d)
        return torch.cat([self.branch1x1(x), b7, d, self.branch_pool(_avg3(x))], 1)


class InceptionD(nn.Module):  # 17 -> 8 (Mixed_7a)
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):  # 8 x 8 blocks with split 1x3 / 3x1 outputs (Mixed_7b, Mixed_7c)
    def __init__(self, cin: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool  # TF's last block pools with max, the one before with average
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _avg3(x)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(s), self.branch3x3_2b(s),
                          self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d), self.branch_pool(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """Inception-v3 pool3 features for FID: uint8 [N, 3, H, W] (any H, W) -> float32 [N, 2048].

    Float input is read as [0, 255] pixel values, as uint8 is. `fc` (the 1008-way logits) is
    kept only so the published state dicts load strictly; it is not used. Always in eval mode.
    """

    num_features = NUM_FEATURES

    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)
        self.fc = nn.Linear(2048, 1008)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> "FIDInceptionV3":
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4 or images.shape[1] != 3:
            raise PocketdiffError(f"Inception FID: expected images [N, 3, H, W], got {tuple(images.shape)}")
        x = images.to(self.fc.weight.device, torch.float32)
        x = tf1_resize_bilinear(x, INPUT_SIZE)
        x = (x - 128.0) / 128.0
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, 3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
                      self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return x.mean(dim=(2, 3))


# ----------------------------------------------------------------------------- weights


def read_tensor_file(path: Path, key: str = KEY) -> dict:
    """A state dict of tensors from .safetensors, or from a torch file through
    ``torch.load(weights_only=True)`` (code-carrying pickles are refused, never run)."""
    if path.suffix == ".safetensors":
        state = read_safetensors(path, key)
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - pickles with code are refused here
            raise PocketdiffError(
                f"{key}: {path} is not a plain tensor state dict (refused by torch.load(weights_only=True): {_first_line(e)})"
            ) from None
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise PocketdiffError(f"{key}: {path} is not a state dict of tensors")
    return state


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("POCKETDIFF_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _download(url: str, dst: Path) -> None:  # a seam for tests (monkeypatched to fail)
    torch.hub.download_url_to_file(url, str(dst), progress=False)


def default_weights_file() -> Path:
    """The torch-fidelity weights file, from torch hub's cache (`$TORCH_HOME/hub/checkpoints`,
    where torch-fidelity keeps it too); downloaded there once when missing."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_FILE
    if path.is_file():
        return path
    hint = f"pass {KEY}=FILE (a local copy of {WEIGHTS_FILE}, .pth or .safetensors) for offline use"
    if _offline():
        raise PocketdiffError(f"metrics.features=inception: the Inception weights are not in {path.parent} and downloads are off (offline); {hint}")
    try:
        with atomic_path(path) as tmp:  # a failed or wrong download leaves nothing behind
            _download(WEIGHTS_URL, tmp)
            got = sha256_file(tmp)
            if got != STANDARD_SHA256:
                raise PocketdiffError(f"downloaded file has sha256 {got[:16]}..., expected {STANDARD_SHA256[:16]}...")
    except Exception as e:  # noqa: BLE001 - no network, proxy, corrupt download: one line
        raise PocketdiffError(f"metrics.features=inception: cannot get the Inception weights ({type(e).__name__}: {_first_line(e)}); {hint}") from None
    return path


def seeded_random_state(seed: int = 0) -> dict:
    """A seeded random state dict for FIDInceptionV3 (torch-fidelity's parameter names), for offline
    checks without the FID weights: He-normal convolutions and near-identity batch norms, so features
    neither vanish nor explode. Never the FID network: scores with it are named by their file."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in FIDInceptionV3().state_dict().items():
        if k.endswith("conv.weight"):
            state[k] = torch.randn(v.shape, generator=g) * (2.0 / v[0].numel()) ** 0.5
        elif k.endswith(("bn.weight", "running_var")):
            state[k] = 1 + 0.1 * torch.rand(v.shape, generator=g)
        elif k.endswith(("bn.bias", "running_mean")) or k.startswith("fc."):
            state[k] = 0.05 * torch.randn(v.shape, generator=g)
        else:  # num_batches_tracked
            state[k] = v
    return state


def load_fid_inception(weights_path: Optional[str] = None) -> tuple[FIDInceptionV3, dict]:
    """(network with the weights loaded, info: {"weights", "sha256", "standard"}).

    `standard` is True only for the published TF-port weights (sha256 `STANDARD_SHA256`); the
    distance is then FID, otherwise an FD on Inception-v3 features of other weights.
    """
    if weights_path:
        path = Path(str(weights_path)).expanduser()
        if not path.is_file():
            raise PocketdiffError(f"{KEY}: {path} is not a file")
    else:
        path = default_weights_file()
    sha = sha256_file(path)
    state = read_tensor_file(path)
    with torch.device("meta"):  # no random init of 24M parameters that are overwritten next
        model = FIDInceptionV3()
    own = model.state_dict()
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    expected = {k for k in own if not k.endswith("num_batches_tracked")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = "; ".join(s for s in (
            f"{len(missing)} missing (e.g. {', '.join(missing[:3])})" if missing else "",
            f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})" if unexpected else "",
        ) if s)
        raise PocketdiffError(f"{KEY}: {path} is not an Inception-v3 FID state dict (as torch-fidelity's {WEIGHTS_FILE}): {what}")
    bad = [k for k in sorted(state) if tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        raise PocketdiffError(f"{KEY}: {path}: {k} has shape {tuple(state[k].shape)}, Inception-v3 has {tuple(own[k].shape)}"
                              + (f" ({len(bad) - 1} more)" if len(bad) > 1 else ""))
    full = {k: state[k].float().contiguous() if k in state else torch.zeros((), dtype=torch.long) for k in own}
    model.load_state_dict(full, strict=True, assign=True)
    model.requires_grad_(False)
    info = {"weights": str(path), "sha256": sha, "standard": sha == STANDARD_SHA256}
    return model.eval(), info
