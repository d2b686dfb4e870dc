"""pocketdiff/normfree.py: folding a decoder's up-path GroupNorms into affines, saving and loading it."""
import pytest
import torch
from torch import nn

from pocketdiff.errors import PocketdiffError
from pocketdiff.models import build_vae, load_vae, perturb_norm_affines
from pocketdiff.normfree import (ChannelAffine, NORM_FREE_KEY, calibrate_group_stats, fold_group_norms, has_group_norm_up_path,
                                 norm_free_names, up_path_norm_names)


@pytest.fixture(scope="module")
def vae():
    v = build_vae("tiny", 32, 0).eval().requires_grad_(False)
    perturb_norm_affines(v, 1)
    return v


def _folded(vae, z):
    import copy

    s = copy.deepcopy(vae)
    fold_group_norms(s, calibrate_group_stats(s, [z], up_path_norm_names(s)))
    return s


def test_fold_on_one_image_reproduces_its_decode(vae):
    # calibrated on exactly the latent it decodes, the fixed statistics are that image's: the same function there
    z = torch.randn(1, 4, 8, 8)
    s = _folded(vae, z)
    assert not has_group_norm_up_path(s) and has_group_norm_up_path(vae)
    assert isinstance(s.decoder.conv_norm_out, ChannelAffine)
    torch.testing.assert_close(s.decode(z).sample, vae.decode(z).sample, rtol=1e-4, atol=1e-4)
    # another image: a different result (the fold is an approximation elsewhere)
    z2 = torch.randn(1, 4, 8, 8) * 2.0 + 0.5
    assert (s.decode(z2).sample - vae.decode(z2).sample).abs().max() > 1e-3


def test_mid_block_norms_stay(vae):
    s = _folded(vae, torch.randn(1, 4, 8, 8))
    assert any(isinstance(m, nn.GroupNorm) for m in s.decoder.mid_block.modules())
    assert all(n.startswith("decoder.up_blocks.") or n == "decoder.conv_norm_out" for n in norm_free_names(s))


def test_saved_folder_loads_norm_free(vae, tmp_path):
    z = torch.randn(1, 4, 8, 8)
    s = _folded(vae, z)
    s.save_pretrained(str(tmp_path / "vae"))
    assert norm_free_names(tmp_path / "vae") == norm_free_names(s) and len(norm_free_names(s)) == len(up_path_norm_names(vae))
    loaded = load_vae(str(tmp_path / "vae")).eval()
    assert not has_group_norm_up_path(loaded)
    assert loaded.config[NORM_FREE_KEY] == norm_free_names(s)
    z2 = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded.decode(z2).sample, s.decode(z2).sample)


def test_calibration_needs_images(vae):
    with pytest.raises(PocketdiffError, match="no images"):
        calibrate_group_stats(vae, [], up_path_norm_names(vae))
