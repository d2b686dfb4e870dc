"""The C-API engine (runtime/litert_c.py) on the real LiteRT GPU delegate (lavapipe here): the
accelerator's TOML options, outputs against the bundle's golden vectors, the program cache written
and read back."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pocketdiff.errors import PocketdiffError
from pocketdiff.runtime.litert_c import gpu_options_toml

BUNDLE = Path(__file__).resolve().parents[1] / "web" / "smoke_bundle"


def test_gpu_options_toml_types_and_names():
    text = gpu_options_toml({"serialization_dir": "/tmp/x", "serialize_program_cache": True, "num_threads_to_upload": 2, "precision": "fp32"})
    assert text.splitlines() == ['serialization_dir = "/tmp/x"', "serialize_program_cache = true", "num_threads_to_upload = 2", "precision = 2"]
    for bad in ({"serialise_program_cache": True}, {"serialize_program_cache": 1}, {"num_threads_to_upload": True},
                {"serialization_dir": 'a"b'}):
        with pytest.raises(PocketdiffError, match=next(iter(bad))):
            gpu_options_toml(bad)


@pytest.fixture(scope="module")
def env():
    from pocketdiff.runtime.delegate import delegate_available, prepare_in_process
    from pocketdiff.runtime.litert_c import Environment

    ok, why = delegate_available()
    if not ok:
        pytest.fail(f"no Vulkan driver for the LiteRT GPU delegate: {why}")
    prepare_in_process()
    e = Environment()
    yield e
    e.close()


def _golden(name: str) -> tuple[list, np.ndarray]:
    from pocketdiff.runtime.bundle import load_manifest

    entry = load_manifest(BUNDLE)["components"][name]
    g = np.load(entry["golden"]["_path"])
    return [g[f"input_{i['name']}"] for i in entry["inputs"]], g["output_0"]


def test_compiled_model_matches_golden_and_caches_programs(env, tmp_path):
    from pocketdiff.runtime.litert_c import CompiledModel
    from pocketdiff.runtime.parity import metrics

    feeds, ref = _golden("unet")
    phases = []
    opts = {"serialization_dir": str(tmp_path), "model_cache_key": "unet-test", "serialize_program_cache": True}
    m = CompiledModel(BUNDLE / "unet.tflite", env, opts, on_phase=phases.append)
    try:
        assert phases == ["opened", "compiled"] and m.fully_accelerated()
        assert [t.name for t in m.inputs] == ["sample", "timestep", "encoder_hidden_states"]
        out = m.run(feeds)[0]
        assert metrics(ref, out)["cosine"] > 0.999
        with pytest.raises(PocketdiffError, match="shape"):
            m.run([feeds[0][:1], feeds[1], feeds[2]])
    finally:
        m.close()
    cached = sorted(p.name for p in tmp_path.iterdir())
    assert cached == ["unet-test_mldrift_program_cache.bin"]
    again = CompiledModel(BUNDLE / "unet.tflite", env, opts)  # reads the cache back: same output
    try:
        assert np.allclose(again.run(feeds)[0], out, atol=1e-3)
    finally:
        again.close()


def test_missing_file_is_a_named_error(env, tmp_path):
    from pocketdiff.runtime.litert_c import CompiledModel

    with pytest.raises(PocketdiffError, match="nothing.tflite"):
        CompiledModel(tmp_path / "nothing.tflite", env, {})
