"""The human page of an evaluation: metric tables with sample counts, metric-vs-steps plots,
same prompt + seed grids across models, warnings, and the compare view over earlier runs."""
from __future__ import annotations

import html
from pathlib import Path
from typing import Optional, Sequence

import torch

from pocketdiff.errors import PocketdiffError
from pocketdiff.report import img, save_grid, table, to_pil, write_page
from pocketdiff.outputs import read_json


def _fmt(mean: Optional[float], std: Optional[float] = None, n: int = 1) -> str:
    if mean is None:
        return "-"
    if std is not None and n > 1:
        return f"{mean:.4g} ± {std:.2g}"
    return f"{mean:.4g}"


def plot_metric(results: Sequence[dict], key: str, path: Path, ylabel: str, title: str, group: str = "model") -> Optional[Path]:
    """Metric against steps, one line per `group` value, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in results:
        if r.get(key) is None:
            continue
        series.setdefault(str(r[group]), []).append((int(r["steps"]), float(r[key]), float(r.get(f"{key}_std") or 0.0)))
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for name, pts in series.items():
        pts.sort()
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es if any(es) else None, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sampling steps")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def metric_table(results: Sequence[dict], fd_label: Optional[str], clip_label: Optional[str], run_column: bool = False) -> str:
    header = (["run"] if run_column else []) + ["model", "steps", "guidance", "mode", fd_label or "FD", clip_label or "CLIP score",
                                                  "samples / seed", "seeds", "s / image"]
    rows = []
    for r in results:
        n_seeds = int(r.get("num_seeds") or 1)
        row = ([r.get("run", "")] if run_column else []) + [
            r["model"], r["steps"], r.get("guidance_scale", "-"), r.get("guidance_mode", "-"),
            _fmt(r.get("fd"), r.get("fd_std"), n_seeds), _fmt(r.get("clip_score"), r.get("clip_score_std"), n_seeds),
            r.get("num_samples", "-"), n_seeds,
            f"{r['seconds_per_image']:.3g}" if r.get("seconds_per_image") is not None else "-",
        ]
        rows.append(row)
    return table(header, rows)


def grid_section(out: Path, steps: int, models: list[str], prompts: list[str], seed: int, images: dict[str, torch.Tensor]) -> str:
    """Rows = prompts (image i seeded seed + i), columns = models; a PNG grid plus an HTML table."""
    tag = f"grid-{steps}steps"
    cells = []
    for i in range(len(prompts)):
        for m in models:
            cells.append(images[m][i : i + 1])
    grid_path = out / f"{tag}.png"
    if len(models) == 1:  # one model: a compact grid, each image captioned with its prompt
        save_grid(torch.cat(cells), grid_path, ncols=min(8, len(prompts)), cell=96,
                  labels=[f"{p} (seed {seed + i})" for i, p in enumerate(prompts)], col_labels=[models[0]])
    else:  # rows = prompts (written left of each row), columns = models
        save_grid(torch.cat(cells), grid_path, ncols=len(models), cell=96, col_labels=models,
                  row_labels=[f"{p} (seed {seed + i})" for i, p in enumerate(prompts)])
    folder = out / "images"
    folder.mkdir(parents=True, exist_ok=True)
    head = "".join(f"<th>{html.escape(m)}</th>" for m in models)
    body = []
    for i, p in enumerate(prompts):
        tds = []
        for m in models:
            name = f"{tag}-{_safe(m)}-{i:03d}.png"
            to_pil(images[m][i : i + 1])[0].save(folder / name)
            tds.append(f"<td><img src='images/{html.escape(name)}' alt='{html.escape(p)}' width='96'></td>")
        body.append(f"<tr><th style='text-align:left;max-width:220px'>{html.escape(p)}<br><small>seed {seed + i}</small></th>{''.join(tds)}</tr>")
    return (f"<p>{img(grid_path.name)}</p><table><tr><th>prompt (seed)</th>{head}</tr>{''.join(body)}</table>")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]


def load_run(folder: str | Path) -> dict:
    """report.json of an earlier evaluate run (for compare mode)."""
    p = Path(folder).expanduser()
    f = p / "report.json" if p.is_dir() else p
    if not f.is_file():
        raise PocketdiffError(f"compare: {p} has no report.json (not an evaluate output folder)")
    rep = read_json(f, "compare")
    if not isinstance(rep, dict) or not isinstance(rep.get("results"), list):
        raise PocketdiffError(f"compare: {f} has no 'results' list (not an evaluate report)")
    return rep


def compare_section(out: Path, runs: list[tuple[str, dict]]) -> tuple[str, list[dict]]:
    """Results of several runs in one table and per-features plots; FDs under different
    features or references are kept apart (they are not comparable)."""
    rows: list[dict] = []
    for name, rep in runs:
        ref = (rep.get("metrics") or {}).get("reference") or {}
        for r in rep["results"]:
            rows.append({**r, "run": name, "reference": ref.get("data"), "series": f"{name}: {r['model']}"})
    parts = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r.get("features"), r.get("reference")), []).append(r)
    for gi, ((features, reference), rs) in enumerate(groups.items()):
        parts.append(f"<h3>{html.escape(str(features))} against {html.escape(str(reference))}</h3>")
        clip_label = rs[0].get("clip_model_label")
        parts.append(metric_table(rs, features, clip_label, run_column=True))
        for key, label in (("fd", str(features)), ("clip_score", str(clip_label or "CLIP score"))):
            p = plot_metric(rs, key, out / f"compare-{gi}-{key}.png", label, f"{label} vs steps", group="series")
            if p is not None:
                parts.append(img(p.name))
    return "\n".join(parts), rows


def write_index(out: Path, report: dict, sections: list[tuple[str, str]]) -> Path:
    return write_page(out / "index.html", "pocketdiff evaluate", sections, report)
