"""Grids carry their prompts: captions wrap instead of being cut, rows and columns can be labelled."""
import numpy as np
import torch
from PIL import Image, ImageDraw

from pocketdiff.report import _wrap, image_grid

PROMPTS = ["a large green triangle at the bottom right", "a small blue square at the top left"]


def test_wrapped_captions_keep_every_word():
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    for prompt in PROMPTS:
        lines = _wrap(draw, prompt, 92)
        assert len(lines) > 1 and " ".join(lines) == prompt
        assert all(draw.textlength(line) <= 92 for line in lines)


def test_grid_writes_prompts_left_of_rows_and_models_over_columns():
    images = torch.full((4, 3, 32, 32), 0.5)
    plain = np.asarray(image_grid(images, 2, cell=64))
    grid = image_grid(images, 2, cell=64, row_labels=PROMPTS, col_labels=["teacher", "student"])
    arr = np.asarray(grid)
    assert grid.width == plain.shape[1] + 150 and grid.height > plain.shape[0]  # a text column and a header row
    top = grid.height - plain.shape[0]
    for r in range(2):  # each row's prompt is drawn in the left column beside it
        strip = arr[top + r * 64: top + (r + 1) * 64, :150]
        assert (strip < 100).any(), f"no text beside row {r}"
    assert (arr[:top, 150:] < 100).any()  # column headers
