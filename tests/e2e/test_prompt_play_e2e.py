"""Live prompt play in a real ComfyUI and browser: a prompt typed in the panel mid-stream conditions the chunks after
it (the rows the model was given, as the server records them), and the saved prompt schedule through the causal
sampler node with the same seed reproduces the session's latent exactly. Needs COMFYUI_DIR / COMFYUI_VENV (see
test_comfyui_e2e.py) and a browser; skipped otherwise."""
from __future__ import annotations

import pytest

from e2e.test_comfyui_e2e import (COMFY_DIR, COMFY_VENV, _browser_with_prompt, _latent_of, _run_prompt,  # noqa: F401
                                  comfy)

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the live prompt check")

TINY = "(built-in tiny model)"
SIDE, SEED, FIRST = 64, 5, "a cat walks in the garden"
WINDOW = {"frames_per_block": 3, "kv_window": 6, "sink": 3}


def _model_and_vae() -> dict:
    return {"1": {"class_type": "CausalWanModelLoader", "inputs": {"checkpoint": TINY, "dtype": "fp32",
                                                                   "precision": "float32", "attention": "sdpa"}},
            "2": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}}}


def session_prompt() -> dict:
    return dict(_model_and_vae(), **{"3": {"class_type": "CausalWanPromptPlaySession", "inputs": dict(
        model=["1", 0], vae=["2", 0], prompt=FIRST, width=SIDE, height=SIDE, seed=SEED, preset="self_forcing",
        recache="switch", idle_timeout_s=300, state_on="model device", **WINDOW)}})


def schedule_prompt(schedule: str, latent_frames: int, prefix: str) -> dict:
    return dict(_model_and_vae(), **{
        "4": {"class_type": "CausalWanSampler", "inputs": dict(
            model=["1", 0], width=SIDE, height=SIDE, num_frames=4 * (latent_frames - 1) + 1, seed=SEED,
            preset="self_forcing", prompt_schedule=schedule, recache="switch", sampler="reference", **WINDOW)},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": prefix}}})


def test_a_prompt_typed_mid_stream_drives_the_next_chunks_and_the_saved_schedule_reproduces_them(comfy, tmp_path):
    import torch
    from safetensors.torch import load_file
    from wan_accel.app.play.t2v import context_digest
    from wan_accel.model.tiny import TINY_CONFIG, tiny_text_embedding

    report = _browser_with_prompt(comfy, tmp_path, "prompt-play", session_prompt(), timeout_s=240)
    play = report["prompt_play"]
    assert not play["errors"], play["errors"]
    sent, given = play["sent"], play["server"]["chunk_actions"]
    new = play["new_prompt"]
    assert [s["chunk"] for s in sent] == list(range(len(sent))) == [c["chunk"] for c in play["chunks"]]
    assert len(given) == len(sent)
    switch = next(i for i, s in enumerate(sent) if s["prompt"] == new)
    assert switch >= 2 and len(sent) >= switch + 2
    digest = lambda text: context_digest(tiny_text_embedding(text, TINY_CONFIG.text_len, TINY_CONFIG.text_dim))
    for i, row in enumerate(given):                  # the rows each chunk was given: the prompt in effect then
        want = FIRST if i < switch else new
        assert row["prompt"] == want and row["context_sha256"] == digest(want), (i, row)
    assert play["server"]["script"].strip() == f"0: {FIRST}\n{switch}: {new}"
    assert play["ended"]["reason"] == "ended by the user"

    saved = play["saved"]
    folder = comfy["work"] / "output" / saved["subfolder"]
    assert (folder / saved["files"]["video"]).stat().st_size > 1000
    schedule_file = (folder / saved["files"]["script"]).read_text()
    session_latent = load_file(str(folder / saved["files"]["latent"]))["latent_tensor"]
    frames = 3 * len(sent)
    assert session_latent.shape[2] == frames

    replay = _run_prompt(comfy, schedule_prompt(schedule_file, frames, "wan_accel/prompt_replay"), timeout_s=300)
    assert replay["status"]["status_str"] == "success", replay["status"]
    assert torch.equal(_latent_of(comfy, replay), session_latent)    # the saved schedule, same seed: same frames
    plain = _run_prompt(comfy, schedule_prompt(f"0: {FIRST}", frames, "wan_accel/prompt_plain"), timeout_s=300)
    other = _latent_of(comfy, plain)
    cut = 3 * switch
    assert torch.equal(other[:, :, :cut], session_latent[:, :, :cut])          # before the switch: the same
    assert not torch.equal(other[:, :, cut:cut + 3], session_latent[:, :, cut:cut + 3])   # after: it followed


@pytest.mark.parametrize("bad, says", [("0: a cat\n0: a dog", "prompt_schedule"), ("0: a :nan | b", "prompt_schedule")])
def test_bad_schedules_fail_with_the_schedule_message(comfy, bad, says):
    entry = _run_prompt(comfy, schedule_prompt(bad, 6, "wan_accel/bad"), timeout_s=120)
    errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "error" and says in errors[0]["exception_message"], entry["status"]
    assert errors[0]["exception_type"].endswith("ValueError")
