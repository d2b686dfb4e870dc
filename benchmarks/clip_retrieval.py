"""Retrieval accuracy of a domain CLIP on its held-out items (image->text and text->image top-1/top-5).

The held-out items are the ones `pocketdiff train-clip` kept out of training: the first
`holdout` items of `load_captioned_dataset(data)` as recorded in the folder's pocketdiff_clip.json.

    python benchmarks/clip_retrieval.py --clip outputs/clip-openmoji/clip --out retrieval-openmoji.json [--device cuda]
    python benchmarks/clip_retrieval.py --clip pocketdiff/assets/clip-shapes --out retrieval-shapes.json
    # other data (e.g. a fresh shapes draw): --data-source shapes --data-seed 77 --holdout 1024

Writes JSON: {"clip", "data", "holdout", "retrieval": {image_to_text_top1, image_to_text_top5,
text_to_image_top1, text_to_image_top5, num_images, num_captions, chance_*}, "seconds"}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from pocketdiff.config import DataConfig
    from pocketdiff.data import load_captioned_dataset
    from pocketdiff.evaluate import load_clip, retrieval_accuracy
    from pocketdiff.evaluate.train_clip import images_to_uint8

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clip", required=True, help="CLIP folder (train-clip's DIR/clip)")
    ap.add_argument("--out", required=True, help="result JSON")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--holdout", type=int, default=None, help="held-out count (default: the folder's)")
    ap.add_argument("--data-source", default=None, help="override the folder's data source")
    ap.add_argument("--data-path", default=None)
    ap.add_argument("--data-seed", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)

    t0 = time.time()
    clip = load_clip(args.clip, device=torch.device(args.device))
    meta = clip.meta
    data = dict(meta.get("data") or {"source": "shapes"})
    if args.data_source:
        data = {"source": args.data_source, "resolution": data.get("resolution", 32)}
    if args.data_path:
        data["path"] = args.data_path
    if args.data_seed is not None:
        data["seed"] = args.data_seed
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    dcfg = DataConfig(**{k: v for k, v in data.items() if k in fields})
    holdout = args.holdout or int(meta.get("holdout") or 512)
    if dcfg.max_samples is None or dcfg.max_samples > holdout:
        dcfg = dataclasses.replace(dcfg, max_samples=holdout)  # the first `holdout` items: the held-out ones
    ds = load_captioned_dataset(dcfg)
    images, captions = images_to_uint8(ds), list(ds["text"])
    r = retrieval_accuracy(clip.model, clip.processor, images, captions, batch_size=args.batch_size)
    result = {"clip": args.clip, "label": clip.label, "data": dataclasses.asdict(dcfg), "holdout": len(captions),
              "retrieval": r, "device": args.device, "seconds": round(time.time() - t0, 2),
              "note": "held-out = items the CLIP never trained on when data/seed match its pocketdiff_clip.json"}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
