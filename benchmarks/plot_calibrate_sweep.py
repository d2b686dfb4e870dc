"""Plot the error-vs-iterations sweep of `calibrate_sd21.py` (its JSON `sweep`): per block, the
block-output MSE after AdaRound (hard rounding, no RTN fallback) relative to RTN, on the
calibration set and on held-out inputs, against iterations per block.

    python benchmarks/plot_calibrate_sweep.py benchmarks/results/calibrate_sd21_sweep_h200.json  # -> .png beside it
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="calibrate_sd21.py JSON with a `sweep`")
    p.add_argument("--out", default=None, help="PNG (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    def variant(row):  # files written before --sweep-variants name only the lr, or nothing
        return row.get("variant", f"lr={row['lr']:g}" if row.get("lr") is not None else "")

    src = Path(args.result)
    sweep = json.loads(src.read_text()).get("sweep")
    if not sweep:
        p.error(f"{src} has no `sweep` (run calibrate_sd21.py without --no-sweep)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.8), sharey=True)
    for ax, key, title in ((axes[0], "ratio_vs_rtn", "calibration inputs"), (axes[1], "holdout_ratio_vs_rtn", "held-out inputs")):
        for block in sweep:
            rows = [r for r in block["rows"] if r["iters"] > 0]
            # one line per variant (--sweep-variants) or rounding lr (--sweep-lrs); older files have one
            keys = list(dict.fromkeys(map(variant, rows)))
            for k in keys:
                pts = [r for r in rows if variant(r) == k]
                label = f"{block['name']} ({block['kind']})" + (f", {k or 'recipe'}" if len(keys) > 1 else "")
                ax.plot([r["iters"] for r in pts], [r[key] for r in pts], marker="o", label=label)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("AdaRound iterations per block")
        ax.set_title(f"block-output MSE / RTN, {title}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MSE relative to RTN (below 1: better)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    out = Path(args.out) if args.out else src.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
