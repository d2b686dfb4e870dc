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


_LINE_H = 12  # PIL's default bitmap font: 11 px high


def _wrap(draw: ImageDraw.ImageDraw, text: str, width: int, max_lines: int = 4) -> list[str]:
    """Words of `text` in lines no wider than `width` pixels (long words cut; at most `max_lines`)."""
    lines: list[str] = []
    for word in str(text).split():
        while draw.textlength(word) > width and len(word) > 1:  # a word wider than the cell
            cut = max(1, int(len(word) * width / draw.textlength(word)))
            lines.append(word[:cut])
            word = word[cut:]
        if lines and draw.textlength(f"{lines[-1]} {word}") <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        lines = lines[:max_lines]
        lines[-1] = lines[-1][: max(1, len(lines[-1]) - 1)] + "~"
    return lines


def image_grid(images, ncols: int, labels: Optional[Sequence[str]] = None, cell: Optional[int] = None,
               row_labels: Optional[Sequence[str]] = None, col_labels: Optional[Sequence[str]] = None) -> Image.Image:
    """A grid of images. `labels`: a caption under each image; `row_labels` (e.g. the prompts):
    a column of text left of each row; `col_labels` (e.g. the models): a header over each column.
    Text is wrapped, never cut short, so a grid carries its prompts in full."""
    pil = to_pil(images)
    if not pil:
        raise ValueError("image_grid needs at least one image")
    size = cell or max(pil[0].width, 64)
    nrows = (len(pil) + ncols - 1) // ncols
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    cap = [_wrap(probe, t, size - 4) for t in labels] if labels else []
    label_h = (max(len(c) for c in cap) * _LINE_H + 6) if cap else 0
    left = 150 if row_labels else 0
    rows_txt = [_wrap(probe, t, left - 8, max_lines=max(1, (size + label_h) // _LINE_H)) for t in row_labels] if row_labels else []
    cols_txt = [_wrap(probe, t, size - 4, max_lines=3) for t in col_labels] if col_labels else []
    top = (max(len(c) for c in cols_txt) * _LINE_H + 6) if cols_txt else 0
    grid = Image.new("RGB", (left + ncols * size, top + nrows * (size + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for c, lines in enumerate(cols_txt):
        for k, line in enumerate(lines):
            draw.text((left + c * size + 2, 3 + k * _LINE_H), line, fill="black")
    for r, lines in enumerate(rows_txt[:nrows]):
        y0 = top + r * (size + label_h) + max(0, (size - len(lines) * _LINE_H) // 2)
        for k, line in enumerate(lines):
            draw.text((4, y0 + k * _LINE_H), line, fill="black")
    for i, im in enumerate(pil):
        r, c = divmod(i, ncols)
        x, y = left + c * size, top + r * (size + label_h)
        grid.paste(im.resize((size, size), Image.NEAREST if im.width < size else Image.BICUBIC), (x, y))
        for k, line in enumerate(cap[i] if cap else []):
            draw.text((x + 2, y + size + 3 + k * _LINE_H), line, fill="black")
    return grid


def save_grid(images, path: Path, ncols: int = 4, labels: Optional[Sequence[str]] = None, cell: Optional[int] = None,
              row_labels: Optional[Sequence[str]] = None, col_labels: Optional[Sequence[str]] = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, ncols, labels, cell, row_labels=row_labels, col_labels=col_labels).save(path)
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
