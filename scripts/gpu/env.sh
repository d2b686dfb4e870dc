# Sourced at the start of every GPU-machine script (the device tool runs them from the repo
# root, with the wheels of .whl/ and the OpenMoji copy of .devdata/ carried beside it).
# Installs the carried wheels and this repo into /tmp/site, then works from $RUNS: not the
# repo root, whose pocketdiff/ folder would shadow the installed package.
REPO=$PWD
source "$REPO/scripts/gpu/gpu_tag.sh"  # gpu_tag: h100 / h200 for result names
if [ -z "${POCKETDIFF_ENV_READY:-}" ]; then  # a script started by an already set-up script must not reinstall under running jobs
  if [ ! -f /tmp/site/.wheels-installed ] || [ -n "${REINSTALL:-}" ]; then  # later calls of a warm machine need not carry .whl
    if ls .whl/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    fi
    for t in .whl/*.tar.xz; do  # a slimmed package (e.g. ai-edge-litert without its NPU plugins) that the size limit needs
      [ -f "$t" ] && { python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$t" /tmp/site || exit 1; }
    done
    touch /tmp/site/.wheels-installed
  fi
  # this repo, unless the same sources are installed already (a reinstall under running jobs of a
  # warm machine could hand a starting process half-written files)
  src=$(find . -name '*.py' -not -path './tests/*' -not -path './.*' -not -path './benchmarks/*' | sort | xargs cat | md5sum | cut -c1-32)
  if [ "$(cat /tmp/site/.pocketdiff-installed 2>/dev/null)" != "$src" ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . >/dev/null || exit 1
    echo "$src" > /tmp/site/.pocketdiff-installed
  fi
  # the data: carried as .devdata on the first call, kept in /tmp for later calls (the repo copy is not kept)
  if [ -d "$REPO/.devdata" ] && [ ! -f /tmp/devdata/.copied ]; then
    rm -rf /tmp/devdata && cp -r "$REPO/.devdata" /tmp/devdata && touch /tmp/devdata/.copied
  fi
fi
export PYTHONPATH=/tmp/site POCKETDIFF_DATA=/tmp/devdata POCKETDIFF_ENV_READY=1 TQDM_MININTERVAL=30 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
RUNS=/tmp/runs  # /tmp outlives a call while the machine stays warm (the repo copy does not)
mkdir -p "$RUNS" && cd "$RUNS" || exit 1
# pack FOLDER NAME [entries...]: tar.gz of FOLDER's entries into $OUT, split in 15 MB parts ($OUT takes 16 MB files)
pack() { local dir=$1 name=$2; shift 2; tar czf /tmp/$name.tgz -C "$dir" "$@" && split -b 15m /tmp/$name.tgz $OUT/$name.tgz.; }
# reports RUN_FOLDER FILE.tgz: a run's reports, logs and pictures, without weights or checkpoints
reports() { tar czf "$2" -C "$1" --exclude=checkpoints --exclude=cache --exclude='*.safetensors' --exclude='*.pt' . ; }
