"""CLIP loading (bad folders), CLIP score with a trained domain CLIP, retrieval, train-clip."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.evaluate import MetricConfig, MetricSetup, load_clip
from pocketdiff.evaluate.retrieval import retrieval_from_embeddings


def test_clip_folder_that_is_not_a_clip_model_is_named(tiny_pipeline_dir, tmp_path):
    unet = tiny_pipeline_dir / "unet"
    with pytest.raises(PocketdiffError, match=rf"{unet}.* is not a CLIP model"):
        load_clip(str(unet))
    with pytest.raises(PocketdiffError, match=rf"{tiny_pipeline_dir} has no config.json"):
        load_clip(str(tiny_pipeline_dir))
    with pytest.raises(PocketdiffError, match="no such folder"):
        load_clip(str(tmp_path / "nowhere" / "clip"))
    with pytest.raises(PocketdiffError, match="pocketdiff:clip-nope: pocketdiff/assets/clip-nope is missing"):
        load_clip("pocketdiff:clip-nope")
    text_only = tmp_path / "text-only"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({"model_type": "clip_text_model"}))
    with pytest.raises(PocketdiffError, match="model_type 'clip_text_model'"):
        MetricSetup(MetricConfig(features="clip", clip=str(text_only)))


def test_clip_folder_without_processor_is_named(tiny_clip_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_clip_dir, broken)
    for f in list(broken.glob("*processor*")):
        f.unlink()
    with pytest.raises(PocketdiffError, match=rf"{broken} has no preprocessor_config.json"):
        load_clip(str(broken))


def test_loaded_clip_is_labelled_by_its_domain(tiny_clip_dir):
    clip = load_clip(str(tiny_clip_dir))
    assert clip.label == "tinytest-CLIP" and clip.image_size == 32


def test_retrieval_counts_duplicate_captions_as_correct():
    txt = torch.eye(3)
    img = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0.9, 0.1], [0.2, 0, 0.8]])
    r = retrieval_from_embeddings(torch.nn.functional.normalize(img, dim=-1), txt, np.array([0, 1, 1, 2]), ks=(1, 2))
    assert r["image_to_text_top1"] == 1.0 and r["text_to_image_top1"] == 1.0
    r = retrieval_from_embeddings(torch.nn.functional.normalize(img, dim=-1), txt, np.array([1, 0, 1, 2]), ks=(1, 2))
    assert r["image_to_text_top1"] == 0.5 and r["image_to_text_top2"] == 1.0
    assert r["chance_image_to_text_top1"] == pytest.approx(1 / 3)


def _shipped():
    from pocketdiff.evaluate import SHAPES_CLIP

    if not (Path(SHAPES_CLIP) / "config.json").is_file():
        pytest.skip("the shipped shapes CLIP is missing (pocketdiff/assets/clip-shapes)")
    return SHAPES_CLIP


def test_trained_shapes_clip_scores_matching_captions_above_shuffled(tmp_path, shapes_uint8):
    clip = _shipped()
    setup = MetricSetup(MetricConfig(features="clip", clip=clip, fd=False, cache_dir=str(tmp_path)))
    assert setup.clip_label == "CLIP score (shapes-CLIP)"
    images, captions = shapes_uint8(96, seed=77)  # a fresh draw, not the training items
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(captions))
    while any(captions[p] == captions[i] for i, p in enumerate(perm)):
        perm = rng.permutation(len(captions))
    matching = setup.clip_score(images, captions)
    shuffled = setup.clip_score(images, [captions[p] for p in perm])
    assert matching > shuffled + 5.0, (matching, shuffled)


def test_trained_shapes_clip_retrieves_held_out_captions(shapes_uint8):
    from pocketdiff.evaluate import retrieval_accuracy

    clip = load_clip(_shipped())
    images, captions = shapes_uint8(128, seed=78)
    r = retrieval_accuracy(clip.model, clip.processor, images, captions)
    assert r["image_to_text_top5"] > 10 * r["chance_image_to_text_top5"]


def test_train_clip_verb_writes_a_loadable_clip_folder(tmp_path):
    from pocketdiff.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "domain: unit\ndata: {source: shapes, shapes_count: 80, resolution: 16}\nholdout: 16\n"
        "model: {image_size: 16, patch_size: 8, vision_width: 32, vision_layers: 1, vision_heads: 2, text_width: 32,"
        " text_layers: 1, text_heads: 2, max_length: 16, projection_dim: 8, vocab_size: 540}\n"
        "train: {steps: 3, batch_size: 32, log_every: 1}\n"
    )
    out = tmp_path / "out"
    assert main(["train-clip", "--config", str(cfg), "--output", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    r = rep["retrieval_heldout"]
    assert r["num_images"] == 16 and 0 <= r["image_to_text_top1"] <= 1 and "image_to_text_top5" in r
    assert rep["data"]["train_items"] == 64 and len(rep["losses"]) == 3
    clip = load_clip(str(out / "clip"))
    assert clip.label == "unit-CLIP" and clip.meta["holdout"] == 16
    assert (out / "clip" / "vocab.json").is_file() and (out / "clip" / "merges.txt").is_file()
    assert (out / "index.html").is_file()


def test_train_clip_holdout_too_large_is_an_error(tmp_path):
    from pocketdiff.evaluate.train_clip import split_holdout

    with pytest.raises(PocketdiffError, match="holdout"):
        split_holdout(10, 9)
