# Sourced by GPU-machine scripts (repo root, .gl/ carried): the Vulkan loader + glvnd from the carried
# debs, and VK_ICD_FILENAMES at the NVIDIA driver's ICD json (written when the driver has none), so
# LiteRT's GPU delegate runs on the real GPU. SKIP_GL=1 skips it (local dry runs on lavapipe).
if [ -z "${SKIP_GL:-}" ]; then
  for f in "$PWD"/.gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  glx=$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia\.so\.0/{print $NF; exit}')
  if [ -z "${VK_ICD_FILENAMES:-}${VK_DRIVER_FILES:-}" ]; then  # a driver file named by the caller wins
    for j in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
             /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/local/share/vulkan/icd.d/nvidia_icd.json; do
      if [ -f "$j" ]; then export VK_ICD_FILENAMES=$j; break; fi
    done
    if [ -z "${VK_ICD_FILENAMES:-}" ] && [ -n "$glx" ]; then  # driver present, json not: write one
      printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" > /tmp/nvidia_icd.json
      export VK_ICD_FILENAMES=/tmp/nvidia_icd.json
    fi
  fi
  export POCKETDIFF_VULKAN=system
  echo "VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-} libGLX_nvidia=${glx:-none}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
fi
