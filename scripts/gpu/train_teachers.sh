#!/usr/bin/env bash
# How the shipped teachers were made, on one GPU machine (the device tool; wheels in .whl/,
# OpenMoji in .devdata/): `bash scripts/gpu/train_teachers.sh shapes [openmoji]`.
set -u
source scripts/gpu/env.sh
for r in "$@"; do
  python3 -m pocketdiff train-teacher --config $REPO/configs/teacher/$r.yaml --output $r --overwrite > $OUT/$r.log 2>&1 &
done
wait
for r in "$@"; do
  pack $r $r pipeline report.json config.yaml logs.jsonl loss.png samples.png index.html
done
ls -la $OUT
