"""A LoRA swapped into a chunked UNet in the Node runner (`--lora FILE --lora-scale S`), against run-bundle's image with the
same LoRA (the page's reference, made by PageConfig lora / lora_scale). The bundle: the web chunked smoke bundle (tests/web/conftest.py assemble_chunked) with its
two UNet chunks replaced by ones exported here with LoRA slots (`components: [unet]`, the smoke recipe's int8 RTN UNet,
`unet_chunks: 2`, `lora_slots: {rank: 4, targets: [attn]}`): each chunk takes its own slots' factors, which the runners
feed by name from their table of tensors (runtime/BUNDLE.md). As tests/web/test_check_lora.py for a whole UNet."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from node_runner_cli import dawn_or_skip, run_node_runner  # tests/node_runner_cli.py
from test_check_lora import SCALE, lora_file  # tests/web/ is on sys.path


@pytest.fixture(scope="module")
def chunked_export(tmp_path_factory) -> Path:
    """The smoke recipe's UNet alone in 2 chunks, with slots (the delegate check left to the runners: the Node runner
    requires every component fully accelerated on Dawn; tests/export/test_lora_slots_chunks.py covers the export's own)."""
    from pocketdiff.cli import main as cli_main

    root = tmp_path_factory.mktemp("lora_chunks_web")
    cfg = {"seed": 0, "model": {"pretrained": "pocketdiff:shapes-teacher"}, "components": ["unet"], "weights": "int8",
           "int8": {"rtn": True}, "guidance": "cfg", "guidance_scale": 3.0, "steps": 4, "unet_chunks": 2,
           "golden_prompt": "a large red circle at the center", "lora_slots": {"rank": 4, "targets": ["attn"]},
           "verify": {"delegate": False}, "fp16_scan": {"enabled": False}}
    (root / "export.yaml").write_text(yaml.safe_dump(cfg))
    assert cli_main(["export", "--config", str(root / "export.yaml"), "--output", str(root / "unet")]) == 0
    return root / "unet"


def graft_chunks(bundle: Path, export: Path) -> None:
    """The slotted chunks (same teacher, recipe and time embedding) in place of `bundle`'s, its slots and roles declared."""
    from pocketdiff.runtime.pipeline_spec import PIPELINE_SCHEMA_VERSION, derive_pipeline

    man = json.loads((bundle / "manifest.json").read_text())
    exp = json.loads((export / "manifest.json").read_text())
    assert exp["time_embedding"]["sha256"] == man["time_embedding"]["sha256"]  # the same table: the graft is consistent
    assert exp["unet_chunks"]["components"] == man["unet_chunks"]["components"]
    for name in exp["unet_chunks"]["components"]:
        entry = man["components"][name] = exp["components"][name]
        for rel in (entry["path"], entry["golden"]["path"]):
            shutil.copy(export / rel, bundle / rel)
    shutil.copy(export / exp["unet_chunks"]["golden"]["path"], bundle / exp["unet_chunks"]["golden"]["path"])
    man["unet_chunks"], man["lora_slots"] = exp["unet_chunks"], exp["lora_slots"]
    man["schema_version"], man["pipeline"] = PIPELINE_SCHEMA_VERSION, derive_pipeline(man)
    (bundle / "manifest.json").write_text(json.dumps(man, indent=1))


@pytest.fixture(scope="module")
def slotted(tmp_path_factory, chunked_export, assemble_chunked) -> dict:
    from pocketdiff.web.page import PageConfig, write_page

    root = tmp_path_factory.mktemp("lora_chunks_bundle")
    bundle = assemble_chunked(root / "bundle")  # the chunked smoke bundle's files (those it shares: smoke_bundle's)
    graft_chunks(bundle, chunked_export)
    man = json.loads((bundle / "manifest.json").read_text())
    unet = {"components": {"unet": {"inputs": [i for c in man["unet_chunks"]["components"] for i in man["components"][c]["inputs"]]}},
            "lora_slots": man["lora_slots"]}  # lora_file reads the slots' shapes from a whole UNet's inputs
    lora = lora_file(root / "style.safetensors", unet)
    write_page(PageConfig(bundle=str(bundle), lora=str(lora), lora_scale=SCALE))
    return {"bundle": bundle, "lora": lora, "man": man}


def test_each_grafted_chunk_declares_its_own_slots(slotted):
    man = slotted["man"]
    per_chunk = [{i["name"] for i in man["components"][c]["inputs"] if i["name"].startswith("lora_")} for c in man["unet_chunks"]["components"]]
    wanted = {n for pair in man["lora_slots"]["inputs"].values() for n in pair}
    assert all(per_chunk) and not per_chunk[0] & per_chunk[1] and per_chunk[0] | per_chunk[1] == wanted


def test_node_runner_feeds_the_lora_to_the_chunks_as_run_bundle_does(slotted, node, tmp_path):
    """>= 40 dB against run-bundle's CPU image with the same LoRA and scale, every golden passing (each chunk's golden
    carries seeded factors) and every chunk fully accelerated on Dawn."""
    node = dawn_or_skip(node)
    p = run_node_runner(node, str(slotted["bundle"]), "--lora", str(slotted["lora"]), "--lora-scale", str(SCALE),
                        "--min-image-psnr", "40", "--out", str(tmp_path / "report.json"), skip_without_adapter=True)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["ok"] is True and r["image"]["psnr_db"] >= 40, r["image"]
    assert r["lora"] == {"file": str(slotted["lora"]), "scale": SCALE}
    for name in slotted["man"]["unet_chunks"]["components"]:
        c = r["components"][name]
        assert c["fully_accelerated"] and c["golden"]["pass"], (name, c)
