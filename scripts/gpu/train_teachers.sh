#!/usr/bin/env bash
# How the shipped teachers were made: both recipes at once on one GPU machine (the device
# tool; wheels in .whl/, OpenMoji in .devdata/). Outputs packed into $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site POCKETDIFF_DATA=$PWD/.devdata TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p runs
SHAPES_BUDGET=${SHAPES_BUDGET:-330}
OPENMOJI_BUDGET=${OPENMOJI_BUDGET:-300}
python3 -m pocketdiff train-teacher --config configs/teacher/shapes.yaml --output runs/shapes --overwrite train.max_time_s=$SHAPES_BUDGET > $OUT/shapes.log 2>&1 &
python3 -m pocketdiff train-teacher --config configs/teacher/openmoji.yaml --output runs/openmoji --overwrite train.max_time_s=$OPENMOJI_BUDGET > $OUT/openmoji.log 2>&1 &
wait

for r in shapes openmoji; do
  tar czf /tmp/$r.tgz -C runs/$r pipeline report.json config.yaml logs.jsonl loss.png samples.png index.html && split -b 15m /tmp/$r.tgz $OUT/$r.tgz.
done
ls -la $OUT; tail -3 $OUT/*.log
