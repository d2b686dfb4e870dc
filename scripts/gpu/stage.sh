#!/usr/bin/env bash
# Staged carry: ignored folders too big for one device call (64 MiB a call, the tracked tree included) travel in parts
# over several calls of one warm machine, whose /tmp outlives each call (the repo copy does not).
# Here, from the repo root:
#   bash scripts/gpu/stage.sh split PATH... [--part-mb 14] [--every P]... [--first P]... [--first-cmd CMD] [--then CMD]
#     packs the ignored PATHs (repo-relative) into one tar stream, cut into at most PART_MB MiB parts of about equal
#     size: .stage/p00/, .stage/p01/, ... each one part (part) and a manifest (the split's id, the number of parts,
#     every part's sha256 and size, the paths). It prints the run calls to make: an optional first call carrying the
#     --first paths (e.g. .whl, with --first-cmd, default `source scripts/gpu/env.sh`), then one call per part carrying
#     .stage/pNN; --every paths (e.g. .gl) go in every call. Each call's bytes are measured (tracked + untracked-not-
#     ignored files, shared/, the carried files) and checked against the limit; over it, the exit status is 1.
# There (each call, repo root; STAGE_DIR, default /tmp/stage, the folder that outlives the call):
#   bash scripts/gpu/stage.sh receive   copies the carried .stage/pNN into STAGE_DIR after checking its sha256 (a part
#                                       received twice is fine; a corrupt one is one error line naming it, exit 2); once
#                                       all parts are in, assembles and extracts them into STAGE_DIR/tree
#   bash scripts/gpu/stage.sh restore   links each staged path at its repo-relative place in this call's repo copy
#                                       (exit 1 while parts are missing), so scripts that read e.g. .webnode/ run unchanged
#   bash scripts/gpu/stage.sh status    what STAGE_DIR holds
# Make the calls back to back: a machine goes back 30 s after a call ends, and a fresh one has an empty /tmp (receive
# then names the parts missing). STAGE_LIMIT (bytes, default 65011712 = 62 MiB) is the per-call limit split checks against:
# the device tool's limit is 64 MiB, but it refused a call that this count put 0.28 MB under it (2026-11-29), so 2 MiB are kept back.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STAGE_DIR=${STAGE_DIR:-/tmp/stage}
LIMIT=${STAGE_LIMIT:-65011712}
SRC="$ROOT/.stage"
die() { echo "stage: $*" >&2; exit "${RC:-1}"; }
num() { printf "%'d" "$1" 2>/dev/null || printf "%d" "$1"; }
# bytes of the files (and links, as links) under the given paths, relative to ROOT
bytes_of() { (cd "$ROOT" && find "$@" \( -type f -o -type l \) -print0 | xargs -0 -r stat -c %s | awk '{s += $1} END {print s + 0}'); }
# what travels in every call: tracked + untracked-not-ignored files, and shared/ where there is one
base_bytes() {
  (cd "$ROOT" && {
    git ls-files -z --cached --others --exclude-standard
    [ ! -d shared ] || find shared \( -type f -o -type l \) -print0
  } | sort -zu | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
}
field() { awk -v k="$1" '$1 == k {sub("^" k " ", ""); print; exit}' "$2"; }

split_cmd() {
  local part_mb=14 first_cmd="source scripts/gpu/env.sh" then_cmd="<the measurement, e.g. bash scripts/gpu/web_node.sh>"
  local paths=() every=() first=()
  while [ $# -gt 0 ]; do
    case $1 in
      --part-mb) part_mb=$2; shift 2 ;;
      --every) every+=("${2%/}"); shift 2 ;;
      --first) first+=("${2%/}"); shift 2 ;;
      --first-cmd) first_cmd=$2; shift 2 ;;
      --then) then_cmd=$2; shift 2 ;;
      -*) die "split: unknown option $1" ;;
      *) paths+=("${1%/}"); shift ;;
    esac
  done
  [ ${#paths[@]} -gt 0 ] || die "split: name the ignored paths to stage (relative to the repo root)"
  local max; max=$(awk -v m="$part_mb" 'BEGIN {printf "%d", m * 1048576}')
  [ "$max" -gt 0 ] || die "split: --part-mb $part_mb is no size"
  cd "$ROOT"
  local p
  for p in "${paths[@]}" "${every[@]}" "${first[@]}"; do
    case $p in /*|..|../*|*/../*|.stage|.stage/*) die "split: $p is not a path inside the repo beside .stage" ;; esac
    [ -e "$p" ] || die "split: $p does not exist under $ROOT"
    git check-ignore -q "$p" || die "split: $p is not ignored by git: it travels in every call anyway"
  done
  mkdir -p .stage
  git check-ignore -q .stage/p00/part || die "split: .stage/ is not ignored by git (add /.stage/ to .gitignore): its parts would travel in every call"
  rm -rf .stage/p[0-9][0-9] .stage/tmp && mkdir -p .stage/tmp
  tar -C "$ROOT" --sort=name --owner=0 --group=0 --numeric-owner -cf .stage/tmp/stream.tar -- "${paths[@]}"
  local total n each
  total=$(stat -c %s .stage/tmp/stream.tar)
  n=$(( (total + max - 1) / max )); [ "$n" -ge 1 ] || n=1
  [ "$n" -le 100 ] || die "split: $n parts of $part_mb MiB; at most 100 (a larger --part-mb)"
  each=$(( (total + n - 1) / n ))
  split -b "$each" -d -a 2 .stage/tmp/stream.tar .stage/tmp/p
  rm .stage/tmp/stream.tar
  local sums=() f name id
  for f in .stage/tmp/p[0-9][0-9]; do
    name=p${f##*/p}
    sums+=("part $name $(sha256sum "$f" | cut -c1-64) $(stat -c %s "$f")")
  done
  n=${#sums[@]}
  id=$(printf '%s\n' "${sums[@]}" | sha256sum | cut -c1-12)
  for f in .stage/tmp/p[0-9][0-9]; do
    name=p${f##*/p}
    mkdir -p ".stage/$name" && mv "$f" ".stage/$name/part"
    { echo "stage 1"; echo "id $id"; echo "parts $n"; echo "this $name"
      for p in "${paths[@]}"; do echo "path $p"; done
      printf '%s\n' "${sums[@]}"; } > ".stage/$name/manifest"
  done
  rmdir .stage/tmp
  # the calls, each measured
  local base over=0 calls=() carry b tot k=0 last=$(( n - 1 ))
  base=$(base_bytes)
  echo "stage: ${paths[*]} -> $n parts of $(num "$each") bytes at most ($(num "$total") bytes of tar, --part-mb $part_mb) in .stage/p00..$(printf 'p%02d' "$last"), id $id"
  echo "stage: in every call: tracked + untracked-not-ignored files$([ -d shared ] && echo ' + shared/') = $(num "$base") bytes; limit $(num "$LIMIT") bytes (the tool's 64 MiB less 2 MiB kept back)"
  [ ${#first[@]} -eq 0 ] || calls+=("first")
  for ((k = 0; k < n; k++)); do calls+=("$(printf 'p%02d' "$k")"); done
  k=0
  local c cmd list
  for c in "${calls[@]}"; do
    k=$((k + 1))
    if [ "$c" = first ]; then carry=("${first[@]}" "${every[@]}"); cmd=$first_cmd
    else
      carry=(".stage/$c" "${every[@]}"); cmd="bash scripts/gpu/stage.sh receive"
      [ "$c" != "$(printf 'p%02d' "$last")" ] || cmd="$cmd && bash scripts/gpu/stage.sh restore && $then_cmd"
    fi
    b=$(bytes_of "${carry[@]}")
    tot=$((base + b))
    list=$(printf '"%s", ' "${carry[@]}"); list="[${list%, }]"
    if [ "$tot" -le "$LIMIT" ]; then
      echo "call $k: carry $list: $(num "$base") + $(num "$b") = $(num "$tot") bytes, $(num $((LIMIT - tot))) under the limit"
    else
      echo "call $k: carry $list: $(num "$base") + $(num "$b") = $(num "$tot") bytes, OVER the limit by $(num $((tot - LIMIT))): a smaller --part-mb"
      over=1
    fi
    echo "        command: $cmd"
  done
  echo "stage: make the calls back to back (a machine goes back 30 s after a call; /tmp/stage is lost with it)"
  [ "$over" -eq 0 ] || die "split: some call is over the limit"
}

# the parts STAGE_DIR holds and lacks, against its manifest
inventory() {
  have=() missing=()
  local k nm
  n=$(field parts "$STAGE_DIR/manifest")
  for ((k = 0; k < n; k++)); do
    nm=$(printf 'p%02d' "$k")
    if [ -f "$STAGE_DIR/parts/$nm" ]; then have+=("$nm"); else missing+=("$nm"); fi
  done
}

receive_cmd() {
  shopt -s nullglob
  local d m nm want got id old carried=()
  # check every carried part before anything is kept
  for d in "$SRC"/p[0-9][0-9]; do
    nm=${d##*/}; m=$d/manifest
    [ -f "$m" ] && [ -f "$d/part" ] || RC=2 die "part $nm is incomplete: $d lacks its part or manifest"
    want=$(awk -v p="$nm" '$1 == "part" && $2 == p {print $3}' "$m")
    got=$(sha256sum "$d/part" | cut -c1-64)
    [ -n "$want" ] && [ "$got" = "$want" ] || RC=2 die "part $nm is corrupt ($d/part: sha256 ${got:0:16}..., manifest ${want:0:16}...): carry it again, or split again here"
    id=$(field id "$m")
    [ ${#carried[@]} -eq 0 ] || [ "$id" = "$(field id "$SRC/${carried[0]}/manifest")" ] || RC=2 die "part $nm is of another split (id $id) than ${carried[0]}"
    carried+=("$nm")
  done
  mkdir -p "$STAGE_DIR"
  if [ ${#carried[@]} -gt 0 ]; then
    id=$(field id "$SRC/${carried[0]}/manifest")
    old=$(field id "$STAGE_DIR/manifest" 2>/dev/null || true)
    if [ -n "$old" ] && [ "$old" != "$id" ]; then
      echo "stage: $STAGE_DIR held split $old; starting over with split $id"
      rm -rf "$STAGE_DIR/parts" "$STAGE_DIR/tree" "$STAGE_DIR/extracted" "$STAGE_DIR/manifest"
    fi
    grep -v '^this ' "$SRC/${carried[0]}/manifest" > "$STAGE_DIR/manifest.tmp" && mv "$STAGE_DIR/manifest.tmp" "$STAGE_DIR/manifest"
    mkdir -p "$STAGE_DIR/parts"
    for nm in "${carried[@]}"; do
      if [ -f "$STAGE_DIR/parts/$nm" ]; then echo "stage: $nm received before"; continue; fi
      cp "$SRC/$nm/part" "$STAGE_DIR/parts/$nm.tmp" && mv "$STAGE_DIR/parts/$nm.tmp" "$STAGE_DIR/parts/$nm"
    done
  fi
  if [ ! -f "$STAGE_DIR/manifest" ]; then
    echo "stage: no part carried and none in $STAGE_DIR (carry .stage/pNN)"; return 0
  fi
  id=$(field id "$STAGE_DIR/manifest")
  inventory
  echo "stage: split $id: ${#have[@]} of $n parts in $STAGE_DIR (this call: ${carried[*]:-none})${missing[*]:+; missing: ${missing[*]}}"
  [ ${#missing[@]} -eq 0 ] || return 0
  [ "$(cat "$STAGE_DIR/extracted" 2>/dev/null)" != "$id" ] || { echo "stage: extracted before in $STAGE_DIR/tree"; return 0; }
  for nm in "${have[@]}"; do  # once more before use: a part kept from an earlier call
    want=$(awk -v p="$nm" '$1 == "part" && $2 == p {print $3}' "$STAGE_DIR/manifest")
    got=$(sha256sum "$STAGE_DIR/parts/$nm" | cut -c1-64)
    [ "$got" = "$want" ] || { rm -f "$STAGE_DIR/parts/$nm"; RC=2 die "part $nm is corrupt in $STAGE_DIR (removed): carry it again"; }
  done
  rm -rf "$STAGE_DIR/tree" "$STAGE_DIR/tree.tmp" && mkdir -p "$STAGE_DIR/tree.tmp"
  (cd "$STAGE_DIR/parts" && cat "${have[@]}") | tar -x -C "$STAGE_DIR/tree.tmp" --no-same-owner
  mv "$STAGE_DIR/tree.tmp" "$STAGE_DIR/tree" && echo "$id" > "$STAGE_DIR/extracted"
  echo "stage: all $n parts: $(awk '$1 == "path" {sub("^path ", ""); printf "%s ", $0}' "$STAGE_DIR/manifest")extracted into $STAGE_DIR/tree"
}

restore_cmd() {
  [ -f "$STAGE_DIR/manifest" ] || die "restore: nothing received in $STAGE_DIR (bash scripts/gpu/stage.sh receive with .stage/pNN carried)"
  local id p src dst
  id=$(field id "$STAGE_DIR/manifest")
  inventory
  [ ${#missing[@]} -eq 0 ] || die "restore: ${#have[@]} of $n parts in $STAGE_DIR; missing: ${missing[*]} (a fresh machine loses /tmp: carry them again)"
  [ "$(cat "$STAGE_DIR/extracted" 2>/dev/null)" = "$id" ] || die "restore: split $id is not extracted (bash scripts/gpu/stage.sh receive)"
  while IFS= read -r p; do
    src=$STAGE_DIR/tree/$p; dst=$ROOT/$p
    [ -e "$src" ] || die "restore: $p is not in $STAGE_DIR/tree"
    if [ -L "$dst" ]; then rm "$dst"
    elif [ -e "$dst" ]; then die "restore: $p exists in $ROOT and is no link: left as it is"; fi
    mkdir -p "$(dirname "$dst")" && ln -s "$src" "$dst"
    echo "stage: $p -> $src"
  done < <(awk '$1 == "path" {sub("^path ", ""); print}' "$STAGE_DIR/manifest")
}

status_cmd() {
  [ -f "$STAGE_DIR/manifest" ] || { echo "stage: nothing in $STAGE_DIR"; return 0; }
  inventory
  echo "stage: split $(field id "$STAGE_DIR/manifest"): ${#have[@]} of $n parts${missing[*]:+; missing: ${missing[*]}}$([ -f "$STAGE_DIR/extracted" ] && echo '; extracted')"
}

case ${1:-} in
  split) shift; split_cmd "$@" ;;
  receive) receive_cmd ;;
  restore) restore_cmd ;;
  status) status_cmd ;;
  *) echo "usage: bash scripts/gpu/stage.sh split PATH... [--part-mb 14] [--every P] [--first P] [--first-cmd CMD] [--then CMD] | receive | restore | status" >&2; exit 64 ;;
esac
