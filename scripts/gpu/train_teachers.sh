#!/usr/bin/env bash
# How the shipped teachers were made, on one GPU machine (the device tool; wheels in .whl/,
# OpenMoji in .devdata/): `bash scripts/gpu/train_teachers.sh shapes [openmoji]`.
set -u
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site POCKETDIFF_DATA=$REPO/.devdata TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/runs && cd /tmp/runs  # not the repo root: its pocketdiff/ folder would shadow the installed package
for r in "$@"; do
  python3 -m pocketdiff train-teacher --config $REPO/configs/teacher/$r.yaml --output $r --overwrite > $OUT/$r.log 2>&1 &
done
wait
for r in "$@"; do
  tar czf /tmp/$r.tgz -C $r pipeline report.json config.yaml logs.jsonl loss.png samples.png index.html && split -b 15m /tmp/$r.tgz $OUT/$r.tgz.
done
ls -la $OUT
