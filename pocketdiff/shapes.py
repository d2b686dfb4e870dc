"""The embedded procedural dataset: one coloured shape on white, with a caption.

Every item is a `ShapeSpec` (shape x colour x position x size, plus a little jitter) drawn
with PIL at 4x the target resolution and box-downsampled, so edges are anti-aliased. The
caption names exactly what was drawn: "a large red circle at the top left". Everything is
deterministic in (seed, index): `sample_specs(count, seed)[i]` never depends on anything
else, so the set can be rebuilt bit for bit on any machine with no data at all.

`pocketdiff.data` wraps this into a `datasets.Dataset` (source "shapes").
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from PIL import Image, ImageDraw

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond")

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "orange": (255, 140, 0),
    "yellow": (240, 210, 0),
    "green": (20, 160, 40),
    "blue": (20, 60, 220),
    "purple": (130, 40, 180),
    "pink": (240, 100, 170),
    "black": (20, 20, 20),
}

# position name -> (column, row) on a 3x3 grid; 0 = left/top, 1 = centre, 2 = right/bottom.
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top": (1, 0),
    "top right": (2, 0),
    "left": (0, 1),
    "center": (1, 1),
    "right": (2, 1),
    "bottom left": (0, 2),
    "bottom": (1, 2),
    "bottom right": (2, 2),
}

_POSITION_PHRASES: dict[str, str] = {
    "top left": "at the top left",
    "top": "at the top",
    "top right": "at the top right",
    "left": "on the left",
    "center": "in the center",
    "right": "on the right",
    "bottom left": "at the bottom left",
    "bottom": "at the bottom",
    "bottom right": "at the bottom right",
}

# size name -> side of the shape's bounding box as a fraction of the image side.
SIZES: dict[str, float] = {"small": 0.30, "large": 0.50}

MARGIN = 0.06  # gap between a shape at an edge position and the image border (fraction)
_JITTER_POS = 0.03  # max shift of the centre (fraction of the image side)
_JITTER_SIZE = 0.08  # max relative change of the size
SUPERSAMPLE = 4


@dataclasses.dataclass(frozen=True)
class ShapeSpec:
    shape: str
    colour: str
    position: str
    size: str
    dx: float = 0.0  # centre jitter, fraction of the image side
    dy: float = 0.0
    scale: float = 1.0  # size jitter, multiplies SIZES[size]

    @property
    def caption(self) -> str:
        return f"a {self.size} {self.colour} {self.shape} {_POSITION_PHRASES[self.position]}"

    def geometry(self) -> tuple[float, float, float]:
        """(centre x, centre y, bounding-box side), all as fractions of the image side."""
        side = SIZES[self.size] * self.scale
        col, row = POSITIONS[self.position]
        lo, hi = MARGIN + side / 2, 1.0 - MARGIN - side / 2
        cx = (lo, 0.5, hi)[col] + self.dx
        cy = (lo, 0.5, hi)[row] + self.dy
        return cx, cy, side


def sample_specs(count: int, seed: int) -> list[ShapeSpec]:
    """`count` random specs; item i depends only on (seed, i) (a longer set extends a shorter one)."""
    rng = np.random.default_rng((int(seed), 0x5A4E5))
    u = rng.random((int(count), 7))  # row-major: item i uses draws 7i .. 7i+6
    colours, positions, sizes = list(COLOURS), list(POSITIONS), list(SIZES)
    specs = []
    for row in u.tolist():
        specs.append(
            ShapeSpec(
                shape=SHAPES[int(row[0] * len(SHAPES))],
                colour=colours[int(row[1] * len(colours))],
                position=positions[int(row[2] * len(positions))],
                size=sizes[int(row[3] * len(sizes))],
                dx=(2 * row[4] - 1) * _JITTER_POS,
                dy=(2 * row[5] - 1) * _JITTER_POS,
                scale=1.0 + (2 * row[6] - 1) * _JITTER_SIZE,
            )
        )
    return specs


def _polygon(shape: str, cx: float, cy: float, half: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - half, cy - half), (cx + half, cy - half), (cx + half, cy + half), (cx - half, cy + half)]
    if shape == "diamond":
        return [(cx, cy - half), (cx + half, cy), (cx, cy + half), (cx - half, cy)]
    if shape == "triangle":  # pointing up, filling the bounding box
        return [(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)]
    if shape == "star":  # five points, outer radius = half, centred in the box
        pts = []
        inner = half * 0.45
        for j in range(10):
            r = half if j % 2 == 0 else inner
            a = -math.pi / 2 + j * math.pi / 5
            pts.append((cx + r * math.cos(a), cy + r * math.sin(a)))
        return pts
    raise ValueError(f"unknown shape {shape!r}")


def render(spec: ShapeSpec, resolution: int) -> Image.Image:
    """Draw `spec` on white as an RGB image of resolution x resolution (anti-aliased)."""
    big = resolution * SUPERSAMPLE
    img = Image.new("RGB", (big, big), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    cx, cy, side = spec.geometry()
    cx, cy, half = cx * big, cy * big, side * big / 2
    fill = COLOURS[spec.colour]
    if spec.shape == "circle":
        draw.ellipse([cx - half, cy - half, cx + half, cy + half], fill=fill)
    else:
        draw.polygon(_polygon(spec.shape, cx, cy, half), fill=fill)
    return img.reduce(SUPERSAMPLE)
