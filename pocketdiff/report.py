"""Human pages for every stage: image grids, plots and a small HTML file beside report.json."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from PIL import Image, ImageDraw

from .sampling import to_pil as tensor_to_pil


def to_pil(images: torch.Tensor | Sequence[Image.Image]) -> list[Image.Image]:
    """[N,3,H,W] floats in [0,1] (or PIL images) -> list of PIL RGB images."""
    if isinstance(images, torch.Tensor):
        return tensor_to_pil(images.detach().float().clamp(0, 1))
    return [im.convert("RGB") for im in images]


def image_grid(images, ncols: int, labels: Optional[Sequence[str]] = None, cell: Optional[int] = None) -> Image.Image:
    """A grid of images, optionally with a caption strip under each (wrapped, small font)."""
    pil = to_pil(images)
    if not pil:
        raise ValueError("image_grid needs at least one image")
    size = cell or max(pil[0].width, 64)
    label_h = 24 if labels else 0
    nrows = (len(pil) + ncols - 1) // ncols
    grid = Image.new("RGB", (ncols * size, nrows * (size + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i, im in enumerate(pil):
        r, c = divmod(i, ncols)
        grid.paste(im.resize((size, size), Image.NEAREST if im.width < size else Image.BICUBIC), (c * size, r * (size + label_h)))
        if labels:
            text = labels[i][: max(8, size // 6)]
            draw.text((c * size + 2, r * (size + label_h) + size + 4), text, fill="black")
    return grid


def save_grid(images, path: Path, ncols: int = 4, labels: Optional[Sequence[str]] = None, cell: Optional[int] = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, ncols, labels, cell).save(path)
    return path


def plot_curves(curves: dict[str, Iterable[tuple[float, float]]], path: Path, xlabel: str, ylabel: str, title: str = "", logy: bool = False) -> Path:
    """Line plot of named (x, y) series, saved as PNG (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, pts in curves.items():
        pts = list(pts)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, marker="o" if len(pts) < 20 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    if len(curves) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_page(path: Path, title: str, sections: list[tuple[str, str]], report: Optional[dict] = None) -> Path:
    """An HTML page: `sections` are (heading, html body) pairs; images are relative paths."""
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}img{max-width:100%;image-rendering:pixelated}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style>",
             f"<h1>{html.escape(title)}</h1>"]
    for heading, body in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>\n{body}")
    if report is not None:
        parts.append("<h2>report.json</h2><pre>" + html.escape(json.dumps(report, indent=2, default=str)[:20000]) + "</pre>")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def img(src: str, alt: str = "") -> str:
    return f"<img src='{html.escape(src)}' alt='{html.escape(alt)}'>"


def table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
