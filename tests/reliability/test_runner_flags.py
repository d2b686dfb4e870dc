"""The bundle runners' flags as a mistyped command brings them (issue 62): each is one `error:` line naming the
flag or key, exit 2, no traceback, no output folder made and not a byte written into the input bundle. Text that
is not UTF-8 comes in as a shell passes it (bytes in argv, which Python keeps as surrogate escapes); one case runs
`python -m pocketdiff` as a real subprocess with those bytes."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pocketdiff.cli import main

ROOT = Path(__file__).resolve().parents[2]
NOT_UTF8 = b"a red \xff\xfe circle".decode("utf-8", "surrogateescape")  # what argv holds for those bytes


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def bundle(valid_bundle, tmp_path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(valid_bundle, dst)
    return dst


def refused(argv: list[str], capsys, *culprits: str) -> str:
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    for culprit in culprits:
        assert culprit in lines[0], f"{culprit!r} not named in: {lines[0]}"
    return lines[0]


def run_bundle(bundle: Path, out: Path, *extra: str) -> list[str]:
    return ["run-bundle", str(bundle), "--prompt", "a red circle", "--output", str(out), "--accelerator", "cpu", *extra]


def test_a_prompt_of_invalid_utf8_is_one_line_and_no_folder(bundle, tmp_path, capsys):
    before = snapshot(bundle)
    argv = run_bundle(bundle, tmp_path / "out")
    argv[argv.index("--prompt") + 1] = NOT_UTF8
    assert "ff fe" in refused(argv, capsys, "--prompt", "UTF-8")
    assert not (tmp_path / "out").exists() and snapshot(bundle) == before


def test_web_reference_prompt_of_invalid_utf8(bundle, capsys):
    before = snapshot(bundle)
    refused(["web", str(bundle), "--prompt", NOT_UTF8], capsys, "--prompt", "UTF-8")
    assert not (bundle / "web").exists() and snapshot(bundle) == before


def test_invalid_utf8_bytes_from_a_real_shell(bundle, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", LC_ALL="C.UTF-8")
    r = subprocess.run([sys.executable, "-m", "pocketdiff", "run-bundle", str(bundle), "--prompt", b"\xff\xfe\xfd",
                        "--output", str(tmp_path / "out"), "--accelerator", "cpu"], capture_output=True, cwd=ROOT, env=env, timeout=300)
    err = r.stderr.decode("utf-8", "replace").strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "--prompt" in err[0] and "Traceback" not in r.stderr.decode(errors="replace")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["cache", ".", "tokenizer/cache"])
def test_gpu_cache_inside_the_bundle_is_refused(bundle, tmp_path, capsys, where):
    before = snapshot(bundle)
    refused(run_bundle(bundle, tmp_path / "out", "--gpu-cache", str(bundle / where)), capsys, "--gpu-cache", "inside the input bundle")
    assert snapshot(bundle) == before and not (bundle / "cache").exists() and not (tmp_path / "out").exists()


def test_gpu_cache_through_a_link_into_the_bundle_is_refused(bundle, tmp_path, capsys):
    os.symlink(bundle, tmp_path / "looks_elsewhere")
    refused(run_bundle(bundle, tmp_path / "out", "--gpu-cache", str(tmp_path / "looks_elsewhere" / "cache")), capsys, "--gpu-cache")
    assert not (bundle / "cache").exists()


def test_keep_file_pages_on_the_cpu_is_refused(bundle, tmp_path, capsys):
    refused(run_bundle(bundle, tmp_path / "out", "--keep-file-pages"), capsys, "--keep-file-pages", "--accelerator cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rel", ["report.json", "tokenizer/report.json", "manifest.json"])
def test_verify_bundle_json_inside_the_bundle_is_refused(bundle, capsys, rel):
    before = snapshot(bundle)
    refused(["verify-bundle", str(bundle), "--accelerator", "cpu", "--no-run", "--json", str(bundle / rel)], capsys, "--json", "inside")
    assert snapshot(bundle) == before


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_verify_bundle_timeout_must_be_a_positive_number(bundle, capsys, timeout):
    refused(["verify-bundle", str(bundle), "--accelerator", "cpu", "--timeout", timeout], capsys, f"--timeout {float(timeout)}")


def test_verify_bundle_json_outside_the_bundle_is_written(tmp_path, capsys):
    """The refusal above is about the place: the same flag outside the bundle writes its report (the shipped smoke
    bundle, whose goldens verify-bundle checks)."""
    bundle = tmp_path / "smoke"
    shutil.copytree(ROOT / "tests/web/smoke_bundle", bundle, ignore=shutil.ignore_patterns("web"))
    assert main(["verify-bundle", str(bundle), "--accelerator", "cpu", "--no-run", "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").is_file()


@pytest.mark.parametrize("flags, culprit", [
    (["--screenshot", "shot.png"], "--screenshot"),
    (["--accelerator", "wasm"], "--accelerator"),
    (["--check", "--timeout", "-5"], "--timeout"),
    (["--check", "--timeout", "nan"], "--timeout"),
])
def test_web_flags_that_say_nothing_without_check(bundle, capsys, flags, culprit):
    before = snapshot(bundle)
    refused(["web", str(bundle), *flags], capsys, culprit)
    assert not (bundle / "web").exists() and snapshot(bundle) == before


def test_export_up_parts_beyond_the_up_path_is_refused_at_config_time(tmp_path, capsys, monkeypatch):
    """Before any model is built (or the fp16 scan runs): building one fails this test."""
    import pocketdiff.export.verb as export_verb

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the config was checked")

    monkeypatch.setattr(export_verb, "load_or_build", no_model)
    refused(["export", "--config", str(ROOT / "configs/smoke/export.yaml"), "--output", str(tmp_path / "out"),
             "vae_tiling.enabled=true", "vae_tiling.scheme=one_pass", "vae_tiling.passes=1", "vae_tiling.up_parts=99"],
            capsys, "vae_tiling.up_parts", "99")
    assert not (tmp_path / "out").exists()


def test_up_path_length_is_the_one_export_cuts():
    """The config-time count (from the VAE's config) against the built decoder's up path, for every arch."""
    import torch
    from diffusers import AutoencoderKL

    from pocketdiff.archs import vae_config
    from pocketdiff.export.up_parts_check import up_path_length

    for arch in ("tiny", "small", "sd21"):
        conf = vae_config(arch)
        with torch.device("meta"):
            dec = AutoencoderKL(**conf).decoder
        layers = sum(len(b.resnets) + len(b.upsamplers or []) for b in dec.up_blocks) + 1  # + the output head
        assert up_path_length(conf) == layers, arch


@pytest.mark.parametrize("config, key", [("configs/decoder/openmoji.yaml", "vae:"), ("configs/smoke/prune.yaml", None)])
def test_train_teacher_given_another_verb_s_config_names_the_key(tmp_path, capsys, config, key):
    line = refused(["train-teacher", "--config", str(ROOT / config), "--output", str(tmp_path / "out")], capsys, config)
    assert key is None or key in line
    assert not (tmp_path / "out").exists()
