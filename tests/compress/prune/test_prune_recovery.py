"""Recovery distillation: the pruned student moves towards the unpruned teacher."""
from __future__ import annotations

import pytest
import torch

from pocketdiff.compress.prune.verb import Probe, PruneSettings, prune_unet
from pocketdiff.compress.prune.recovery import FeatureTap, RecoveryConfig, block_names, recover
from pocketdiff.config import DataConfig
from pocketdiff.data import ImageCaptionDataset, collate, load_captioned_dataset
from pocketdiff.errors import ConfigError
from pocketdiff.models import ModelConfig, build_pipeline, embedded_teacher_dir, load_pipeline, perturb_norm_affines
from pocketdiff.train.loop import LoopConfig


@pytest.fixture(scope="module")
def setup():
    """The shipped (trained) shapes teacher when present, else a random tiny pipeline."""
    ds = load_captioned_dataset(DataConfig(source="shapes", shapes_count=16, resolution=32))
    folder = embedded_teacher_dir()
    if (folder / "model_index.json").is_file():
        pipe = load_pipeline(str(folder))
    else:
        pipe = build_pipeline(ModelConfig(arch="tiny"), captions=list(ds["text"]), resolution=32)
        perturb_norm_affines(pipe.unet, 0)
    return pipe, ImageCaptionDataset(ds)


def test_feature_tap_sees_every_block(setup):
    pipe, _ = setup
    names = block_names(pipe.unet)
    assert names == ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"]
    tap = FeatureTap(pipe.unet, names)
    with torch.no_grad():
        pipe.unet(torch.randn(1, 4, 8, 8), torch.tensor([3]), encoder_hidden_states=torch.randn(1, 77, 64))
    feats = tap.pop()
    tap.remove()
    assert list(feats) == names and feats["mid_block"].shape == (1, 64, 4, 4)


def test_distillation_reduces_teacher_error(setup, tmp_path):
    pipe, dataset = setup
    teacher = pipe.unet.eval().requires_grad_(False)
    student, _ = prune_unet(teacher, PruneSettings(ratio=0.4, importance="random", groupnorm="per_group", round_to=8))
    probe = Probe(pipe, teacher, dataset, 8, seed=0, device=torch.device("cpu"))
    before = probe.error(student)["mse_to_teacher"]
    loop = LoopConfig(max_steps=4, batch_size=4, lr=5e-4, checkpoint_every=4, log_every=1)
    res = recover(RecoveryConfig(output_weight=1.0), loop, student=student,
                  teacher=teacher, pipe=pipe, dataset=dataset, collate=collate, ckpt_dir=tmp_path / "ckpt", seed=0)
    after = probe.error(student)["mse_to_teacher"]
    assert res["steps"] == 4 and set(res["last_loss_parts"]) == {"output_kd"}
    assert after < 0.6 * before, (before, after)
    assert not any(p.requires_grad for p in teacher.parameters())


def test_recovery_config_checks():
    with pytest.raises(ConfigError, match="recovery"):
        RecoveryConfig(output_weight=0, task_weight=0, feature_weight=0)
    with pytest.raises(ConfigError, match="caption_dropout"):
        RecoveryConfig(caption_dropout=1.0)
