# gpu_tag [DEFAULT]: the GPU's short name for result file names, from nvidia-smi ("NVIDIA H100 80GB HBM3" -> h100: the
# first H followed by digits, so HBM's H is never taken), or DEFAULT (default: gpu) where there is no nvidia-smi or no
# such name. Sourced by env.sh and openmoji_lib.sh.
gpu_tag() {
  local tag
  tag=$(command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
        | grep -o 'H[0-9]\+' | head -1 | tr A-Z a-z)
  echo "${tag:-${1:-gpu}}"
}
