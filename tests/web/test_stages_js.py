"""web/static/stages.js, the page's twin of runtime/pipeline_spec.py and runtime/guidance.py, under node: the registry
tables it mirrors, derivePipeline against derive_pipeline on every committed smoke bundle and on manifests with a
pipeline block (schema_version 3), the checks that refuse a bad block with one line naming the stage, component and
input before any model loads (also through the Node runner), and Guidance against numpy."""
from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from node_runner_cli import dawn_or_skip, edited_manifest, run_node_runner  # tests/node_runner_cli.py

from pocketdiff.runtime import components as reg
from pocketdiff.runtime.guidance import Guidance
from pocketdiff.runtime.manifest_check import manifest_problems
from pocketdiff.runtime.pipeline_spec import INPAINT_UNET_ROLES, OUTPUT_ROLES, ROLES, STAGE_KINDS, derive_pipeline, pipeline_of

HERE = Path(__file__).resolve().parent
HARNESS = HERE / "stages_harness.mjs"
SMOKE = sorted(p.parent for p in HERE.glob("smoke_bundle*/manifest.json"))


def _run(node: str, tmp_path: Path, request: dict) -> dict:
    req = tmp_path / "request.json"
    req.write_text(json.dumps(request))
    res = subprocess.run([node, str(HARNESS), str(req)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _v3(man: dict) -> dict:
    """`man` as export now writes it: its pipeline block (derived from the registry) and schema_version 3."""
    return {**copy.deepcopy(man), "schema_version": 3, "pipeline": derive_pipeline(man)}


def _unet_input(man: dict, name: str) -> dict:
    return next(i for i in man["components"]["unet"]["inputs"] if i["name"] == name)


def _without_table(man: dict) -> dict:
    """A bundle whose UNet computes its time embedding in the graph: `timestep` [B], no table."""
    out = copy.deepcopy(man)
    out.pop("time_embedding")
    _unet_input(out, "timestep")["shape"] = [out["guidance"]["unet_batch"]]
    return out


def _with_time_ids(man: dict, k: int = 6) -> dict:
    """A v3 manifest whose UNet also takes time ids [B, k] (as SDXL's does), fed from pipeline.conditioning."""
    out = _v3(man)
    out["components"]["unet"]["inputs"].append({"name": "time_ids", "shape": [out["guidance"]["unet_batch"], k], "dtype": "float32"})
    out["pipeline"]["conditioning"] = {"time_ids": [64.0, 64.0, 0.0, 0.0, 64.0, 64.0]}
    out["pipeline"]["stages"][1]["inputs"]["time_ids"] = "time_ids"
    return out


def test_the_registry_tables_are_the_pythons(node, tmp_path):
    out = _run(node, tmp_path, {})
    assert set(out["registry"]) == set(reg.REGISTRY)
    for name, c in reg.REGISTRY.items():
        js = out["registry"][name]
        assert (js["role"], js["inputs"], js.get("optionalInputs", [])) == (c.role, list(c.inputs), list(c.optional_inputs)), name
        assert (js.get("roles", {}), js.get("outputRoles", [])) == (dict(c.roles), list(c.output_roles)), name
        assert (js.get("chunks", False), js.get("tiles", []), js.get("partOf")) == (c.chunks, list(c.tiles), c.part_of), name
    assert out["families"] == {f: [list(s) for s in stages] for f, stages in reg.FAMILIES.items()}
    assert out["roles"] == {r: {"source": s.source, "per": s.per, "rank": s.rank} for r, s in ROLES.items()}
    assert out["kinds"] == list(STAGE_KINDS) and out["output_roles"] == {k: list(v) for k, v in OUTPUT_ROLES.items()}
    assert sorted(out["chunkable"]) == sorted(reg.CHUNKABLE) and out["chunkable"][0] == reg.UNET  # the UNet's block checked first
    assert out["tiled_decoder"] == list(reg.TILED_DECODER)
    assert out["inpaint_unet_roles"] == list(INPAINT_UNET_ROLES)  # what makes a UNet an inpainting one


def test_derive_pipeline_is_the_pythons_on_every_smoke_bundle_and_a_v3_manifest(node, tmp_path):
    """Every committed smoke bundle (schema 1 and 2: whole, chunked, tiled, tiled in parts, block-removed), the same
    manifests as v3 (the block export writes), one without a time-embedding table and one with time ids."""
    assert len(SMOKE) >= 7, SMOKE
    mans = [_manifest(f) for f in SMOKE]
    cases = [*mans, *(_v3(m) for m in mans), _without_table(mans[0]), _with_time_ids(mans[0])]
    out = _run(node, tmp_path, {"manifests": cases})["manifests"]
    for man, got in zip(cases, out):
        assert got["derived"] == derive_pipeline(man)
        assert got["pipeline"] == pipeline_of(man)
        assert got["problems"] == [] and got["error"] is None, got["problems"]
        assert manifest_problems("unused", man, files=False) == []  # the Python checks agree: nothing to refuse
    assert out[0]["derived"]["stages"][1]["inputs"]["timestep"] == "timestep_embedding"  # the smoke bundles carry the table
    assert out[-2]["derived"]["stages"][1]["inputs"]["timestep"] == "timestep"
    assert out[-1]["pipeline"]["stages"][1]["inputs"]["time_ids"] == "time_ids"
    by_name = dict(zip([f.name for f in SMOKE], out))
    assert by_name["smoke_bundle_chunked"]["parts"] == [["text_encoder.0", "text_encoder.1"], ["unet.0", "unet.1"], ["vae_decoder"]]
    assert by_name["smoke_bundle_tiled_parts"]["parts"][2] == ["vae_decoder_head", "vae_up_tile.0", "vae_up_tile.1"]


def _bad_cases(man: dict) -> list[tuple[str, dict, tuple[str, ...]]]:
    """(what, manifest, words its one line must hold: the stage, the component, the input)."""
    B = man["guidance"]["unet_batch"]
    kind = _v3(man)
    kind["pipeline"]["stages"][1]["kind"] = "sideways"
    role = _v3(man)
    role["pipeline"]["stages"][1]["inputs"]["sample"] = "colour"
    lacking = copy.deepcopy(man)
    del lacking["components"]["vae_decoder"]
    shape = copy.deepcopy(man)
    _unet_input(shape, "sample")["shape"] = [B, man["latent"]["channels"], man["latent"]["height"] + 1, man["latent"]["width"]]
    time_ids = _with_time_ids(man, k=5)
    unmade = _with_time_ids(man)
    unmade["pipeline"]["conditioning"] = {}
    return [
        ("unknown kind", kind, ("stage denoise", "component unet", '"sideways" is no stage a runner knows')),
        ("unknown role", role, ("stage denoise", "component unet", "input sample", '"colour"')),
        ("component lacking", lacking, ("stage decode", "component vae_decoder", "bundle: has no vae_decoder")),
        ("shape", shape, ("stage denoise", "component unet", "input sample", f"[{B},4,{man['latent']['height'] + 1},")),
        ("time ids shape", time_ids, ("stage denoise", "component unet", "input time_ids", "pipeline.conditioning.time_ids")),
        ("role made by nothing", unmade, ("stage denoise", "component unet", "input time_ids", "no earlier stage or bundle field makes time_ids")),
    ]


def test_a_bad_pipeline_is_one_line_naming_stage_component_and_input(node, tmp_path):
    man = _manifest(HERE / "smoke_bundle")
    cases = _bad_cases(man)
    out = _run(node, tmp_path, {"manifests": [m for _, m, _ in cases]})["manifests"]
    for (what, bad, words), got in zip(cases, out):
        err = got["error"]
        assert err and err["type"] == "BundleError", (what, got)
        assert "\n" not in err["message"] and all(w in err["message"] for w in words), (what, err["message"])
        assert manifest_problems("unused", bad, files=False), what  # verify-bundle refuses it too


def test_versions_and_roles_no_runner_feeds_are_refused(node, tmp_path):
    man = _manifest(HERE / "smoke_bundle")
    no_block = {**copy.deepcopy(man), "schema_version": 3}
    old_with_block = {**_v3(man), "schema_version": 1}
    student = _v3(man)  # a w-conditioned student's timestep_cond: no runner feeds it (its guidance is inside the table)
    student["components"]["unet"]["inputs"].append({"name": "timestep_cond", "shape": [1, 8], "dtype": "float32"})
    student["pipeline"]["stages"][1]["inputs"]["timestep_cond"] = "guidance_embedding"
    out = _run(node, tmp_path, {"manifests": [no_block, old_with_block, student]})["manifests"]
    msgs = [o["error"]["message"] for o in out]
    assert msgs[0] == "manifest.json: schema version 3 declares its pipeline, but the manifest has no pipeline block"
    assert msgs[1] == "manifest.json: schema version 1 cannot hold a pipeline block (version 3 does)"
    assert "stage denoise, component unet, input timestep_cond: no runner feeds role guidance_embedding" in msgs[2]


@pytest.mark.parametrize("mode,batch,scale,zero", [("cfg", 2, 7.5, False), ("embedded", 1, 4.0, False), ("none", 1, 1.0, False),
                                                ("cfg", 2, 7.5, True), ("embedded", 1, 4.0, True)])
def test_guidance_is_the_pythons(node, tmp_path, mode, batch, scale, zero):
    """zero: pipeline.conditioning.zero_unconditional (the empty prompt is not encoded; its rows are zeros)."""
    rng = np.random.default_rng(batch)
    block = {"mode": mode, "scale": scale, "unet_batch": batch}
    cond, uncond = (rng.standard_normal((1, 3, 4)).astype(np.float32) for _ in range(2))
    rows = [cond, uncond][:1 if zero else batch]
    sample = rng.standard_normal((1, 2, 3, 3)).astype(np.float32)
    unet_out = rng.standard_normal((batch, 2, 3, 3)).astype(np.float32)
    t = lambda a: {"data": a.ravel().tolist(), "shape": list(a.shape)}  # noqa: E731
    case = {"block": block, "scale": scale, "prompt": "a cat", "rows": [t(r) for r in rows], "sample": t(sample), "out": unet_out.ravel().tolist(),
            "zero": zero}
    pairs = [(rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 3, 5)).astype(np.float32))]
    out = _run(node, tmp_path, {"guidance": [case], "concat": [[t(a), t(b)] for a, b in pairs]})
    got, g = out["guidance"][0], Guidance(block, zero_unconditional=zero)
    assert got["prompts"] == g.prompts("a cat") and got["unconditional"] == g.unconditional
    assert g.prompts("a cat") == (["a cat", ""] if batch == 2 and not zero else ["a cat"])
    if zero and batch == 2:  # [zeros, cond]
        np.testing.assert_array_equal(g.stack(rows), np.concatenate([np.zeros_like(cond), cond]))
    for key, want in (("stack", g.stack(rows)), ("repeat", g.repeat(sample))):
        assert got[key]["shape"] == list(want.shape), key
        np.testing.assert_array_equal(np.asarray(got[key]["data"], np.float32), want.ravel())  # copies: exact
    # numpy combines in float32, the page in float64 rounded once to float32: one float32 ulp apart at most
    np.testing.assert_allclose(np.asarray(got["combine"], np.float32), g.combine(unet_out).ravel(), rtol=2e-6, atol=1e-6)
    joined = np.concatenate(pairs[0], axis=-1)
    assert out["concat"][0]["shape"] == list(joined.shape)
    np.testing.assert_array_equal(np.asarray(out["concat"][0]["data"], np.float32), joined.ravel())


# ------------------------------------------------------------------------------------------- the Node runner


@pytest.fixture(scope="module")
def dawn(node) -> str:
    return dawn_or_skip(node)


def test_the_node_runner_refuses_a_bad_stage_before_any_model_loads(dawn, smoke_bundle):
    def edit(man):
        man.update(_v3(man))
        man["pipeline"]["stages"][1]["inputs"]["sample"] = "colour"

    with edited_manifest(smoke_bundle, edit):
        p = run_node_runner(dawn, str(smoke_bundle), "--no-goldens", timeout=300, skip_without_adapter=True)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert line.startswith("node_runner: manifest.json: pipeline.stages[1] (denoise).inputs.sample: stage denoise, component unet, input sample"), line
    assert "compiled in" not in p.stderr  # no model was compiled (the runner says each one it compiles)


def test_the_page_refuses_a_stage_naming_a_component_the_bundle_lacks(smoke_bundle, check_with_manifest):
    """The page's check mode (headless Chromium) on a v3 manifest whose decode stage names the tiled decoder's parts,
    which the bundle lacks: one line naming the stage and component, before any model loads."""
    from pocketdiff.web.page import PageConfig, write_page

    write_page(PageConfig(bundle=str(smoke_bundle), reference=False))

    def edit(man):
        man.update(_v3(man))
        man["vae_tiling"] = {"scheme": "one_pass", "tile": 4, "overlap": 2, "margin": 1, "factor": 8, "passes": 1}

    r = check_with_manifest(smoke_bundle, edit)
    assert r["ok"] is False and "\n" not in r["error"], r
    assert r["error"].startswith("bundle: has no vae_decoder_head, vae_up_tile (exported with components=text_encoder,unet,vae_decoder)"), r["error"]
    assert "pipeline.stages[2] (decode): stage decode, component vae_decoder runs" in r["error"], r["error"]
    assert "components" not in r  # refused before any model was compiled


def test_a_v3_smoke_bundle_through_the_node_runner_matches_run_bundle(dawn, smoke_bundle, tmp_path):
    """The smoke bundle with its pipeline block (schema_version 3, as export now writes it): run-bundle's reference and
    the Node runner's image from the same latents, the stages' models in the block's order."""
    from pocketdiff.web.page import PageConfig, write_page

    path = smoke_bundle / "manifest.json"
    path.write_text(json.dumps(_v3(json.loads(path.read_text()))))
    write_page(PageConfig(bundle=str(smoke_bundle)))
    out = tmp_path / "report.json"
    p = run_node_runner(dawn, str(smoke_bundle), "--out", str(out), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [], report["failures"]
    assert list(report["components"]) == ["text_encoder", "unet", "vae_decoder"]
    assert report["image"]["psnr_db"] >= 40  # the same latents as run-bundle's reference, as the v1 bundle's test holds


def _inpainting(man: dict) -> dict:
    """A v3 manifest whose UNet inpaints (9 channels: mask [B, 1, h, w] and masked-picture latents [B, C, h, w] as inputs
    of their own) beside an image encoder: derive_pipeline's block for tasks [inpaint] (two encode_image stages)."""
    out = copy.deepcopy(man)
    B, lat, im = out["guidance"]["unet_batch"], out["latent"], out["image"]
    out["components"]["unet"]["inputs"] += [
        {"name": "mask", "shape": [B, 1, lat["height"], lat["width"]], "dtype": "float32"},
        {"name": "masked_image_latents", "shape": [B, lat["channels"], lat["height"], lat["width"]], "dtype": "float32"}]
    enc = copy.deepcopy(out["components"]["vae_decoder"])
    enc.update(path="vae_encoder.tflite", inputs=[{"name": "pixels", "shape": [1, 3, im["height"], im["width"]], "dtype": "float32"}],
               outputs=[{"name": "output_0", "shape": [1, lat["channels"], lat["height"], lat["width"]], "dtype": "float32"}])
    out["components"]["vae_encoder"] = enc
    return {**out, "schema_version": 3, "pipeline": derive_pipeline(out, tasks=("inpaint",))}


def test_an_inpainting_unet_is_checked_as_in_python(node, tmp_path):
    """The block of a 9-channel UNet passes both checks (the twin's rules for mask, masked_image, masked_image_latents);
    served with another task, or its mask fed the wrong shape, it is a problem in both."""
    good = _inpainting(_manifest(HERE / "smoke_bundle"))
    kinds = [s["kind"] for s in good["pipeline"]["stages"]]
    assert kinds == ["encode_prompt", "encode_image", "encode_image", "denoise", "decode"]
    assert good["pipeline"]["stages"][2]["inputs"] == {"pixels": "masked_image"}
    two_tasks = copy.deepcopy(good)
    two_tasks["pipeline"]["tasks"] = ["text_to_image", "inpaint"]
    bad_mask = copy.deepcopy(good)
    _unet_input(bad_mask, "mask")["shape"][1] = 4
    out = _run(node, tmp_path, {"manifests": [good, two_tasks, bad_mask]})["manifests"]
    assert out[0]["problems"] == [] and not manifest_problems("unused", good, files=False)
    assert out[0]["error"] is None
    assert "serves inpaint only" in out[1]["problems"][0] and manifest_problems("unused", two_tasks, files=False)
    assert "components.unet.inputs.mask" in " ".join(out[2]["problems"]) or "input mask" in " ".join(out[2]["problems"])
    assert manifest_problems("unused", bad_mask, files=False)
