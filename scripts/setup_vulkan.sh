#!/usr/bin/env bash
# Unpack Mesa >= 25 lavapipe (a CPU Vulkan driver) into <repo>/.vulkan/ so the LiteRT GPU
# delegate (WebGPU over Vulkan) runs on machines without a GPU. Nothing is installed
# system-wide: a private apt sources/lists folder for Debian bookworm-backports,
# `apt-get download`, `dpkg -x`, and an ICD json pointing at the unpacked libvulkan_lvp.so.
# pocketdiff.runtime.delegate selects it (VK_ICD_FILENAMES / LD_LIBRARY_PATH) when no NVIDIA
# driver is present. Idempotent: returns at once when the driver is already unpacked.
#
# Environment: POCKETDIFF_VULKAN_DIR (default <repo>/.vulkan), DEBIAN_MIRROR (default: the
# machine's own Debian archive from /etc/apt, else http://deb.debian.org/debian),
# DEBIAN_KEYRING (default /usr/share/keyrings/debian-archive-keyring.gpg), FORCE=1 to redo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${POCKETDIFF_VULKAN_DIR:-$ROOT/.vulkan}"
ICD="$DEST/lvp_icd.json"
STAMP="$DEST/.complete"
PACKAGES=(mesa-vulkan-drivers libdrm2 libdrm-amdgpu1 libvulkan1)

if [ "${FORCE:-0}" != "1" ] && [ -f "$STAMP" ] && [ -f "$ICD" ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  echo "setup_vulkan: apt-get/dpkg not found; install a Vulkan driver (Mesa >= 25 lavapipe) by other means" >&2
  exit 1
fi

CODENAME="bookworm"
if [ -r /etc/os-release ]; then
  # shellcheck disable=SC1091
  CODENAME="$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")"
fi
if [ "$CODENAME" != "bookworm" ]; then
  echo "setup_vulkan: note: machine is Debian '$CODENAME'; fetching bookworm-backports Mesa anyway" >&2
fi

# The machine's own Debian archive (first deb822 URIs line naming a non-security Debian suite).
detect_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -r "$f" ] || continue
    awk 'BEGIN{RS=""} /Suites:[^\n]*bookworm/ && !/security/ {for(i=1;i<=NF;i++) if($i=="URIs:"){print $(i+1); exit}}' "$f"
  done | head -n1
}
MIRROR="${DEBIAN_MIRROR:-$(detect_mirror || true)}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
KEYRING="${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"

WORK="$DEST/.apt"
rm -rf "$WORK"
mkdir -p "$WORK/lists/partial" "$WORK/archives/partial" "$WORK/sources.list.d" "$WORK/debs"
cat > "$WORK/sources.list.d/pocketdiff-backports.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-backports
Components: main
Signed-By: $KEYRING
EOF
: > "$WORK/sources.list"
APT_OPTS=(
  -o "Dir::Etc::SourceList=$WORK/sources.list"
  -o "Dir::Etc::SourceParts=$WORK/sources.list.d"
  -o "Dir::State::Lists=$WORK/lists"
  -o "Dir::Cache::Archives=$WORK/archives"
  -o "Dir::Cache::pkgcache=$WORK/pkgcache.bin"
  -o "Dir::Cache::srcpkgcache=$WORK/srcpkgcache.bin"
  -o "APT::Get::List-Cleanup=0"
  -o "Debug::NoLocking=1"
)
if [ "$(id -u)" = "0" ]; then APT_OPTS+=(-o "APT::Sandbox::User=root"); fi
echo "setup_vulkan: apt index for bookworm-backports from $MIRROR (private folder $WORK)"
apt-get "${APT_OPTS[@]}" -qq update

# Runtime dependencies the machine lacks (e.g. libllvm15 on a slim image) come along too.
is_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
EXTRA=()
while read -r dep; do
  case " ${PACKAGES[*]} " in *" $dep "*) continue ;; esac
  is_installed "$dep" || EXTRA+=("$dep")
done < <(apt-cache "${APT_OPTS[@]}" -t bookworm-backports depends --recurse --no-recommends --no-suggests \
           --no-conflicts --no-breaks --no-replaces --no-enhances "${PACKAGES[@]}" \
         | sed -n 's/^ *\(Pre\)\?Depends: \([a-z0-9][a-z0-9.+-]*\)$/\2/p' | sort -u)
if [ "${#EXTRA[@]}" -gt 0 ]; then
  echo "setup_vulkan: also unpacking dependencies missing on this machine: ${EXTRA[*]}"
fi

# bookworm-backports where it has the package (Mesa >= 25, the libdrm it needs), else bookworm.
cd "$WORK/debs"
apt-get "${APT_OPTS[@]}" -t bookworm-backports -qq download "${PACKAGES[@]}" "${EXTRA[@]}"

mkdir -p "$DEST/root"
for deb in "$WORK"/debs/*.deb; do
  echo "setup_vulkan: unpacking $(basename "$deb")"
  dpkg -x "$deb" "$DEST/root"
done

LVP="$(find "$DEST/root" -name 'libvulkan_lvp.so' | head -n1)"
if [ -z "$LVP" ]; then
  echo "setup_vulkan: libvulkan_lvp.so not found in the unpacked packages" >&2
  exit 1
fi
MESA_VERSION="$(dpkg-deb -f "$(ls "$WORK"/debs/mesa-vulkan-drivers_*.deb | head -n1)" Version)"
case "$MESA_VERSION" in
  2[5-9].*|[3-9][0-9].*) ;;
  *) echo "setup_vulkan: got Mesa $MESA_VERSION; the delegate needs Mesa >= 25 (older lavapipe: 'No adapters found')" >&2; exit 1 ;;
esac
LIBDIR="$(dirname "$LVP")"
cat > "$ICD" <<EOF
{
    "file_format_version": "1.0.1",
    "ICD": {
        "library_path": "$LVP",
        "api_version": "1.3.0"
    }
}
EOF
echo "$LIBDIR" > "$DEST/libdir"
echo "$MESA_VERSION" > "$DEST/mesa_version"
# Keep lavapipe, the loader and libdrm; drop the hardware drivers and layers (~55 MB), so the
# folder is small enough to carry to a machine without network (its GPU driver + our loader).
find "$DEST/root" \( -name 'libvulkan_intel*.so' -o -name 'libvulkan_radeon.so' -o -name 'libvulkan_virtio.so' \
  -o -name 'libvulkan_gfxstream.so' -o -name 'libVkLayer_*.so' \) -delete
find "$DEST/root" -path '*/vulkan/icd.d/*' ! -name 'lvp_icd*' -delete 2>/dev/null || true
rm -rf "$WORK"
touch "$STAMP"
echo "setup_vulkan: Mesa $MESA_VERSION lavapipe ready: VK_ICD_FILENAMES=$ICD LD_LIBRARY_PATH=$LIBDIR"
