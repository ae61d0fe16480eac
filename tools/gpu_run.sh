#!/usr/bin/env bash
# The next GPU run's script (issues 41 and 42): FlashAttention 3 from fa3-fwd at the 1.3B's calls and in the
# exact video, the user's path (ComfyUI's MODEL: core's SamplerARVideo beside the pack's AR sampler, bf16, fp8
# scaled, a LoRA), a smaller card (8 GB cap) and Krea 14B (fp8 weights at a 24 GB cap; bf16 uncapped).
# Each stage has its own time limit; each finished stage is appended to $OUT/results.tar at once (a run stopped
# half-way keeps what finished), with $OUT/summary.txt. Two calls: PART=1 (attention, FA3's append-and-attend and
# fp8 calls, 1.3B exact and fp8, native; about 9 minutes at most), then PART=2 (caps and 14B; about 6).
# Before it: bash tools/gpu_prepare.sh (here, with network: the wheels and the ComfyUI carry into .gpu/).
# On the GPU machine: OUT=$OUT PY=python3 PART=1 bash tools/gpu_run.sh   (carry .gpu)
# CPU trial first: TRIAL=1 PY=<a python with torch> OUT=/tmp/gpu-out bash tools/gpu_run.sh   (tiny shapes)
set -u
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT/r"
R="$OUT/r"; SUM="$OUT/summary.txt"; : > "$SUM"
T0=$(date +%s)
TRIAL="${TRIAL:-0}"
PY="${PY:-python3}"
W=$(mktemp -d); mkdir -p "$W/site" "$W/pkg"; ln -s "$REPO" "$W/pkg/wan_accel"
export PYTHONPATH="$W/pkg:$W/site${PYTHONPATH:+:$PYTHONPATH}"
export WAN_ACCEL_CACHE="$W/cache/limits.json"; mkdir -p "$W/cache"   # a cold limit cache, as a new machine has
export PYTHONUNBUFFERED=1
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUM"; }
stage() {   # stage NAME SECONDS CMD...   stdout -> NAME.json, stderr -> NAME.log
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$R/$name.json" 2> "$R/$name.log"; local rc=$?
  log "stage $name rc=$rc $(( $(date +%s) - t ))s (limit $limit)"
  tail -c 1500 "$R/$name.log" | sed 's/^/    /' | tail -8 >> "$SUM"
  tar -C "$OUT" -rf "$OUT/results.tar" "r/$name.json" "r/$name.log" && rm -f "$R/$name.json" "$R/$name.log"
}
finish() {
  log "total $(( $(date +%s) - T0 ))s"
  cp "$WAN_ACCEL_CACHE" "$R/limits.json" 2>/dev/null
  tar -C "$OUT" -rf "$OUT/results.tar" r && rm -rf "$R"
}
trap finish EXIT

# ---- 0. setup: wheels into a target dir (no network), versions, one FA3 call
if [ -d "$REPO/.gpu/wheels" ]; then
  $PY -m pip install -q --no-index --no-deps --target "$W/site" "$REPO"/.gpu/wheels/*.whl > "$R/pip.log" 2>&1 || log "pip failed"
fi
if [ -f "$REPO/.gpu/comfyui/comfyui-carry.tar.xz" ]; then
  eval "$($PY "$REPO/tools/unpack_comfyui.py" --dest "$W/comfy" 2> "$R/comfy_unpack.log")" || log "comfy unpack failed"
fi
stage env 60 $PY - <<'PY'
import json, torch, platform
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
try:
    import triton; info["triton"] = triton.__version__
except Exception as e: info["triton"] = repr(e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count, mem_gb=round(p.total_memory/2**30, 1))
try:
    import fa3_fwd_interface as f
    info["fa3_fwd"] = "imports"
    if torch.cuda.is_available():
        q = torch.randn(1, 4680, 12, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 32760, 12, 128, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            o = f.flash_attn_func(q, k, k)
            o = o[0] if isinstance(o, tuple) else o
            ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1,2), k.transpose(1,2), k.transpose(1,2)).transpose(1,2)
            info["fa3_max_abs_vs_sdpa"] = float((o.float()-ref.float()).abs().max())
            o2 = f.flash_attn_func(q, k, k, num_splits=2)
            o2 = o2[0] if isinstance(o2, tuple) else o2
            info["fa3_split2_max_abs_vs_sdpa"] = float((o2.float()-ref.float()).abs().max())
            # the append-and-attend: the last 4680 keys written into the cache inside the kernel
            kc, vc = k.clone(), k.clone(); kc[:, -4680:] = 0; vc[:, -4680:] = 0
            lens = torch.full((1,), 32760 - 4680, dtype=torch.int32, device="cuda")
            o3 = f.flash_attn_with_kvcache(q, kc, vc, k=k[:, -4680:], v=k[:, -4680:], cache_seqlens=lens, num_splits=1)
            o3 = o3[0] if isinstance(o3, tuple) else o3
            info["fa3_kvcache_max_abs_vs_sdpa"] = float((o3.float()-ref.float()).abs().max())
            info["fa3_kvcache_wrote_cache"] = bool(torch.equal(kc, k))
            from wan_accel.kernels import fa3_fp8
            from wan_accel.model import attention as att
            o4 = att.fa3_fp8_attention(q, fa3_fp8.quantize_kv(k, k))
            info["fa3_fp8_max_abs_vs_sdpa"] = float((o4.float()-ref.float()).abs().max())
            info["fa3_fp8_mean_abs_vs_sdpa"] = float((o4.float()-ref.float()).abs().mean())
except Exception as e:
    info["fa3_fwd"] = f"{type(e).__name__}: {e}"
try:
    import comfy.sd; info["comfyui"] = "imports"
except Exception as e:
    info["comfyui"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
PY
cat "$R/env.json" >> "$SUM"

PART="${PART:-1}"
if [ "$TRIAL" = 1 ]; then S13=tiny; ATT="--lq 64 --lk 128"; S14=tiny; CAPX=""; else S13=1.3b; ATT="--shape 1.3b"; S14=krea; CAPX=1; fi
if [ "$PART" = 1 ]; then
# ---- 1. attention at the 1.3B's calls: every exact candidate (fa3, its splits, cuDNN, ...) and fa3_fp8
stage att_largest 60 $PY -m wan_accel bench attention $ATT --json
if [ "$TRIAL" = 1 ]; then stage att_all 40 $PY -m wan_accel bench attention --shape tiny --calls all --json
else stage att_all 70 $PY -m wan_accel bench attention --shape 1.3b --calls all --approximate none --no-ceiling --json; fi
# ---- 2. the pack's own path, exact, with FA3 in the store; tiny decoder for the first frames
stage sampler13 110 $PY -m wan_accel bench sampler --shape $S13 --variants optimized --decode tiny --repeat 2 --json
# ---- 2b. the fp8 attention mode (FA3's e4m3 kernels where fa3-fwd imports) beside exact, same run
stage sampler13_fp8 120 $PY -m wan_accel bench sampler --shape $S13 --variants optimized,optimized-fp8att --repeat 2 --json
# ---- 3. the user's path: ComfyUI's MODEL, core's SamplerARVideo beside the pack's AR sampler
( cd "${COMFYUI_DIR:-$REPO}" && stage native ${NATIVE_LIMIT:-150} $PY -m wan_accel bench native --shape $S13 --weights bf16,fp8_scaled,bf16+lora --repeat 2 --json )
fi
if [ "$PART" = 2 ]; then
# ---- 4. a smaller card, and Krea 14B (fp8 weights at a 24 GB cap; bf16 uncapped)
if [ -n "$CAPX" ]; then
stage cap8 75 $PY -m wan_accel bench sampler --shape 1.3b --variants optimized --repeat 1 --memory-cap-gb 8 --json
stage krea_fp8_cap24 130 $PY -m wan_accel bench sampler --shape krea --weights fp8 --variants optimized --repeat 1 --memory-cap-gb 24 --json
stage krea_bf16 130 $PY -m wan_accel bench sampler --shape krea --variants optimized --repeat 1 --json
else
stage tiny_fp8 60 $PY -m wan_accel bench sampler --shape tiny --weights fp8 --variants optimized --repeat 1 --no-parity --json
fi
fi
