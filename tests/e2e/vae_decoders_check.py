"""Run with ComfyUI's python inside its work tree (tests/e2e/test_vae_decoders_comfy.py does):

    python vae_decoders_check.py OUT_DIR  -> OUT_DIR/wan.safetensors, OUT_DIR/tiny.safetensors (random weights, the
                                             state dicts of ComfyUI's own classes) and OUT_DIR/cases.safetensors
                                             (raw latents and ComfyUI's decodes of them); JSON summary on stdout

The Wan 2.1 VAE is ComfyUI's ``comfy.ldm.wan.vae.WanVAE`` at a small base width (8), the tiny decoder ComfyUI's
``comfy.taesd.taehv.TAEHV`` for 16 latent channels (taew2_1's layout, full width: it is small), both float32 on the
CPU. Their decodes are what the pack's decoders must reproduce from the saved weights, by key name.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

WAN_DIM = 8
ROOT = Path(__file__).resolve().parents[2]          # the checkout: the pack's package folder


def load_pack():
    """The pack of this checkout imported as ``wan_accel`` (it need not be installed in ComfyUI's environment)."""
    if "wan_accel" not in sys.modules:
        spec = importlib.util.spec_from_file_location("wan_accel", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["wan_accel"] = pkg
        spec.loader.exec_module(pkg)
    return sys.modules["wan_accel"]


def fill(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """ComfyUI's layers leave their weights uninitialised: the pack's seeded random weights (vae/weights.py)."""
    load_pack()
    from wan_accel.vae.weights import init_random

    return init_random(model, seed).eval()


def main(out: Path) -> dict:
    from comfy.ldm.wan.vae import WanVAE
    from comfy.taesd.taehv import TAEHV
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    wan = fill(WanVAE(dim=WAN_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True]), 0)
    tiny = fill(TAEHV(latent_channels=16), 1)
    save_file({k: v.contiguous() for k, v in wan.state_dict().items()}, str(out / "wan.safetensors"))
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(out / "tiny.safetensors"))
    cases = {}
    with torch.no_grad():
        for frames in (6, 7):               # even: ComfyUI's walk ends on a single frame; odd: on a pair
            z = torch.randn(1, 16, frames, 4, 6, generator=torch.Generator().manual_seed(frames))
            cases[f"wan_{frames}.latent"] = z
            cases[f"wan_{frames}.decoded"] = wan.decode(z)
        z = torch.randn(1, 16, 5, 4, 6, generator=torch.Generator().manual_seed(5)) * 2
        cases["tiny_5.latent"] = z
        tiny.parallel = False
        cases["tiny_5.decoded"] = tiny.decode(z)                    # frame by frame
        tiny.parallel = True
        cases["tiny_5.decoded_parallel"] = tiny.decode(z)           # all frames per layer
    save_file({k: v.contiguous() for k, v in cases.items()}, str(out / "cases.safetensors"))
    return {k: list(v.shape) for k, v in cases.items()} | {"torch": torch.__version__}


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))         # the ComfyUI work tree
    from comfy.cli_args import args
    args.cpu = True                             # as main.py --cpu
    torch.set_num_threads(2)
    print(json.dumps(main(Path(sys.argv[1]))))
