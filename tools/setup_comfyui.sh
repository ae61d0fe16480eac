#!/usr/bin/env bash
# A real ComfyUI for tests/e2e, set up once and kept: ComfyUI 0.33.0 from its source archive, its own venv (torch
# 2.14.1, torchvision, torchaudio, ComfyUI's requirements with its bundled frontend 1.49.6, Playwright), frontend
# 1.58.1 beside it (passed to ComfyUI's --front-end-root by the browser tests) and Debian's Chromium.
#
#   bash tools/setup_comfyui.sh        # then `.venv/bin/python -m pytest` runs tests/e2e against it
#
# Where: $WAN_ACCEL_E2E_HOME (default ~/.cache/wan-accel-e2e), outside the checkout. The source archive:
# $WAN_ACCEL_COMFYUI_SRC (default ../shared/comfyui/comfyui-0.33.0-src.tar.xz beside the checkout). Without the
# archive it says so and exits 0 (tests/e2e are then skipped), except under CI=true, where that is an error.
# A finished set-up is marked by $WAN_ACCEL_E2E_HOME/ready holding this script's and the archive's checksums;
# anything else there is rebuilt. tests/conftest.py reads that folder (WAN_ACCEL_E2E=0 turns the end-to-end
# tests off; COMFYUI_DIR / COMFYUI_VENV point them at another ComfyUI).
set -euo pipefail
cd "$(dirname "$0")/.."

HOME_DIR="${WAN_ACCEL_E2E_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/wan-accel-e2e}"
SRC="${WAN_ACCEL_COMFYUI_SRC:-../shared/comfyui/comfyui-0.33.0-src.tar.xz}"
FRONTEND_NEW=1.58.1

if [ ! -f "$SRC" ]; then
    if [ "${CI:-}" = "true" ]; then
        echo "setup_comfyui: no ComfyUI source archive at $SRC (set WAN_ACCEL_COMFYUI_SRC)" >&2
        exit 1
    fi
    echo "setup_comfyui: no ComfyUI source archive at $SRC (set WAN_ACCEL_COMFYUI_SRC): tests/e2e will be skipped"
    exit 0
fi

# Chromium for the browser half (kept out of the stamp: a machine may lose or gain it)
if ! command -v chromium >/dev/null 2>&1 && [ -z "${CHROMIUM:-}" ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    elif [ "${CI:-}" = "true" ]; then
        echo "setup_comfyui: no chromium on PATH and no way to install it (root and apt-get needed)" >&2
        exit 1
    else
        echo "setup_comfyui: no chromium on PATH (install Debian's chromium or set CHROMIUM): the browser tests will be skipped"
    fi
fi

stamp="$(cat "$0" "$SRC" | sha256sum | cut -d' ' -f1)"
if [ -f "$HOME_DIR/ready" ] && [ "$(cat "$HOME_DIR/ready")" = "$stamp" ]; then
    echo "setup_comfyui: ComfyUI ready in $HOME_DIR"
    exit 0
fi

echo "setup_comfyui: setting up ComfyUI in $HOME_DIR (a few minutes, once)"
# only a folder this script made (it holds .wan_accel_e2e) is ever emptied
if [ -d "$HOME_DIR" ] && [ -n "$(ls -A "$HOME_DIR")" ] && [ ! -f "$HOME_DIR/.wan_accel_e2e" ]; then
    echo "setup_comfyui: $HOME_DIR holds files this script did not make: choose another WAN_ACCEL_E2E_HOME" >&2
    exit 2
fi
rm -rf "$HOME_DIR"
mkdir -p "$HOME_DIR"
touch "$HOME_DIR/.wan_accel_e2e"
tar -xJf "$SRC" -C "$HOME_DIR"
test -f "$HOME_DIR/ComfyUI/main.py"

python3 -m venv "$HOME_DIR/venv"
PIP=("$HOME_DIR/venv/bin/pip" install --quiet --disable-pip-version-check)
# torchvision and torchaudio must import beside torch (ComfyUI imports both at start-up); the three torch lines
# of ComfyUI's requirements are left out so pip never swaps the torch installed here
"${PIP[@]}" torch==2.14.1 torchvision==0.29.1
"${PIP[@]}" torchaudio==2.11.0
grep -v -E '^(torch|torchvision|torchaudio)[[:space:]]*$' "$HOME_DIR/ComfyUI/requirements.txt" > "$HOME_DIR/requirements.txt"
"${PIP[@]}" -r "$HOME_DIR/requirements.txt"
"${PIP[@]}" playwright        # drives the system Chromium; `playwright install` is never run
"${PIP[@]}" --no-deps --target "$HOME_DIR/frontend-$FRONTEND_NEW" "comfyui-frontend-package==$FRONTEND_NEW"
test -f "$HOME_DIR/frontend-$FRONTEND_NEW/comfyui_frontend_package/static/index.html"

echo "$stamp" > "$HOME_DIR/ready"
echo "setup_comfyui: ComfyUI ready in $HOME_DIR"
