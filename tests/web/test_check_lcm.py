"""The page's check mode on a consistency (LCM) student's bundle in headless Chromium: 2 steps, so the
page re-noises once with run-bundle's draw (reference/noise.bin), and its image matches run-bundle's.
The bundle is tests/conftest.py's `lcm_bundle_2_steps` (its `lcm_student` exported; shared with tests/export). Skips only when Chromium is absent."""
from __future__ import annotations

import shutil

import pytest

@pytest.fixture(scope="module")
def checked(tmp_path_factory, lcm_bundle_2_steps, check_against_reference):
    """The page written into a copy of the session's 2-step LCM bundle (tests/conftest.py), then its check mode."""
    bundle = tmp_path_factory.mktemp("web_lcm") / "bundle"
    shutil.copytree(lcm_bundle_2_steps, bundle, ignore=shutil.ignore_patterns("_export"))
    return check_against_reference(bundle)


def test_page_runs_an_lcm_bundle_as_run_bundle_does(checked):
    r, ref, man = checked["result"], checked["reference"], checked["manifest"]
    assert man["scheduler"]["type"] == "lcm" and man["scheduler"]["steps"] == 2
    assert ref["noise"] == "noise.bin" and ref["noise_shape"] == [1, *ref["latents_shape"]]
    assert r["ok"] is True, r.get("failures") or r.get("error")
    assert r["image"]["finite"] and r["image"]["psnr_db"] >= 30.0
    assert len(r["latency_ms"]["unet_steps_ms"]) == 2
