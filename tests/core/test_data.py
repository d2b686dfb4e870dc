"""pocketdiff.data: every source -> datasets.Dataset("image" RGB RxR, "text" str)."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from pocketdiff import data
from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError
from pocketdiff.shapes import COLOURS, POSITIONS, SIZES, sample_specs


def _shared(sub: str) -> Path:
    root = data.shared_data_root()
    if root is None:
        pytest.skip("no shared data root (../shared/data or $POCKETDIFF_DATA) on this machine")
    if not (root / sub).is_dir():
        pytest.skip(f"{root / sub} is absent on this machine")
    return root / sub


def _png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write_folder(root: Path, rows: list[tuple[str, Image.Image, dict]], meta_name: str = "metadata.jsonl") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, img, _ in rows:
        img.save(root / name)
    (root / meta_name).write_text("\n".join(json.dumps({"file_name": n, **m}) for n, _, m in rows) + "\n")
    return root


# ----------------------------------------------------------------------------- shared root


def test_shared_data_root_env_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("POCKETDIFF_DATA", str(tmp_path))
    assert data.shared_data_root() == tmp_path
    monkeypatch.delenv("POCKETDIFF_DATA")
    root = data.shared_data_root()
    expected = Path(data.__file__).resolve().parent.parent.parent / "shared" / "data"
    assert root == (expected if expected.is_dir() else None)


# ----------------------------------------------------------------------------- shapes


def test_shapes_deterministic_by_seed_and_differs_across_seeds():
    a = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=64, seed=3, resolution=24))
    b = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=64, seed=3, resolution=24))
    c = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=64, seed=4, resolution=24))
    assert a.column_names == ["image", "text"] and len(a) == 64
    assert a["text"] == b["text"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a["image"], b["image"]))
    assert a["text"] != c["text"]
    assert sum(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a["image"], c["image"])) < 8
    # a new process would get the same: the specs do not depend on anything but (seed, i)
    assert sample_specs(10, 3) == sample_specs(64, 3)[:10]


def test_shapes_resolution_and_columns():
    for res in (16, 40):
        ds = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=8, resolution=res))
        assert ds.column_names == ["image", "text"]
        for img in ds["image"]:
            assert img.mode == "RGB" and img.size == (res, res)
        assert all(isinstance(t, str) and t.startswith("a ") for t in ds["text"])


def _parse_caption(text: str) -> tuple[str, str, str, str]:
    words = text.split()
    assert words[0] == "a"
    size, colour, shape = words[1], words[2], words[3]
    rest = " ".join(words[4:])
    for prefix in ("at the ", "on the ", "in the "):
        if rest.startswith(prefix):
            rest = rest[len(prefix):]
    return size, colour, shape, rest


def test_shapes_captions_match_what_was_drawn():
    res = 64
    ds = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=48, seed=11, resolution=res))
    palette = {name: np.array(rgb, dtype=float) for name, rgb in COLOURS.items()}
    seen_colours, seen_positions = set(), set()
    for img, text in zip(ds["image"], ds["text"]):
        size, colour, shape, position = _parse_caption(text)
        assert colour in COLOURS and size in SIZES and position in POSITIONS, text
        arr = np.asarray(img, dtype=float)
        dist_white = np.linalg.norm(arr - 255.0, axis=-1)
        ink = dist_white > 120  # clearly coloured pixels (anti-aliased edges excluded)
        assert ink.sum() > 20, text
        # colour: the dominant non-white colour is the one named
        median = np.median(arr[ink], axis=0)
        nearest = min(palette, key=lambda k: np.linalg.norm(palette[k] - median))
        assert nearest == colour, (text, median)
        # position: the centroid lies in the named third of the image
        ys, xs = np.nonzero(dist_white > 60)
        col, row = POSITIONS[position]
        for centre, cell in ((xs.mean() / res, col), (ys.mean() / res, row)):
            if cell == 0:
                assert centre < 0.42, (text, centre)
            elif cell == 1:
                assert 0.4 < centre < 0.6, (text, centre)
            else:
                assert centre > 0.58, (text, centre)
        # size: extent of the drawn shape
        extent = max(xs.max() - xs.min() + 1, ys.max() - ys.min() + 1) / res
        assert (extent < 0.4) if size == "small" else (extent > 0.4), (text, extent)
        # background stays white
        assert (dist_white < 1).mean() > 0.5
        seen_colours.add(colour)
        seen_positions.add(position)
    assert len(seen_colours) >= 5 and len(seen_positions) >= 6  # the check covered variety


def test_shuffle_then_max_samples_and_captions_match():
    cfg_all = DataConfig(source="shapes", shapes_count=40, seed=5)
    full = data.load_captions(cfg_all)
    cut = data.load_captions(DataConfig(source="shapes", shapes_count=40, seed=5, max_samples=7))
    assert cut == full[:7]
    # the shuffled order is not the generation order
    assert full != [s.caption for s in sample_specs(40, 5)]
    assert sorted(full) == sorted(s.caption for s in sample_specs(40, 5))
    ds = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=40, seed=5, max_samples=7))
    assert ds["text"] == cut


def test_image_caption_dataset_and_collate():
    ds = data.load_captioned_dataset(DataConfig(source="shapes", shapes_count=6, resolution=16))
    tds = data.ImageCaptionDataset(ds)
    assert len(tds) == 6
    item = tds[0]
    x = item["pixel_values"]
    assert x.dtype == torch.float32 and x.shape == (3, 16, 16)
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert torch.allclose(x[:, 0, 0], torch.ones(3))  # white corner -> +1
    assert item["text"] == ds[0]["text"]
    ref = torch.from_numpy(np.asarray(ds[0]["image"], dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
    assert torch.allclose(x, ref)
    loader = torch.utils.data.DataLoader(tds, batch_size=4, collate_fn=data.collate)
    batch = next(iter(loader))
    assert batch["pixel_values"].shape == (4, 3, 16, 16)
    assert batch["text"] == ds["text"][:4]
    # resizing view
    assert data.ImageCaptionDataset(ds, resolution=8)[1]["pixel_values"].shape == (3, 8, 8)
    with pytest.raises(PocketdiffError, match="text"):
        data.ImageCaptionDataset(ds.remove_columns("text"))


# ----------------------------------------------------------------------------- openmoji / cifar10


def test_openmoji_loads_composited_on_white():
    _shared("openmoji")
    ds = data.load_captioned_dataset(DataConfig(source="openmoji", max_samples=24, resolution=32, seed=1))
    assert ds.column_names == ["image", "text"] and len(ds) == 24
    for img, text in zip(ds["image"], ds["text"]):
        assert img.mode == "RGB" and img.size == (32, 32)
        assert isinstance(text, str) and text
        # every OpenMoji PNG has a transparent (RGB black) corner: on white it must be white
        assert img.getpixel((0, 0)) == (255, 255, 255), text
        assert img.getpixel((31, 31)) == (255, 255, 255), text
    captions = data.load_captions(DataConfig(source="openmoji", seed=1))
    assert len(captions) == 4495
    assert captions[:24] == ds["text"]


def test_openmoji_caption_column_and_path_override(tmp_path):
    root = _shared("openmoji")
    tags = data.load_captions(DataConfig(source="openmoji", path=str(root), caption_column="tags", max_samples=50))
    texts = data.load_captions(DataConfig(source="openmoji", path=str(root), max_samples=50))
    assert len(tags) == 50 and tags != texts
    with pytest.raises(PocketdiffError, match=r"'nope'.*available columns.*'text'"):
        data.load_captions(DataConfig(source="openmoji", caption_column="nope"))


def test_cifar10_captions_and_images():
    _shared("cifar10_jpg")
    caps = data.load_captions(DataConfig(source="cifar10", split="test"))
    assert len(caps) == 10000
    expected = {f"a photo of {'an' if c[0] in 'aeiou' else 'a'} {c}" for c in data.CIFAR10_CLASSES}
    assert set(caps) == expected
    assert "a photo of an airplane" in caps and "a photo of an automobile" in caps and "a photo of a cat" in caps
    assert caps.count("a photo of a frog") == 1000
    ds = data.load_captioned_dataset(DataConfig(source="cifar10", split="train", max_samples=12, resolution=24))
    assert len(ds) == 12 and set(ds["text"]) <= expected
    for img in ds["image"]:
        assert img.mode == "RGB" and img.size == (24, 24)
        assert np.asarray(img).std() > 5  # a real photo, not a blank
    with pytest.raises(PocketdiffError, match=r"data\.split.*'val'.*\['test', 'train'\]"):
        data.load_captions(DataConfig(source="cifar10", split="val"))


def test_cifar10_from_zip_in_custom_path(tmp_path):
    with zipfile.ZipFile(tmp_path / "cifar10_test_jpg.zip", "w") as zf:
        for cls, rgb in (("airplane", (0, 0, 255)), ("truck", (255, 0, 0))):
            buf = io.BytesIO()
            Image.new("RGB", (32, 32), rgb).save(buf, format="JPEG", quality=95)
            zf.writestr(f"test/{cls}/0000.jpg", buf.getvalue())
    ds = data.load_captioned_dataset(DataConfig(source="cifar10", path=str(tmp_path), split="test", resolution=32))
    by_text = {t: np.asarray(i, dtype=int) for i, t in zip(ds["image"], ds["text"])}
    assert set(by_text) == {"a photo of an airplane", "a photo of a truck"}
    assert by_text["a photo of an airplane"][..., 2].mean() > 240
    assert by_text["a photo of a truck"][..., 0].mean() > 240


# ----------------------------------------------------------------------------- imagefolder / hub


def test_imagefolder_custom_caption_column_alpha_and_crop(tmp_path):
    rgba = Image.new("RGBA", (40, 40), (0, 0, 0, 0))  # transparent black...
    rgba.paste((200, 0, 0, 255), (10, 10, 30, 30))  # ...with an opaque red square
    wide = Image.new("RGB", (60, 20), (0, 0, 255))
    wide.paste((0, 255, 0), (20, 0, 40, 20))  # green in the middle third
    root = _write_folder(
        tmp_path / "imgs",
        [("a.png", rgba, {"caption": "red square", "text": "x"}), ("b.png", wide, {"caption": "green bar", "text": "y"})],
    )
    cfg = DataConfig(source="imagefolder", path=str(root), caption_column="caption", resolution=20)
    ds = data.load_captioned_dataset(cfg)
    assert ds.column_names == ["image", "text"] and sorted(ds["text"]) == ["green bar", "red square"]
    imgs = dict(zip(ds["text"], ds["image"]))
    red = imgs["red square"]
    assert red.mode == "RGB" and red.size == (20, 20)
    assert red.getpixel((0, 0)) == (255, 255, 255)  # alpha composited on white
    assert red.getpixel((10, 10))[0] > 180 and red.getpixel((10, 10))[1] < 30
    bar = np.asarray(imgs["green bar"], dtype=int)  # centre crop keeps the green third only
    assert bar[..., 1].mean() > 200 and bar[..., 2].mean() < 30
    assert data.load_captions(cfg) == ds["text"]


def test_imagefolder_split_subfolder_and_csv(tmp_path):
    img = Image.new("RGB", (8, 8), (10, 20, 30))
    _write_folder(tmp_path / "train", [("t.png", img, {"text": "train image"})])
    (tmp_path / "test").mkdir()
    img.save(tmp_path / "test" / "u.png")
    (tmp_path / "test" / "metadata.csv").write_text("file_name,text\nu.png,\"test, image\"\n")
    assert data.load_captions(DataConfig(source="imagefolder", path=str(tmp_path), split="train")) == ["train image"]
    ds = data.load_captioned_dataset(DataConfig(source="imagefolder", path=str(tmp_path), split="test", resolution=8))
    assert ds["text"] == ["test, image"] and ds[0]["image"].getpixel((3, 3)) == (10, 20, 30)


def test_imagefolder_cache_sees_edited_image(tmp_path):
    root = _write_folder(tmp_path, [("a.png", Image.new("RGB", (8, 8), (255, 0, 0)), {"text": "t"})])
    cfg = DataConfig(source="imagefolder", path=str(root), resolution=8)
    assert data.load_captioned_dataset(cfg)[0]["image"].getpixel((0, 0)) == (255, 0, 0)
    Image.new("RGB", (9, 9), (0, 0, 255)).save(root / "a.png")
    assert data.load_captioned_dataset(cfg)[0]["image"].getpixel((0, 0)) == (0, 0, 255)


def test_hub_source_through_load_dataset_on_local_folder(tmp_path):
    root = _write_folder(
        tmp_path / "hubfolder",
        [(f"{i}.png", Image.new("RGB", (12, 12), (i * 60, 0, 0)), {"caption": f"shade {i}"}) for i in range(3)],
    )
    cfg = DataConfig(source="hub", path=str(root), caption_column="caption", resolution=10)
    ds = data.load_captioned_dataset(cfg)
    assert ds.column_names == ["image", "text"] and sorted(ds["text"]) == ["shade 0", "shade 1", "shade 2"]
    for img, text in zip(ds["image"], ds["text"]):
        assert img.size == (10, 10) and img.getpixel((5, 5))[0] == int(text[-1]) * 60
    with pytest.raises(PocketdiffError, match=r"caption column 'nope'.*available columns.*'caption'"):
        data.load_captions(DataConfig(source="hub", path=str(root), caption_column="nope"))
    with pytest.raises(PocketdiffError, match=r"image column 'pic'.*available columns.*'image'"):
        data.load_captions(DataConfig(source="hub", path=str(root), caption_column="caption", image_column="pic"))


def test_hub_unreachable_is_a_clean_error(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no retries against a network we lack
    with pytest.raises(PocketdiffError, match=r"data\.path.*'someone/not-a-dataset'"):
        data.load_captioned_dataset(DataConfig(source="hub", path="someone/not-a-dataset"))


# ----------------------------------------------------------------------------- errors


def test_missing_path_names_path_and_field(tmp_path):
    missing = tmp_path / "nowhere"
    for source in ("imagefolder", "openmoji", "cifar10"):
        with pytest.raises(PocketdiffError, match="data.path") as e:
            data.load_captioned_dataset(DataConfig(source=source, path=str(missing)))
        assert str(missing) in str(e.value) and "\n" not in str(e.value)


def test_absent_shared_root_is_reported(monkeypatch):
    monkeypatch.setattr(data, "shared_data_root", lambda: None)
    for source in ("openmoji", "cifar10"):
        with pytest.raises(PocketdiffError, match=r"data\.path.*shared data root"):
            data.load_captions(DataConfig(source=source))
    assert len(data.load_captions(DataConfig(source="shapes", shapes_count=3))) == 3  # needs no files


def test_missing_caption_and_image_columns(tmp_path):
    root = _write_folder(tmp_path, [("a.png", Image.new("RGB", (8, 8)), {"prompt": "p", "label": 3})])
    with pytest.raises(PocketdiffError) as e:
        data.load_captions(DataConfig(source="imagefolder", path=str(root)))
    msg = str(e.value)
    assert "'text'" in msg and "'prompt'" in msg and "'label'" in msg and "available columns" in msg
    with pytest.raises(PocketdiffError, match=r"image column 'img'.*available columns"):
        data.load_captions(DataConfig(source="imagefolder", path=str(root), caption_column="prompt", image_column="img"))
    with pytest.raises(PocketdiffError, match=r"'label'.*int"):  # a non-string caption names the column
        data.load_captions(DataConfig(source="imagefolder", path=str(root), caption_column="label"))


def test_empty_datasets(tmp_path):
    (tmp_path / "metadata.jsonl").write_text("\n")
    with pytest.raises(PocketdiffError, match="empty"):
        data.load_captioned_dataset(DataConfig(source="imagefolder", path=str(tmp_path)))
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(PocketdiffError, match=f"{empty}.*empty"):
        data.load_captioned_dataset(DataConfig(source="imagefolder", path=str(empty)))
    zdir = tmp_path / "zips"
    zdir.mkdir()
    zipfile.ZipFile(zdir / "cifar10_test_jpg.zip", "w").close()
    with pytest.raises(PocketdiffError, match="empty"):
        data.load_captioned_dataset(DataConfig(source="cifar10", path=str(zdir), split="test"))


def test_bad_files_are_named(tmp_path):
    good = Image.new("RGB", (8, 8), (1, 2, 3))
    root = _write_folder(tmp_path / "f", [("ok.png", good, {"text": "ok"})])
    (root / "zero.png").write_bytes(b"")
    (root / "junk.png").write_bytes(b"this is not an image")
    rows = [{"file_name": "ok.png", "text": "ok"}, {"file_name": "zero.png", "text": "zero"}]
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)))
    cfg = DataConfig(source="imagefolder", path=str(root))
    with pytest.raises(PocketdiffError, match=r"zero\.png.*empty"):
        data.load_captioned_dataset(cfg)
    rows[1]["file_name"] = "junk.png"
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)))
    with pytest.raises(PocketdiffError, match=r"junk\.png.*unreadable"):
        data.load_captioned_dataset(cfg)
    rows[1]["file_name"] = "gone.png"
    (root / "metadata.jsonl").write_text("\n".join(map(json.dumps, rows)))
    with pytest.raises(PocketdiffError, match=r"metadata\.jsonl:2.*gone\.png.*not found"):
        data.load_captions(cfg)
    (root / "metadata.jsonl").write_bytes(b'{"file_name": "ok.png", "text": "caf\xe9"}\n')  # latin-1, not UTF-8
    with pytest.raises(PocketdiffError, match=r"metadata\.jsonl.*UTF-8"):
        data.load_captions(cfg)
    (root / "metadata.jsonl").write_text('{"file_name": "ok.png", "text": "a"}\n{"file_name": \n')
    with pytest.raises(PocketdiffError, match=r"metadata\.jsonl:2.*invalid JSON"):
        data.load_captions(cfg)


def test_bad_entry_in_zip_is_named(tmp_path):
    with zipfile.ZipFile(tmp_path / "cifar10_test_jpg.zip", "w") as zf:
        zf.writestr("test/cat/0000.jpg", _png_bytes(Image.new("RGB", (32, 32))))
        zf.writestr("test/dog/0000.jpg", b"\xff\xd8 broken jpeg")
    with pytest.raises(PocketdiffError, match=r"cifar10_test_jpg\.zip::test/dog/0000\.jpg.*unreadable"):
        data.load_captioned_dataset(DataConfig(source="cifar10", path=str(tmp_path), split="test"))
