"""pocketdiff.compress: the two compression stages, each in its own package.

- `pocketdiff.compress.quant`: int8 / int4 weight quantization (`pocketdiff calibrate`:
  block-wise reconstruction PTQ) and the quantized checkpoint format export reads.
- `pocketdiff.compress.prune`: structured channel pruning + recovery (`pocketdiff prune`)
  and the pruned-model loaders.

The two do not import each other.
"""
