"""runtime/onepass_decode.py (with export/onepass_vae.py's graphs): one-pass tiled decoding of a norm-free decoder."""
import copy

import numpy as np
import pytest
import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.export.components import VaeDecoderGraph
from pocketdiff.runtime.onepass_decode import one_pass_decode, tiles_area_ratio
from pocketdiff.export.onepass_vae import VaeUpPathPlain, check_tile_budget, largest_activation_mb
from pocketdiff.runtime.tiled_decode import psnr_db
from pocketdiff.export.tiled_vae import VaeDecoderHead
from pocketdiff.models import build_vae, perturb_norm_affines
from pocketdiff.normfree import calibrate_group_stats, fold_group_norms, up_path_norm_names


@pytest.fixture(scope="module")
def folded():
    v = build_vae("tiny", 96, 0).eval().requires_grad_(False)
    perturb_norm_affines(v, 1)
    s = copy.deepcopy(v)
    fold_group_norms(s, calibrate_group_stats(s, [torch.randn(2, 4, 12, 12)], up_path_norm_names(s)))
    return s


def _np(m):
    return lambda *a: m(*[torch.from_numpy(x) for x in a]).detach().numpy()


def _decode(vae, z, tile, overlap, margin):
    head, up = VaeDecoderHead(vae).eval(), VaeUpPathPlain(vae).eval()
    with torch.no_grad():
        return one_pass_decode(z, _np(head), _np(up), tile, overlap, 4, margin)


def test_one_tile_is_the_whole_decode(folded):
    z = np.random.default_rng(0).standard_normal((1, 4, 12, 12)).astype(np.float32)  # the tile covers it
    with torch.no_grad():
        whole = VaeDecoderGraph(folded).eval()(torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(_decode(folded, z, 12, 0, 0), whole, rtol=1e-4, atol=1e-4)


def test_margin_hides_the_tile_edges(folded):
    # the tiny up path sees ~8 latents around a pixel: a margin that deep leaves only rounding
    z = np.random.default_rng(1).standard_normal((1, 4, 24, 24)).astype(np.float32)
    with torch.no_grad():
        whole = VaeDecoderGraph(folded).eval()(torch.from_numpy(z)).numpy()
    no_margin = psnr_db(whole, _decode(folded, z, 16, 8, 0))
    deep = psnr_db(whole, _decode(folded, z, 20, 16, 8))
    strips = psnr_db(whole, _decode(folded, z, [16, 24], 8, 4))  # rows x the full width: seams along one axis
    assert no_margin < 40.0 and deep > 80.0 and no_margin < strips < deep, (no_margin, strips, deep)


def test_group_norm_decoder_is_refused():
    with pytest.raises(PocketdiffError, match="GroupNorms"):
        VaeUpPathPlain(build_vae("tiny", 32, 0))


def test_tile_over_budget_names_the_largest_that_fits(folded):
    up = VaeUpPathPlain(folded).eval()
    mb8 = largest_activation_mb(up, (torch.zeros(1, 64, 8, 8),))
    with pytest.raises(PocketdiffError, match=r"vae_tiling.tile: 8 latents .* tile (\d+) is the largest") as e:
        check_tile_budget(up, 64, 8, budget_mb=mb8 * 0.5)
    fit = int(str(e.value).split("tile ")[-1].split()[0])
    assert 1 <= fit < 8 and largest_activation_mb(up, (torch.zeros(1, 64, fit, fit),)) <= mb8 * 0.5
    assert largest_activation_mb(up, (torch.zeros(1, 64, fit + 1, fit + 1),)) > mb8 * 0.5


def test_area_ratio():
    assert tiles_area_ratio(64, 64, 36, 8) == pytest.approx((72 / 64) ** 2)
    assert tiles_area_ratio(64, 64, [32, 64], 16) == pytest.approx(1.5)  # three strips
    assert tiles_area_ratio(64, 64, 64, 0) == 1.0


def test_up_path_parts_decode_as_the_whole_up_path(folded):
    """`vae_tiling.up_parts`: the layers cut into K runs in call order, the largest run's parameters as small as a
    cut allows; the parts run one after another over every tile give the one-graph decode."""
    from pocketdiff.export.onepass_vae import VaeUpPathPart, plan_up_parts, up_path_layers
    from pocketdiff.runtime.onepass_decode import one_pass_decode_parts

    layers = up_path_layers(folded)
    sizes = {n: sum(p.numel() for p in m.parameters()) for n, m in layers.items()}
    z = np.random.default_rng(2).standard_normal((1, 4, 12, 12)).astype(np.float32)
    head = VaeDecoderHead(folded).eval()
    whole = _decode(folded, z, 8, 4, 2)
    for k in (2, 3):
        runs = plan_up_parts(folded, k)
        assert [n for run in runs for n in run] == list(layers) and all(runs)
        largest = max(sum(sizes[n] for n in run) for run in runs)
        names = list(layers)  # no single cut point does better for two runs
        if k == 2:
            best = min(max(sum(sizes[n] for n in names[:i]), sum(sizes[n] for n in names[i:])) for i in range(1, len(names)))
            assert largest == best
        parts = [VaeUpPathPart(folded, run).eval() for run in runs]
        with torch.no_grad():
            got = one_pass_decode_parts(z, _np(head), [lambda tiles, p=p: [_np(p)(t) for t in tiles] for p in parts], 8, 4, 4, 2)
        np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(PocketdiffError, match="vae_tiling.up_parts"):
        plan_up_parts(folded, len(layers) + 1)


def test_a_part_that_drops_tiles_is_refused(folded):
    from pocketdiff.runtime.onepass_decode import one_pass_decode_parts

    z = np.zeros((1, 4, 12, 12), np.float32)
    with pytest.raises(PocketdiffError, match="part 1 returned 1 tiles for 4"):
        one_pass_decode_parts(z, lambda x: np.zeros((1, 8, 12, 12), np.float32), [lambda t: t, lambda t: t[:1]], 8, 4, 4, 2)
