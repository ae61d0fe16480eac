#!/usr/bin/env bash
# Fill the git-ignored .gpu/ with what a GPU machine without network needs beside the pack (about 29 MB):
# fa3-fwd (FlashAttention 3's forward, CUDA 13, torch >= 2.10), platformdirs, and ComfyUI's carry
# (tools/carry_comfyui.py). Then run tools/gpu_run.sh there with .gpu carried.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
mkdir -p "$REPO/.gpu/wheels"
"$PY" -m pip download -q --no-deps -d "$REPO/.gpu/wheels" "fa3-fwd==0.0.3" platformdirs
COMFY_SRC="${COMFYUI_DIR:-}"
if [ -n "$COMFY_SRC" ]; then
  "$PY" "$REPO/tools/carry_comfyui.py" --comfyui "$COMFY_SRC"
else
  echo "COMFYUI_DIR is not set: no ComfyUI carry (the native stage will say ComfyUI is not importable)" >&2
fi
du -sh "$REPO/.gpu"
