"""The options of the benches whose modules import torch (sampler, attention, play, fidelity, kernels, offload,
native, and sampler's ``--world-size`` route), with the tables they name, defined here without torch or any heavy
import.

``python -m wan_accel bench WHAT --help`` and a usage error of those options then answer at once (cli/bench.py
builds the parser from here and imports the bench module only to run it). Each bench module takes its
``add_arguments`` and its tables from this module (tests/test_cli_help.py checks both: they are these objects).
"""
from __future__ import annotations

from ..app.validate import dtype_arg


def dtype_option(parser, help: str, default: str | None = None) -> None:
    """``--dtype`` as every bench takes it: bf16/fp16/fp32 (the nodes' spelling; bfloat16/float16/float32 with a
    note)."""
    parser.add_argument("--dtype", type=dtype_arg("--dtype"), metavar="{bf16,fp16,fp32}", default=default, help=help)


# ----------------------------------------------------------------------------- bench sampler
# variant name -> how it runs (bench/sampler.py)
VARIANTS = {
    "reference": {"path": "reference", "dtype": "fp32", "precision": "float32", "attention": "sdpa",
                  "skip_last_refresh": False},
    "reference-same-dtype": {"path": "reference", "dtype": None, "precision": "self_forcing", "attention": "auto",
                             "skip_last_refresh": False},
    "optimized": {"path": "optimized", "dtype": None, "precision": "self_forcing", "attention": "auto",
                  "skip_last_refresh": True, "options": {}},
    "optimized-no-graphs": {"path": "optimized", "dtype": None, "precision": "self_forcing", "attention": "auto",
                            "skip_last_refresh": True, "options": {"cuda_graphs": "off"}},
    "optimized-compiled": {"path": "optimized", "dtype": None, "precision": "self_forcing", "attention": "auto",
                           "skip_last_refresh": True, "options": {}, "compile": {"backend": "inductor"}},
}
OPS_MODES = ("pack", "kitchen", "torch")     # FastOptions.ops besides 'auto': 'optimized-ops-<mode>'
OPS = "-ops-"
VARIANTS.update({f"optimized{OPS}{mode}": dict(VARIANTS["optimized"], options={"ops": mode}) for mode in OPS_MODES})
INT8 = "-int8"   # every variant's twin with int8 attention (opt-in): '<variant>-int8'
FP8ATT = "-fp8att"   # ... with fp8 attention (opt-in): '<variant>-fp8att' ('-fp8' is fp8 linear's)
ATTENTION_TWINS = {"int8": INT8, "fp8": FP8ATT}
VARIANTS.update({name + suffix: dict(v, attention=mode) for name, v in list(VARIANTS.items())
                 for mode, suffix in ATTENTION_TWINS.items()})
FP8 = "-fp8"     # every optimized variant's twin with fp8 linear layers (opt-in): '<variant>-fp8'
VARIANTS.update({name + FP8: dict(v, options=dict(v["options"], linear="fp8")) for name, v in list(VARIANTS.items())
                 if v["path"] == "optimized"})
TWINS = (INT8, FP8ATT, FP8)     # an approximate twin's name ends with one of these; without it, its exact twin's
SAMPLER_SHAPES = {  # model kind -> shape -> (video frames, height, width)
    # 14b: Wan 2.1 14B (dim 5120, 40 layers) on the Self-Forcing 4-step schedule; krea: Krea Realtime 14B (the
    # 14B with Krea's schedule and per-block KV recompute, window 6); longlive: the 1.3B with LongLive's schedule,
    # window 12 and 3 sink frames (bench/sampler.py SHAPE_MODELS)
    "wan": {"tiny": (33, 128, 128), "1.3b": (81, 480, 832), "14b": (81, 480, 832), "krea": (81, 480, 832),
            "longlive": (81, 480, 832)},
    "matrix-game2": {"tiny": (33, 128, 128), "1.3b": (57, 352, 640)},
}
SAMPLER_WEIGHTS = ("bf16", "fp8")   # bench sampler --weights: the run dtype, or block linears stored as e4m3
DECODES = ("none", "wan", "tiny")    # bench sampler --decode (bench/decode.py)


def sampler(parser) -> None:
    """``bench sampler``'s options."""
    parser.add_argument("--shape", choices=list(SAMPLER_SHAPES["wan"]), help="random-weight model (default tiny): "
                        "tiny, 1.3b (Wan 2.1 1.3B, Self-Forcing), 14b (Wan 2.1 14B, Self-Forcing schedule), krea "
                        "(Krea Realtime 14B: its schedule, per-block KV recompute, window 6), longlive (the 1.3B with "
                        "LongLive's schedule, window 12, 3 sink frames); the 14B shapes are drawn on the device in the "
                        "run dtype (no float32 copy: no 'reference' variant, no parity run). Not with --checkpoint")
    parser.add_argument("--weights", choices=list(SAMPLER_WEIGHTS), default="bf16", help="bf16 (default): weights "
                        "in the run dtype; fp8: every block linear weight stored as float8 e4m3 with one scale per "
                        "tensor, as a scaled fp8 checkpoint holds it (the pack's FP8Linear; a 14B's weights in ~15 GB)")
    parser.add_argument("--memory-cap-gb", type=float, help="make the CUDA device behave like a card of N GiB: the "
                        "caching allocator is capped (per-process memory fraction) before anything is allocated and "
                        "the VRAM plan plans for N GiB (WAN_ACCEL_VRAM_CAP_GB): block swap, KV window, as it says. "
                        "The rows give the plan, its reasons, and 'out of memory' where a run ran out. CUDA only")
    parser.add_argument("--model-kind", default="wan", choices=list(SAMPLER_SHAPES),
                        help="wan (default) or matrix-game2")
    parser.add_argument("--checkpoint", help=".safetensors DiT instead of random weights")
    parser.add_argument("--frames", type=int, help="video frames (default: the shape's)")
    parser.add_argument("--height", type=int, help="pixels (default: the shape's)")
    parser.add_argument("--width", type=int, help="pixels (default: the shape's)")
    parser.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    dtype_option(parser, "run dtype (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per variant after one warm-up")
    parser.add_argument("--variants", help="comma list of: " + ", ".join(VARIANTS) +
                        " (default: reference, optimized; plus reference-same-dtype when the run dtype is not fp32)")
    parser.add_argument("--attention", choices=list(ATTENTION_TWINS), help="int8 / fp8: also run every chosen "
                        "variant with int8 attention ('<variant>-int8') or fp8 attention ('<variant>-fp8att'), each "
                        "row beside its exact twin (vs_exact_max_abs / mean)")
    parser.add_argument("--linear", choices=["fp8"], help="fp8: also run every chosen optimized variant with fp8 "
                        "linear layers ('<variant>-fp8'), each row beside its exact twin (vs_exact_max_abs / mean)")
    parser.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s for MFU (default: table by capability)")
    parser.add_argument("--decode", default="none", choices=list(DECODES), help="decode every chunk to pixels as "
                        "soon as it is made and report decode time, video FPS including decode and time to the first "
                        "decoded frame: wan (the Wan 2.1 VAE), tiny (a TAEHV-class taew2_1 decoder), none (default)")
    parser.add_argument("--vae", help=".safetensors weights of the --decode decoder (wan_2.1_vae.safetensors or "
                        "taew2_1.safetensors); default: seeded random weights of the released architecture (a narrow "
                        "one at the tiny random-model shape)")
    parser.add_argument("--no-parity", action="store_true", help="skip the untimed float32 reference run that the "
                        "parity columns need (they are then n/a) unless 'reference' is one of the variants: a quicker "
                        "run where only speed is asked")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and the inputs (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout instead of a table (progress "
                        "goes to stderr either way)")


def parallel(parser) -> None:
    """``bench sampler --world-size N``'s options: bench sampler's and the world's (bench/parallel.py)."""
    sampler(parser)
    parser.add_argument("--world-size", type=int, default=1, help="sequence-parallel ranks to compare with one "
                        "process (the first N GPUs, else N CPU processes on gloo)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the whole parallel run may take")


# ----------------------------------------------------------------------------- bench attention
# run -> (tokens per latent frame, latent frames, frames per chunk, heads, head dim, text tokens)
ATTENTION_SHAPES = {"1.3b": (1560, 21, 3, 12, 128, 512), "14b": (1560, 21, 3, 40, 128, 512),
                    "tiny": (96, 6, 3, 2, 16, 16)}
APPROXIMATE = ("int8", "fp8", "fa3_fp8")   # opt-in approximate attention modes: int8, fp8 with the pack's kernel,
#                                          fp8 with FA3's e4m3 kernels (what the fp8 mode runs where FA3 runs)


def attention(parser) -> None:
    """``bench attention``'s options."""
    parser.add_argument("--shape", choices=list(ATTENTION_SHAPES), help="the run whose calls are timed (default: "
                        "1.3b on CUDA, tiny on a CPU)")
    parser.add_argument("--calls", choices=["largest", "all"], help="largest (default): the run's largest "
                        "self-attention call; all: the largest call of every length bucket (cross-attention too); "
                        "not with --lq/--lk")
    parser.add_argument("--lq", type=int, help="query length of one call to time instead of a run's (with --lk)")
    parser.add_argument("--lk", type=int, help="key length of that call (with --lq)")
    parser.add_argument("--batch", type=int, default=1, help="batch (default 1)")
    parser.add_argument("--device", help="cuda / cpu (default: cuda if available)")
    dtype_option(parser, "default bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--approximate", default="int8,fp8,fa3_fp8", help="comma list of opt-in approximate modes to time too "
                        f"({', '.join(APPROXIMATE)}), or 'none'")
    parser.add_argument("--no-ceiling", action="store_true", help="skip measuring the GPU's matmul ceiling")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random q, k, v (default 0)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout instead of a table (progress "
                        "goes to stderr either way)")


# ----------------------------------------------------------------------------- bench play
PLAY_SIZES = {"tiny": (64, 64), "released": (640, 352)}      # model -> (width, height) in pixels


def play(parser) -> None:
    """``bench play``'s options."""
    parser.add_argument("--model", choices=tuple(PLAY_SIZES), default="tiny",
                        help="tiny (default) or released (the 1.3B shape, random weights; CUDA only)")
    parser.add_argument("--checkpoint", default=None, help="a Matrix-Game-2 checkpoint (.safetensors) instead")
    parser.add_argument("--width", type=int, default=None, help="video width in pixels (tiny 64, released 640)")
    parser.add_argument("--height", type=int, default=None, help="video height in pixels (tiny 64, released 352)")
    parser.add_argument("--chunks", type=int, default=6, help="timed chunks per mode (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed chunks first (3 fill the 6-frame window)")
    dtype_option(parser, "weights and math on CUDA (default bf16; a CPU runs fp32 and refuses another --dtype)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ----------------------------------------------------------------------------- bench fidelity
def fidelity(parser) -> None:
    """``bench fidelity``'s options."""
    parser.add_argument("--fixture", action="append", help="fixture folder (repeatable; default: the pack's "
                        "wan_reference and matrix_game2)")
    parser.add_argument("--attention", help="attention compared with exact SDPA (default: int8, or sdpa with "
                        "--linear fp8)")
    parser.add_argument("--linear", default="exact", choices=["exact", "fp8"],
                        help="fp8: compare fp8 linear layers with exact ones (the optimized path)")
    parser.add_argument("--fp8-numerics", default="here", choices=["here", "fa3", "pack"],
                        help="with --attention fp8, whose fp8 math runs: here = what this machine runs (FlashAttention "
                             "3's e4m3 kernels on a Hopper GPU with FA3, else the pack's); fa3 = FlashAttention 3's "
                             "(its kernels where they run, else the same math in torch); pack = the pack's own")
    parser.add_argument("--device", help="cuda / cpu (default: cpu: float32 on the fixtures)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout instead of a table")


# ----------------------------------------------------------------------------- bench kernels
def kernels(parser) -> None:
    """``bench kernels``' options."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    dtype_option(parser, "dtype of the timed kernels on a CUDA GPU (default bf16; without one, the sanity pass runs "
                 "float32)", default="bf16")
    parser.add_argument("--frames", type=int, default=3, help="frames per chunk (per-frame modulation F)")


# ----------------------------------------------------------------------------- bench offload
OFFLOAD_SHAPES = {"1.3b": (1536, 8960, 12, 30), "14b": (5120, 13824, 40, 40)}   # model -> (dim, ffn, heads, blocks)


def offload(p) -> None:
    """``bench offload``'s options (bench/memory.py)."""
    p.add_argument("--model", choices=tuple(OFFLOAD_SHAPES), default="1.3b", help="block shape (default 1.3b)")
    p.add_argument("--width", type=int, default=832, help="video width in pixels (default 832)")
    p.add_argument("--height", type=int, default=480, help="video height in pixels (default 480)")
    p.add_argument("--frames-per-block", type=int, default=3, help="latent frames per forward (causal chunk)")
    p.add_argument("--kv-frames", type=int, default=3,
                   help="latent frames of keys per self-attention (3: first chunk; 21: last chunk of 81 frames)")
    p.add_argument("--blocks", type=int, default=None, help="blocks in the stack (default: the model's)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per setting (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards first")
    p.add_argument("--json", action="store_true", help="print JSON")


# ----------------------------------------------------------------------------- bench native
COMFYUI_ENV = "COMFYUI_DIR"        # bench native: the environment variable naming ComfyUI's folder
NATIVE_WEIGHTS = ("bf16", "fp8_scaled", "fp8_scaled_legacy")
LORA = "+lora"         # bench native: the suffix of a weights variant with one random LoRA applied
# shape -> (config kwargs over WanConfig's defaults, or a preset name; latent frames, latent height, width; text
# tokens of the random prompt embedding: the text length, as ComfyUI's UMT5 tokenizer pads every prompt to 512 at
# least; with fewer, core attends to the given tokens alone where the pack zero-pads them to text_len, as the
# official Wan code does, and the two differ by design)
NATIVE_SHAPES = {
    "tiny": (dict(dim=64, ffn_dim=128, freq_dim=32, text_dim=48, text_len=16, num_heads=4, num_layers=2), 6, 8, 12,
             16),
    "mid": (dict(dim=512, ffn_dim=2048, num_heads=4, num_layers=8), 21, 16, 16, 512),    # minutes on a CPU
    "1.3b": ("WAN_1_3B", 21, 60, 104, 512),       # 480x832, 81 frames; dim 1536, 30 layers, 12 heads, ffn 8960
}


def native(p) -> None:
    """``bench native``'s options (bench/native.py)."""
    p.add_argument("--shape", choices=sorted(NATIVE_SHAPES), default="tiny",
                   help="tiny (CPU tests), mid (dim 512, 8 layers, 21 latent frames of 16x16) or 1.3b (Wan 2.1 "
                   "1.3B: 480x832, 21 latent frames)")
    p.add_argument("--weights", default="bf16",
                   help="comma-separated weights variants: " + ", ".join(NATIVE_WEIGHTS)
                   + f", each optionally with '{LORA}' (one random LoRA applied), e.g. bf16,fp8_scaled,bf16{LORA}")
    p.add_argument("--repeat", type=int, default=3, help="timed videos per sampler, after one warm-up")
    p.add_argument("--path", choices=("auto", "optimized", "reference"), default="auto",
                   help="the pack's sampler path, for the native and own runs alike (auto: optimized on CUDA)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, prompt and noise")
    p.add_argument("--lora-rank", type=int, default=None, help="rank of the random LoRA (default 16; only with a "
                   f"'{LORA}' variant in --weights)")
    p.add_argument("--lora-strength", type=float, default=None, help="strength the LoRA is applied at (default 1.0; "
                   f"only with a '{LORA}' variant in --weights)")
    p.add_argument("--comfyui", default=None, metavar="DIR",
                   help=f"ComfyUI's folder, put on sys.path (default: ${COMFYUI_ENV}, else the current folder)")
    p.add_argument("--workdir", default=None, help="folder for the checkpoint files (default: a temporary one, "
                   "removed at the end)")
    p.add_argument("--no-profile", action="store_true", help="skip the dispatch-count runs")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


# bench module (its last name) -> its options, for cli/bench.py; a bench not named here defines add_arguments in
# a module that imports nothing heavy (compile: checked by tests/test_cli_help.py)
ARGUMENTS = {"sampler": sampler, "parallel": parallel, "attention": attention, "play": play, "fidelity": fidelity,
             "kernels": kernels, "memory": offload, "native": native}
