"""FD through torchmetrics with CLIP features (Inception: test_inception.py): self-distance ~0, growth with a controlled shift,
the reference-statistics cache (hit, and invalidation when the data changes), bad references."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from pocketdiff.config import DataConfig
from pocketdiff.errors import PocketdiffError
from pocketdiff.evaluate import MetricConfig, MetricSetup

REF = DataConfig(source="shapes", shapes_count=96, resolution=32)


def _setup(clip_dir, cache_dir, reference=REF, **kw):
    cfg = MetricConfig(features="clip", clip=str(clip_dir), clip_score=False, cache_dir=str(cache_dir), batch_size=64, **kw)
    return MetricSetup(cfg, reference=reference)


def _darken(images: torch.Tensor, amount: float) -> torch.Tensor:
    return (images.float() * (1.0 - amount)).round().to(torch.uint8)


def test_fd_against_itself_is_about_zero_and_grows_with_a_controlled_shift(tiny_clip_dir, cache_dir, shapes_uint8):
    setup = _setup(tiny_clip_dir, cache_dir)
    assert setup.fd_label == "FD (tinytest-CLIP)"  # honest name: never "FID" for CLIP features
    images, _ = shapes_uint8(96)  # exactly the reference images
    self_fd = setup.fd(images)
    shifted = [setup.fd(_darken(images, a)) for a in (0.1, 0.3, 0.6)]
    assert shifted[0] > 0
    assert abs(self_fd) < 1e-3 * shifted[0], (self_fd, shifted)
    assert shifted[0] < shifted[1] < shifted[2], shifted


def test_fd_between_two_given_sets(tiny_clip_dir, cache_dir, shapes_uint8):
    setup = _setup(tiny_clip_dir, cache_dir, reference=None)
    images, _ = shapes_uint8(64)
    same = setup.fd_between(images, images)
    other = setup.fd_between(_darken(images, 0.5), images)
    assert abs(same) < 1e-3 * other


def test_reference_statistics_are_cached_and_reused(tiny_clip_dir, cache_dir, shapes_uint8):
    first = _setup(tiny_clip_dir, cache_dir)
    info1 = first.prepare()
    assert info1["cache"].startswith("miss")
    images, _ = shapes_uint8(96, seed=5)
    fd1 = first.fd(_darken(images, 0.2))
    second = _setup(tiny_clip_dir, cache_dir)
    info2 = second.prepare()
    assert info2["cache"] == "hit" and info2["cache_key"] == info1["cache_key"]
    assert second.fd(_darken(images, 0.2)) == pytest.approx(fd1, rel=1e-9, abs=1e-9)
    # another data config (one more item) -> another key
    third = _setup(tiny_clip_dir, cache_dir, reference=DataConfig(source="shapes", shapes_count=97, resolution=32))
    info3 = third.prepare()
    assert info3["cache"].startswith("miss") and info3["cache_key"] != info1["cache_key"]


def _write_folder(folder, colours):
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, c in enumerate(colours):
        Image.new("RGB", (32, 32), c).save(folder / f"{i}.png")
        rows.append(json.dumps({"file_name": f"{i}.png", "text": f"a square number {i}"}))
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")


def test_reference_cache_is_invalidated_when_the_images_change(tiny_clip_dir, cache_dir, tmp_path):
    from pocketdiff.data import clear_cache

    folder = tmp_path / "imgs"
    colours = [(i * 30, 255 - i * 30, (i * 70) % 256) for i in range(6)]
    _write_folder(folder, colours)
    ref = DataConfig(source="imagefolder", path=str(folder), resolution=32)
    a = _setup(tiny_clip_dir, cache_dir, reference=ref).prepare()
    b = _setup(tiny_clip_dir, cache_dir, reference=ref).prepare()
    assert b["cache"] == "hit"
    # same config, same file names and captions, one image's pixels changed
    Image.new("RGB", (32, 32), (1, 2, 3)).save(folder / "2.png")
    clear_cache()  # the data module's in-process image cache is keyed by the metadata file only
    c = _setup(tiny_clip_dir, cache_dir, reference=ref).prepare()
    assert c["cache"].startswith("miss") and c["data_sha256"] != a["data_sha256"] and c["cache_key"] != a["cache_key"]


def test_reference_smaller_than_two_images_is_a_clear_error(tiny_clip_dir, cache_dir):
    setup = _setup(tiny_clip_dir, cache_dir, reference=DataConfig(source="shapes", shapes_count=1, resolution=32))
    with pytest.raises(PocketdiffError, match=r"reference: shapes .* has 1 image\(s\); FD needs at least 2"):
        setup.prepare()


def test_fd_needs_two_generated_images(tiny_clip_dir, cache_dir, shapes_uint8):
    setup = _setup(tiny_clip_dir, cache_dir)
    images, _ = shapes_uint8(4)
    with pytest.raises(PocketdiffError, match="at least 2 generated images"):
        setup.fd(images[:1])


def test_uint8_and_float_images_give_the_same_fd(tiny_clip_dir, cache_dir, shapes_uint8):
    setup = _setup(tiny_clip_dir, cache_dir)
    images, _ = shapes_uint8(32, seed=3)
    assert setup.fd(images) == pytest.approx(setup.fd(images.float() / 255.0), rel=1e-6)
