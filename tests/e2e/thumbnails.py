#!/usr/bin/env python3
"""Template thumbnails from the real frontend's screenshots.

ComfyUI's template browser shows a custom node pack's template ``<name>.json`` with the thumbnail
``/api/workflow_templates/<pack folder>/<name>.jpg`` (frontend: ``mediaSubtype`` 'jpg', no index suffix), served
from the same ``workflows/`` folder. To refresh them: run ``browser_check.py --out-dir SHOTS --workflow ...`` against
a ComfyUI that has the workflows' model file names installed (empty placeholder files are enough: nothing is
run), then ``python tests/e2e/thumbnails.py SHOTS workflows``. Each screenshot is cropped to the graph (the
frontend's bars and controls left out) and fitted into a 640x480 JPEG.
"""
from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageChops, ImageDraw, ImageFilter

SIZE = (640, 480)


def thumbnail(png: Path) -> Image.Image:
    im = Image.open(png).convert("RGB")
    w, h = im.size
    bg = im.getpixel((w // 2, h - 5))
    draw = ImageDraw.Draw(im)
    for box in ((0, 0, w, 80), (0, 0, 62, h), (0, h - 90, 150, h), (w - 330, h - 80, w, h), (w - 380, 0, w, 100)):
        draw.rectangle(box, fill=bg)  # tab bar, side bar, stats, zoom controls, run button
    canvas = im.crop((62, 80, w, h))
    diff = ImageChops.difference(canvas, Image.new("RGB", canvas.size, bg)).convert("L")
    mask = diff.point(lambda v: 255 if v > 14 else 0).filter(ImageFilter.MinFilter(7))  # drops the dot grid
    left, top, right, bottom = mask.getbbox()
    pad = 24
    graph = canvas.crop((max(0, left - pad), max(0, top - pad), min(canvas.width, right + pad),
                         min(canvas.height, bottom + pad)))
    scale = min(SIZE[0] / graph.width, SIZE[1] / graph.height)
    graph = graph.resize((int(graph.width * scale), int(graph.height * scale)), Image.LANCZOS)
    out = Image.new("RGB", SIZE, bg)
    out.paste(graph, ((SIZE[0] - graph.width) // 2, (SIZE[1] - graph.height) // 2))
    return out


def main(argv: list[str]) -> int:
    shots, workflows = Path(argv[0]), Path(argv[1])
    for wf in sorted(workflows.glob("*.json")):
        png = shots / f"{wf.stem}.png"
        if not png.is_file():
            print(f"no screenshot for {wf.stem}", file=sys.stderr)
            return 1
        thumbnail(png).save(workflows / f"{wf.stem}.jpg", quality=85, optimize=True)
        print(workflows / f"{wf.stem}.jpg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
