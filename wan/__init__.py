"""Wan 2.1 / causal Wan model library: config, model, loader, scheduler, KV cache, sampler.

Import the submodules directly (``from wan_accel.wan.model import WanModel``); this package
file stays light so that importing the node pack does not pull in torch.
"""
