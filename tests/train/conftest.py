"""Fixtures shared by the distill tests."""
import pytest


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A tiny random CLIP folder for the metrics path (pocketdiff.evaluate's own builders)."""
    train_clip = pytest.importorskip("pocketdiff.evaluate.train_clip")
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.tokenizer import build_clip_tokenizer

    tok = build_clip_tokenizer(load_captions(DataConfig(source="shapes", shapes_count=64, resolution=32)), vocab_size=560, model_max_length=16)
    mcfg = train_clip.ClipModelConfig(image_size=32, patch_size=8, vision_width=32, vision_layers=1, vision_heads=2, text_width=32,
                                      text_layers=1, text_heads=2, max_length=16, projection_dim=16, vocab_size=560)
    model, processor = train_clip.build_clip(mcfg, tok, seed=0)
    out = tmp_path_factory.mktemp("clip") / "clip"
    train_clip.save_clip(model, processor, out, {"domain": "test", "label": "test-CLIP"})
    return out


@pytest.fixture(scope="session")
def save_shapes_teacher(tmp_path_factory):
    """A function `(**model) -> folder`: a teacher built from `ModelConfig(**model)` (random weights, its tokenizer
    trained on 16 shapes captions) at 32 px, saved as a pipeline folder; what the distill tests train from."""
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captions
    from pocketdiff.models import ModelConfig, build_pipeline, save_pipeline

    def make(**model):
        captions = load_captions(DataConfig(source="shapes", shapes_count=16, resolution=32))
        pipe = build_pipeline(ModelConfig(**model), captions=captions, resolution=32)
        return save_pipeline(pipe, tmp_path_factory.mktemp("teacher") / "pipeline")

    return make
