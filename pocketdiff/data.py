"""Captioned image datasets: every source becomes a `datasets.Dataset` with columns
"image" (PIL RGB, resolution x resolution) and "text" (str).

Sources (`DataConfig.source`):

- `shapes`: the embedded procedural set (`pocketdiff.shapes`), needs no files.
- `openmoji`: `<data.path or shared root/openmoji>/openmoji_128_png32.zip` + `metadata.jsonl`
  (imagefolder style: `file_name` + caption column); RGBA composited on white. Read straight
  from the zip (nothing is extracted); an extracted folder with the same metadata works too.
- `cifar10`: `<data.path or shared root/cifar10_jpg>/cifar10_{split}_jpg.zip`, entries
  `<split>/<class>/<NNNN>.jpg`; caption "a photo of a(n) {class}".
- `imagefolder`: a local folder (or its `<split>/` subfolder) with images and one or more
  `metadata.jsonl` / `metadata.csv` files (`file_name` relative to the metadata file).
- `hub`: `datasets.load_dataset(data.path, split=data.split)`.

`image_column` / `caption_column` pick the columns of `imagefolder` and `hub` sources (and
the caption field of OpenMoji's metadata); they are renamed to "image" / "text".

Order: items are listed in a fixed source order, permuted with `numpy.random.default_rng(
seed)`, then cut to `max_samples`; only the kept images are decoded. So `load_captions(cfg)`
equals `load_captioned_dataset(cfg)["text"]` and costs no image decoding.

Processed images (composited, centre-cropped, resized, PNG-encoded) are cached in memory per
(source file, resolution), so repeated loads in one process are quick (`clear_cache()`).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence

import datasets
import numpy as np
import torch
from PIL import Image

from . import shapes as _shapes
from .config import DataConfig
from .errors import PocketdiffError

__all__ = [
    "shared_data_root",
    "load_captioned_dataset",
    "load_captions",
    "ImageCaptionDataset",
    "collate",
    "clear_cache",
    "OPENMOJI_ZIP",
    "CIFAR10_CLASSES",
]

OPENMOJI_ZIP = "openmoji_128_png32.zip"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
METADATA_NAMES = ("metadata.jsonl", "metadata.csv")

FEATURES = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})


# ----------------------------------------------------------------------------- paths


def shared_data_root() -> Optional[Path]:
    """$POCKETDIFF_DATA if set, else <repo>/../shared/data if it exists, else None."""
    env = os.environ.get("POCKETDIFF_DATA")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parent.parent
    candidate = repo.parent / "shared" / "data"
    return candidate if candidate.is_dir() else None


def _source_root(cfg: DataConfig, default_subdir: str) -> Path:
    if cfg.path:
        root = Path(cfg.path).expanduser()
    else:
        shared = shared_data_root()
        if shared is None:
            raise PocketdiffError(
                f"data.path: not set and no shared data root for source={cfg.source!r} "
                "(set $POCKETDIFF_DATA, create ../shared/data next to the repo, or pass data.path=FOLDER)"
            )
        root = shared / default_subdir
    if not root.exists():
        raise PocketdiffError(f"data.path: {root} does not exist (source={cfg.source!r})")
    if not root.is_dir():
        raise PocketdiffError(f"data.path: {root} is not a folder (source={cfg.source!r})")
    return root


# ----------------------------------------------------------------------------- images


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _open_image(data: bytes, name: str) -> Image.Image:
    if not data:
        raise PocketdiffError(f"{name}: image file is empty (0 bytes)")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise PocketdiffError(f"{name}: unreadable image ({_first_line(e)})") from None
    return img


def _has_alpha(img: Image.Image) -> bool:
    return img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white."""
    if _has_alpha(img):
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        out = Image.new("RGB", rgba.size, (255, 255, 255))
        out.paste(rgba, mask=rgba.getchannel("A"))  # alpha blend onto white
        return out
    return img if img.mode == "RGB" else img.convert("RGB")


def to_rgb_square(img: Image.Image, resolution: int) -> Image.Image:
    """Alpha composited on white, RGB, centre-cropped to a square, resized (bicubic)."""
    img = to_rgb(img)
    w, h = img.size
    if w != h:
        s = min(w, h)
        left, top = (w - s) // 2, (h - s) // 2
        img = img.crop((left, top, left + s, top + s))
    if img.size != (resolution, resolution):
        img = img.resize((resolution, resolution), Image.Resampling.BICUBIC, reducing_gap=2.0)
    return img


def _encode_png(img: Image.Image) -> bytes:
    # Small images are stored uncompressed (fast to write and, during training, to decode);
    # larger ones with light deflate to keep memory reasonable.
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=0 if max(img.size) <= 64 else 1)
    return buf.getvalue()


def _process_bytes(data: bytes, name: str, resolution: int) -> bytes:
    img = _open_image(data, name)
    if img.mode == "RGB" and img.size == (resolution, resolution) and img.format in ("PNG", "JPEG") and not _has_alpha(img):
        return data  # already what we store: keep the original encoding
    return _encode_png(to_rgb_square(img, resolution))


# ----------------------------------------------------------------------------- listings


@dataclasses.dataclass
class _Listing:
    """Captions in a fixed source order plus a way to produce processed image bytes."""

    texts: list[str]
    group: Hashable  # identity of the underlying files (cache key, with the resolution)
    render: Callable[[Sequence[int], int], list[bytes]]  # (indices, resolution) -> PNG/JPEG bytes
    describe: str  # for the "empty dataset" message


_cache_lock = threading.Lock()
_cache: "OrderedDict[tuple, dict[int, bytes]]" = OrderedDict()
_cache_bytes = 0
CACHE_MAX_BYTES = 1 << 30


def clear_cache() -> None:
    """Drop the in-process cache of processed images."""
    global _cache_bytes
    with _cache_lock:
        _cache.clear()
        _cache_bytes = 0


def _images_cached(listing: _Listing, indices: Sequence[int], resolution: int) -> list[bytes]:
    global _cache_bytes
    key = (listing.group, resolution)
    with _cache_lock:
        store = _cache.get(key)
        if store is None:
            store = _cache[key] = {}
        _cache.move_to_end(key)
    missing = [int(i) for i in indices if int(i) not in store]
    if missing:
        fresh = listing.render(missing, resolution)
        with _cache_lock:
            for i, b in zip(missing, fresh):
                store[i] = b
            _cache_bytes += sum(len(b) for b in fresh)
            while _cache_bytes > CACHE_MAX_BYTES and len(_cache) > 1:
                _, old = _cache.popitem(last=False)
                _cache_bytes -= sum(len(b) for b in old.values())
    return [store[int(i)] for i in indices]  # `store` keeps its items even if evicted meanwhile


def _file_id(path: Path) -> tuple:
    st = path.stat()
    return (str(path.resolve()), st.st_mtime_ns, st.st_size)


def _caption_value(value: Any, where: str, column: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return value[0]  # several captions per image: the first one
    raise PocketdiffError(f"{where}: caption column {column!r} holds {type(value).__name__} {value!r:.60}, expected a string")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PocketdiffError(f"{path}: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None


def _read_metadata(path: Path) -> list[tuple[str, dict]]:
    """Rows of an imagefolder metadata file as (\"file:line\", row) pairs."""
    text = _read_text(path)
    rows: list[tuple[str, dict]] = []
    if path.suffix == ".csv":
        try:
            for n, row in enumerate(csv.DictReader(io.StringIO(text, newline="")), start=2):
                rows.append((f"{path}:{n}", dict(row)))
        except csv.Error as e:
            raise PocketdiffError(f"{path}: invalid CSV ({_first_line(e)})") from None
        return rows
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PocketdiffError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise PocketdiffError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        rows.append((f"{path}:{n}", row))
    return rows


def _metadata_columns(rows: list[tuple[str, dict]], image_column: str, caption_column: str, what: str) -> None:
    """Check the caption / image columns exist; errors list the available columns."""
    keys: dict[str, None] = {}
    for _, row in rows:
        keys.update(dict.fromkeys(row))
    available = ["image"] + [k for k in keys if k != "file_name"]
    if image_column != "image":
        raise PocketdiffError(
            f"data.image_column: image column {image_column!r} not found in {what}; available columns: {available} "
            "(imagefolder images come from file_name as column 'image')"
        )
    if caption_column not in keys:
        raise PocketdiffError(
            f"data.caption_column: caption column {caption_column!r} not found in {what}; available columns: {available}"
        )


def _metadata_listing(
    cfg: DataConfig, root: Path, meta_files: list[Path], zip_path: Optional[Path], image_column: str
) -> _Listing:
    """imagefolder-style metadata; images either in `zip_path` or next to the metadata files."""
    rows: list[tuple[str, dict]] = []
    bases: list[Path] = []
    for mf in meta_files:
        got = _read_metadata(mf)
        rows += got
        bases += [mf.parent] * len(got)
    what = ", ".join(str(m) for m in meta_files)
    if not rows:
        raise PocketdiffError(f"{what}: dataset is empty (no rows) (data.path={root})")
    _metadata_columns(rows, image_column, cfg.caption_column, what)

    names = [r.get("file_name") for _, r in rows]
    for (where, _), name in zip(rows, names):
        if not isinstance(name, str) or not name:
            raise PocketdiffError(f"{where}: row has no 'file_name' (imagefolder metadata needs file_name)")
    texts = []
    for where, row in rows:
        if cfg.caption_column not in row:
            raise PocketdiffError(f"{where}: row has no caption column {cfg.caption_column!r}")
        texts.append(_caption_value(row[cfg.caption_column], where, cfg.caption_column))

    if zip_path is not None:
        with zipfile.ZipFile(zip_path) as zf:
            present = set(zf.namelist())
        for (where, _), name in zip(rows, names):
            if name not in present:
                raise PocketdiffError(f"{where}: file_name {name!r} is not in {zip_path}")
        group = ("zip-meta", _file_id(zip_path), tuple(_file_id(m) for m in meta_files))

        def render(indices: Sequence[int], resolution: int) -> list[bytes]:
            out = []
            with zipfile.ZipFile(zip_path) as zf:
                for i in indices:
                    out.append(_process_bytes(zf.read(names[i]), f"{zip_path}::{names[i]}", resolution))
            return out

        return _Listing(texts, group, render, f"{root}")

    files = [base / name for base, name in zip(bases, names)]
    stats = []
    for (where, _), f in zip(rows, files):
        try:
            st = f.stat()
        except OSError:
            st = None
        if st is None or not f.is_file():
            raise PocketdiffError(f"{where}: image file {f} not found")
        stats.append((st.st_mtime_ns, st.st_size))
    # any edited image (or metadata) makes a new cache group
    group = ("folder-meta", tuple(_file_id(m) for m in meta_files), tuple(str(f) for f in files), tuple(stats))

    def render_files(indices: Sequence[int], resolution: int) -> list[bytes]:
        out = []
        for i in indices:
            try:
                data = files[i].read_bytes()
            except OSError as e:
                raise PocketdiffError(f"{files[i]}: cannot read image ({_first_line(e)})") from None
            out.append(_process_bytes(data, str(files[i]), resolution))
        return out

    return _Listing(texts, group, render_files, f"{root}")


def _find_metadata(root: Path) -> list[Path]:
    found = [p for p in root.rglob("metadata.*") if p.name in METADATA_NAMES and p.is_file()]
    return sorted(found, key=lambda p: (len(p.relative_to(root).parts), str(p)))


def _listing_imagefolder(cfg: DataConfig) -> _Listing:
    root = _source_root(cfg, "")
    if (root / cfg.split).is_dir():
        root = root / cfg.split
    meta = _find_metadata(root)
    if not meta:
        has_images = any(p.suffix.lower() in IMAGE_EXTENSIONS for p in root.rglob("*"))
        if not has_images:
            raise PocketdiffError(f"data.path: {root} is empty (no images, no metadata.jsonl)")
        raise PocketdiffError(
            f"data.path: {root} has no metadata.jsonl or metadata.csv "
            f"(imagefolder needs file_name and the caption column {cfg.caption_column!r})"
        )
    return _metadata_listing(cfg, root, meta, None, cfg.image_column)


def _listing_openmoji(cfg: DataConfig) -> _Listing:
    root = _source_root(cfg, "openmoji")
    meta = root / "metadata.jsonl"
    if not meta.is_file():
        raise PocketdiffError(f"data.path: {root} has no metadata.jsonl (expected the OpenMoji folder)")
    zip_path = root / OPENMOJI_ZIP
    if not zip_path.is_file():
        zips = sorted(root.glob("*.zip"))
        zip_path = zips[0] if len(zips) == 1 else None  # None: PNGs extracted next to metadata.jsonl
    return _metadata_listing(cfg, root, [meta], zip_path, "image")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def cifar_caption(class_name: str) -> str:
    return f"a photo of {_article(class_name)} {class_name}"


def _listing_cifar10(cfg: DataConfig) -> _Listing:
    root = _source_root(cfg, "cifar10_jpg")
    zip_path = root / f"cifar10_{cfg.split}_jpg.zip"
    if not zip_path.is_file():
        avail = sorted(p.name[len("cifar10_"):-len("_jpg.zip")] for p in root.glob("cifar10_*_jpg.zip"))
        raise PocketdiffError(f"data.split: {cfg.split!r} has no {zip_path.name} in {root}; available splits: {avail}")
    try:
        with zipfile.ZipFile(zip_path) as zf:
            names = sorted(
                n for n in zf.namelist() if not n.endswith("/") and n.lower().endswith(IMAGE_EXTENSIONS)
            )
    except zipfile.BadZipFile as e:
        raise PocketdiffError(f"{zip_path}: not a readable zip ({_first_line(e)})") from None
    texts = []
    for n in names:
        parts = n.split("/")
        if len(parts) < 2:
            raise PocketdiffError(f"{zip_path}::{n}: expected entries '<split>/<class>/<file>.jpg'")
        texts.append(cifar_caption(parts[-2]))

    def render(indices: Sequence[int], resolution: int) -> list[bytes]:
        with zipfile.ZipFile(zip_path) as zf:
            return [_process_bytes(zf.read(names[i]), f"{zip_path}::{names[i]}", resolution) for i in indices]

    return _Listing(texts, ("cifar10", _file_id(zip_path)), render, f"{zip_path}")


def _listing_shapes(cfg: DataConfig) -> _Listing:
    specs = _shapes.sample_specs(cfg.shapes_count, cfg.seed)

    def render(indices: Sequence[int], resolution: int) -> list[bytes]:
        return [_encode_png(_shapes.render(specs[i], resolution)) for i in indices]

    return _Listing([s.caption for s in specs], ("shapes", cfg.seed, cfg.shapes_count), render, "shapes")


def _hub_image_bytes(value: Any, where: str) -> tuple[bytes, str]:
    if isinstance(value, Image.Image):
        return _encode_png(value if value.mode in ("RGB", "RGBA", "L", "LA", "P") else value.convert("RGB")), where
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        if value.get("bytes"):
            return value["bytes"], value.get("path") or where
        value = value["path"]
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), where
    if isinstance(value, str):
        try:
            return Path(value).read_bytes(), value
        except OSError as e:
            raise PocketdiffError(f"{where}: cannot read image {value} ({_first_line(e)})") from None
    raise PocketdiffError(f"{where}: image column holds {type(value).__name__}, expected an image")


def _listing_hub(cfg: DataConfig) -> _Listing:
    try:
        ds = datasets.load_dataset(cfg.path, split=cfg.split)
    except PocketdiffError:
        raise
    except Exception as e:  # offline, unknown id, unknown split, bad files: all user-facing
        raise PocketdiffError(
            f"data.path: cannot load dataset {cfg.path!r} split {cfg.split!r} ({type(e).__name__}: {_first_line(e)})"
        ) from e
    if isinstance(ds, datasets.DatasetDict):  # pragma: no cover - split is always given
        raise PocketdiffError(f"data.split: {cfg.path!r} needs a split; available: {list(ds)}")
    cols = list(ds.column_names)
    if cfg.caption_column not in cols:
        raise PocketdiffError(f"data.caption_column: caption column {cfg.caption_column!r} not found in {cfg.path!r}; available columns: {cols}")
    if cfg.image_column not in cols:
        raise PocketdiffError(f"data.image_column: image column {cfg.image_column!r} not found in {cfg.path!r}; available columns: {cols}")
    feat = ds.features[cfg.caption_column]
    raw = ds[cfg.caption_column]
    if isinstance(feat, datasets.ClassLabel):
        texts = [feat.int2str(int(v)) for v in raw]
    else:
        texts = [_caption_value(v, f"{cfg.path}[{cfg.split}] row {i}", cfg.caption_column) for i, v in enumerate(raw)]
    if isinstance(ds.features[cfg.image_column], datasets.Image):
        ds = ds.cast_column(cfg.image_column, datasets.Image(decode=False))
    image_col = cfg.image_column

    def render(indices: Sequence[int], resolution: int) -> list[bytes]:
        out = []
        values = ds.select(list(indices))[image_col]
        for i, v in zip(indices, values):
            data, name = _hub_image_bytes(v, f"{cfg.path}[{cfg.split}] row {i}")
            out.append(_process_bytes(data, name, resolution))
        return out

    group = ("hub", cfg.path, cfg.split, image_col, getattr(ds, "_fingerprint", id(ds)))
    return _Listing(texts, group, render, f"{cfg.path!r} split {cfg.split!r}")


_LISTINGS: dict[str, Callable[[DataConfig], _Listing]] = {
    "shapes": _listing_shapes,
    "openmoji": _listing_openmoji,
    "cifar10": _listing_cifar10,
    "imagefolder": _listing_imagefolder,
    "hub": _listing_hub,
}


def _listing(cfg: DataConfig) -> tuple[_Listing, np.ndarray]:
    if cfg.source not in _LISTINGS:
        raise PocketdiffError(f"data.source: unknown source {cfg.source!r}; one of {sorted(_LISTINGS)}")
    listing = _LISTINGS[cfg.source](cfg)
    n = len(listing.texts)
    if n == 0:
        raise PocketdiffError(f"data: {cfg.source} dataset at {listing.describe} is empty")
    order = np.random.default_rng(cfg.seed).permutation(n)
    if cfg.max_samples is not None:
        order = order[: cfg.max_samples]
    return listing, order


# ----------------------------------------------------------------------------- public API


def load_captioned_dataset(cfg: DataConfig) -> datasets.Dataset:
    """Columns "image" (PIL RGB, resolution x resolution) and "text" (str); shuffled by
    `cfg.seed`, then cut to `cfg.max_samples`."""
    listing, order = _listing(cfg)
    images = _images_cached(listing, order, cfg.resolution)
    texts = [listing.texts[i] for i in order]
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "text": texts}, features=FEATURES
    )


def load_captions(cfg: DataConfig) -> list[str]:
    """The captions of `load_captioned_dataset(cfg)`, same order, without decoding images."""
    listing, order = _listing(cfg)
    return [listing.texts[i] for i in order]


def pil_to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL RGB -> float32 [3, H, W] in [-1, 1]."""
    # numpy, not torch ops: a per-item conversion must not wake torch's intra-op thread pool
    # (on a busy machine that costs ~100x at 128 px).
    arr = np.asarray(to_rgb(img), dtype=np.uint8).transpose(2, 0, 1)
    out = arr.astype(np.float32, order="C")
    out *= 1.0 / 127.5
    out -= 1.0
    return torch.from_numpy(out)


class ImageCaptionDataset(torch.utils.data.Dataset):
    """Training view of a captioned `datasets.Dataset`:
    item -> {"pixel_values": float32 [3, R, R] in [-1, 1], "text": str}.

    `resolution` (optional) resizes images that are not already R x R."""

    def __init__(self, dataset: datasets.Dataset, resolution: Optional[int] = None) -> None:
        missing = [c for c in ("image", "text") if c not in dataset.column_names]
        if missing:
            raise PocketdiffError(f"dataset lacks column(s) {missing}; available columns: {dataset.column_names}")
        self.dataset = dataset
        self.resolution = resolution

    @classmethod
    def from_config(cls, cfg: DataConfig) -> "ImageCaptionDataset":
        return cls(load_captioned_dataset(cfg), cfg.resolution)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[int(index)]
        img = row["image"]
        img = to_rgb_square(img, self.resolution) if self.resolution is not None else to_rgb(img)
        return {"pixel_values": pil_to_tensor(img), "text": row["text"]}


def collate(batch: list[dict]) -> dict:
    """{"pixel_values": [B, 3, R, R], "text": list[str]} (other keys: stacked tensors or lists)."""
    if not batch:
        raise ValueError("collate: empty batch")
    out: dict = {}
    for key in batch[0]:
        values = [item[key] for item in batch]
        out[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
    return out


class InMemoryImageCaptionDataset(torch.utils.data.Dataset):
    """`ImageCaptionDataset` decoded once into one uint8 tensor [N, 3, R, R].

    Training reads every item many times; decoding PNGs per item starves a GPU (a tiny
    model at batch 128 waits on the decoder). Items are the same as the wrapped dataset's."""

    def __init__(self, source: ImageCaptionDataset) -> None:
        first = source[0]["pixel_values"]
        self.pixels = torch.empty((len(source), *first.shape), dtype=torch.uint8)
        self.texts: list[str] = []
        for i in range(len(source)):
            item = source[i]
            self.pixels[i] = ((item["pixel_values"] + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
            self.texts.append(item["text"])

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> dict:
        return {"pixel_values": self.pixels[int(index)].float() / 127.5 - 1.0, "text": self.texts[int(index)]}
