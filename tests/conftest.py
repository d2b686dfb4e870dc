"""Fixtures shared by every test folder."""
from __future__ import annotations

import contextlib

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def driver_shader_cache():
    """Mesa's own shader cache (lavapipe's compiled shaders) stays where the driver keeps it outside the tests,
    `$XDG_CACHE_HOME` (or ~/.cache) as the session starts, however a test points XDG_CACHE_HOME elsewhere
    (tests do, to isolate pocketdiff's GPU program cache, `runtime/gpu_cache.py`, which they check): without this,
    every run-bundle in such a test compiled every shader through LLVM again (a tiny bundle's run 20 s -> 70 s).
    pocketdiff's program cache is untouched: it still follows each test's XDG_CACHE_HOME. A MESA_SHADER_CACHE_DIR
    already set is kept (benchmarks/bundle_footprint.py sets its own for cold launches)."""
    import os
    from pathlib import Path

    if "MESA_SHADER_CACHE_DIR" in os.environ:
        yield os.environ["MESA_SHADER_CACHE_DIR"]
        return
    os.environ["MESA_SHADER_CACHE_DIR"] = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    yield os.environ["MESA_SHADER_CACHE_DIR"]
    del os.environ["MESA_SHADER_CACHE_DIR"]


@pytest.fixture(scope="session", autouse=True)
def torch_one_thread_session():
    """torch on one CPU thread in the test process, from the first fixture on (session and module fixtures build and
    export models too), restored after. Tiny models run fastest single-threaded, and on a shared 2-core box torch's
    two-thread CPU kernels under load are 10-100x slower (tests/compress under load: 7:54 two-threaded, 2:46 on one
    thread). Processes a test starts are left to their own settings."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def torch_one_thread():
    """Each test starts on one thread again, whatever a test before it set (a verb's `cpu_threads`, say)."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """torch on one CPU thread for a whole module (its module-scoped models included), restored
    after (the session runs on one thread already: `torch_one_thread_session`; modules that must stay on one
    thread say so with it). Use: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def gpu_delegate():
    """The Vulkan driver the LiteRT GPU delegate will use (the delegate runs for real: Mesa
    lavapipe unpacked by scripts/setup_vulkan.sh on machines without a GPU driver); sets up
    lavapipe when missing."""
    import subprocess
    from pathlib import Path

    from pocketdiff.runtime.delegate import delegate_available

    ok, why = delegate_available()
    if not ok:
        root = Path(__file__).resolve().parents[1]
        subprocess.run(["bash", str(root / "scripts" / "setup_vulkan.sh")], check=False, capture_output=True, timeout=900)
        ok, why = delegate_available()
    if not ok:
        pytest.fail(f"no Vulkan driver for the LiteRT GPU delegate: {why}")
    return why


class SharedConversions:
    """`with shared_conversions.of("text_encoder", ...):` a litert-torch conversion `pocketdiff export` makes of one of
    these components (export/exporter.py's `_convert`, the export verb's one converter call; the component named by its
    raw file, `<component>_fp32.tflite`) whose graph was converted before in this session is that conversion's file,
    copied; otherwise litert-torch converts it and the file is kept for the next. Keyed on what the converter is given:
    the program torch.export makes of the module with the inputs' names, shapes and dtypes (its code, signature and
    every parameter, buffer and constant, bytes and all). Each different graph is still converted for real once a
    session, and all the export does after the conversion runs every time (weight storage, int8 codes, the delegate and
    its parity, goldens, manifest). The bundles made from the tiny teacher share its text encoder, decoder and UNet."""

    def __init__(self, folder):
        self.folder = folder
        self.hits: list[str] = []
        self.converted: list[str] = []

    def key(self, module, inputs: dict) -> str:
        import hashlib

        from pocketdiff.export.convert import converter_quiet
        from pocketdiff.export.exporter import _Keyworded

        with converter_quiet():
            ep = torch.export.export(_Keyworded(module, list(inputs)).eval(), (), dict(inputs), strict=False)
        h = hashlib.sha256(ep.graph_module.code.encode())
        h.update(repr((ep.graph_signature, ep.call_spec)).encode())
        h.update(repr([(k, v.dtype, tuple(v.shape)) for k, v in inputs.items()]).encode())
        for kind, named in (("state", ep.state_dict), ("constant", ep.constants)):
            for name in sorted(named):
                t = named[name]
                if isinstance(t, torch.Tensor):
                    h.update(f"{kind} {name} {t.dtype} {tuple(t.shape)}".encode())
                    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    h.update(f"{kind} {name} {t!r}".encode())
        return h.hexdigest()

    @contextlib.contextmanager
    def of(self, *components: str):
        import shutil
        import time

        from pocketdiff.export import exporter

        convert, raw_files = exporter._convert, {f"{c}_fp32.tflite" for c in components}

        def shared(module, inputs, path):
            if path.name not in raw_files:
                return convert(module, inputs, path)
            t0 = time.perf_counter()
            kept = self.folder / f"{self.key(module, inputs)}.tflite"
            if kept.is_file():
                shutil.copyfile(kept, path)
                self.hits.append(path.name)
            else:
                convert(module, inputs, path)
                shutil.copyfile(path, kept)
                self.converted.append(path.name)
            return time.perf_counter() - t0

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(exporter, "_convert", shared)
            yield self


@pytest.fixture(scope="session")
def shared_conversions(tmp_path_factory):
    """One `SharedConversions` for the session (its files in a session folder)."""
    return SharedConversions(tmp_path_factory.mktemp("conversions"))


@pytest.fixture(scope="session")
def lcm_student(tmp_path_factory):
    """A consistency (LCM) student folder, as `pocketdiff distill` with `method: consistency` lays it out:
    the shipped shapes teacher's weights in a w-conditioned UNet (time_cond_proj, 16 wide, small random
    weights) under an LCMScheduler on a 10-point grid (timestep_scaling 10). Its predictions are the
    teacher's, so its images are real ones (tests/export/test_lcm_export.py, tests/web/test_check_lcm.py)."""
    from diffusers import LCMScheduler, UNet2DConditionModel

    from pocketdiff.models import ModelConfig, load_or_build, save_pipeline

    pipe = load_or_build(ModelConfig(pretrained="pocketdiff:shapes-teacher"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = UNet2DConditionModel(**{**dict(pipe.unet.config), "time_cond_proj_dim": 16})
    missing, unexpected = unet.load_state_dict(pipe.unet.state_dict(), strict=False)
    assert not unexpected and missing and all("cond_proj" in k for k in missing)
    with torch.no_grad():
        unet.time_embedding.cond_proj.weight.mul_(0.1)
    pipe.unet = unet
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config, original_inference_steps=10, timestep_scaling=10.0)
    return save_pipeline(pipe, tmp_path_factory.mktemp("lcm_student") / "student")


@pytest.fixture(scope="session")
def export_lcm(shared_conversions):
    """`export_lcm(student, root, steps, guidance_scale)` -> root/bundle: `pocketdiff export` with fp32 weights,
    embedded guidance, no delegate run and no fp16 scan (the components are the usual ones; the sampler is tested;
    the student's text encoder and decoder are the teacher's: their conversions are shared)."""
    import yaml

    from pocketdiff.cli import main as cli_main

    def export(student, root, steps: int, guidance_scale: float):
        cfg = {"seed": 0, "model": {"pretrained": str(student)}, "weights": "fp32", "guidance": "auto",
               "guidance_scale": guidance_scale, "steps": steps, "verify": {"delegate": False}, "fp16_scan": {"enabled": False}}
        (root / "export.yaml").write_text(yaml.safe_dump(cfg))
        with shared_conversions.of("text_encoder", "vae_decoder"):
            assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "bundle")]) == 0
        return root / "bundle"

    return export


@pytest.fixture(scope="session")
def lcm_bundle_2_steps(lcm_student, export_lcm, tmp_path_factory):
    """`lcm_student` exported once for the session by `export_lcm` for 2 steps at guidance scale 2.0: read by
    tests/export/test_lcm_export.py, checked in the page (on a copy) by tests/web/test_check_lcm.py. Tests that
    change a bundle change a copy."""
    return export_lcm(lcm_student, tmp_path_factory.mktemp("lcm_export"), steps=2, guidance_scale=2.0)


@pytest.fixture(scope="session")
def sdxl_bundle(gpu_delegate, tmp_path_factory):
    """The tiny SDXL folder (force_zeros_for_empty_prompt true) and its bundle, exported once for the session
    (tests/tiny_sdxl.py `export_tiny_sdxl`): {"folder", "out", "report"}. Tests that change the bundle change a copy."""
    from tiny_sdxl import export_tiny_sdxl

    return export_tiny_sdxl(tmp_path_factory.mktemp("sdxl"))


@pytest.fixture(scope="session")
def sdxl_chunked_bundles(sdxl_bundle, shared_conversions, tmp_path_factory):
    """The tiny SDXL folder's bundles with the UNet in 2 (block cut) and 3 (layer cut) chunks, each exported once for the
    session when first read (tests/tiny_sdxl.py `ChunkedSdxlBundles`): {k: the bundle}; read by
    tests/export/test_sdxl_chunks.py and tests/web/test_node_runner_sdxl_chunks.py. Tests that change a bundle change a copy."""
    from tiny_sdxl import ChunkedSdxlBundles

    return ChunkedSdxlBundles(sdxl_bundle["folder"], tmp_path_factory.mktemp("sdxl_chunks"), shared_conversions)


@pytest.fixture(scope="session")
def smoke_encoder_export(gpu_delegate, tmp_path_factory):
    """The shapes teacher's VAE encoder exported alone, once per worker (tests/img2img_fixtures.py), for the tests that
    graft it onto the web smoke bundle."""
    from img2img_fixtures import export_smoke_encoder

    return export_smoke_encoder(tmp_path_factory.mktemp("smoke_encoder"))


@pytest.fixture(scope="session")
def inpaint_unet_export(gpu_delegate, shared_conversions, tmp_path_factory):
    """A tiny 9-channel inpainting folder and its `tasks: [inpaint]` export, once per worker (tests/img2img_fixtures.py):
    {model, bundle, pictures}."""
    from img2img_fixtures import export_inpaint_bundle

    with shared_conversions.of("text_encoder", "vae_decoder"):  # the shapes teacher's, as other exports convert them
        return export_inpaint_bundle(tmp_path_factory.mktemp("inpaint9"))
