"""The shipped default teacher loads in stock diffusers and draws what it is asked for."""
import pytest
from diffusers import StableDiffusionPipeline

from pocketdiff.models import embedded_teacher_dir
from pocketdiff.sampling import generate


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_embedded_teacher_loads_and_draws_the_named_colour():
    pipe = StableDiffusionPipeline.from_pretrained(str(embedded_teacher_dir()), safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    prompts = ["a large red circle in the center", "a large blue square in the center"]
    images = generate(pipe, prompts, steps=20, guidance_scale=3.0, seed=0).numpy()  # [2,3,32,32] in [0,1]
    center = images[:, :, 12:20, 12:20].mean(axis=(2, 3))  # mean RGB of the middle
    red, blue = center
    assert red[0] > 0.6 and red[2] < 0.4, red
    assert blue[2] > 0.5 and blue[0] < 0.4, blue
    corners = images[:, :, :3, :3].mean()
    assert corners > 0.8  # white background
