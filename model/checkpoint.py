"""State-dict key names: wrapper prefixes and the diffusers-format -> official Wan mapping."""
from __future__ import annotations

import re

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")

# diffusers WanTransformer3DModel names -> official names. Note diffusers' affine norm2 is the
# official cross-attention norm3.
_B = r"blocks\.(\d+)\."
_DIFFUSERS_RULES = [
    (r"condition_embedder\.time_embedder\.linear_1\.(.+)", r"time_embedding.0.\1"),
    (r"condition_embedder\.time_embedder\.linear_2\.(.+)", r"time_embedding.2.\1"),
    (r"condition_embedder\.text_embedder\.linear_1\.(.+)", r"text_embedding.0.\1"),
    (r"condition_embedder\.text_embedder\.linear_2\.(.+)", r"text_embedding.2.\1"),
    (r"condition_embedder\.time_proj\.(.+)", r"time_projection.1.\1"),
    (r"condition_embedder\.image_embedder\.norm1\.(.+)", r"img_emb.proj.0.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.0\.proj\.(.+)", r"img_emb.proj.1.\1"),
    (r"condition_embedder\.image_embedder\.ff\.net\.2\.(.+)", r"img_emb.proj.3.\1"),
    (r"condition_embedder\.image_embedder\.norm2\.(.+)", r"img_emb.proj.4.\1"),
    (r"scale_shift_table", r"head.modulation"),
    (r"proj_out\.(.+)", r"head.head.\1"),
    (_B + r"scale_shift_table", r"blocks.\1.modulation"),
    (_B + r"attn1\.to_q\.(.+)", r"blocks.\1.self_attn.q.\2"),
    (_B + r"attn1\.to_k\.(.+)", r"blocks.\1.self_attn.k.\2"),
    (_B + r"attn1\.to_v\.(.+)", r"blocks.\1.self_attn.v.\2"),
    (_B + r"attn1\.to_out\.0\.(.+)", r"blocks.\1.self_attn.o.\2"),
    (_B + r"attn1\.norm_([qk])\.(.+)", r"blocks.\1.self_attn.norm_\2.\3"),
    (_B + r"attn2\.to_q\.(.+)", r"blocks.\1.cross_attn.q.\2"),
    (_B + r"attn2\.to_k\.(.+)", r"blocks.\1.cross_attn.k.\2"),
    (_B + r"attn2\.to_v\.(.+)", r"blocks.\1.cross_attn.v.\2"),
    (_B + r"attn2\.to_out\.0\.(.+)", r"blocks.\1.cross_attn.o.\2"),
    (_B + r"attn2\.norm_([qk])\.(.+)", r"blocks.\1.cross_attn.norm_\2.\3"),
    (_B + r"attn2\.add_k_proj\.(.+)", r"blocks.\1.cross_attn.k_img.\2"),
    (_B + r"attn2\.add_v_proj\.(.+)", r"blocks.\1.cross_attn.v_img.\2"),
    (_B + r"attn2\.norm_added_k\.(.+)", r"blocks.\1.cross_attn.norm_k_img.\2"),
    (_B + r"ffn\.net\.0\.proj\.(.+)", r"blocks.\1.ffn.0.\2"),
    (_B + r"ffn\.net\.2\.(.+)", r"blocks.\1.ffn.2.\2"),
    (_B + r"norm2\.(.+)", r"blocks.\1.norm3.\2"),
]
_DIFFUSERS_RULES = [(re.compile(p), r) for p, r in _DIFFUSERS_RULES]
_DIFFUSERS_MARKERS = ("condition_embedder.", ".attn1.", ".attn2.", "proj_out.", "scale_shift_table")


def strip_prefix(name: str) -> str:
    for p in PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def is_diffusers(names) -> bool:
    return any(m in n for n in names for m in _DIFFUSERS_MARKERS)


def diffusers_to_official(name: str) -> str:
    """Official name of a diffusers-format key; unknown names are returned unchanged."""
    for pattern, repl in _DIFFUSERS_RULES:
        if pattern.fullmatch(name):
            return pattern.sub(repl, name)
    return name


def canonical_names(names) -> dict:
    """{official name: name in the file}. Strips wrapper prefixes and maps diffusers-format names."""
    stripped = {strip_prefix(n): n for n in names}
    if is_diffusers(stripped):
        mapped = {diffusers_to_official(n): src for n, src in stripped.items()}
    else:
        mapped = stripped
    if len(mapped) != len(stripped):
        raise ValueError("checkpoint has keys that collide after removing prefixes / renaming; "
                         "it mixes two key formats")
    return mapped
