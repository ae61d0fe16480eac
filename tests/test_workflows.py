"""The example workflows (UI format in workflows/, API format in workflows/api/) against the node definitions.

Checked offline, without ComfyUI: every node type exists (the pack's NODE_CLASS_MAPPINGS, or one of the ComfyUI core
nodes recorded below from ComfyUI 0.33.0's /object_info); widget values match INPUT_TYPES in count, type, range
and choices; every link joins an output and an input of the same type; node ids, link ids and the per-node link
lists agree; required inputs are connected; the API-format copy is exactly what the UI graph converts to.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from wan_accel import NODE_CLASS_MAPPINGS

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / "workflows"
API_DIR = WORKFLOWS / "api"
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
EXPECTED_WORKFLOWS = {"causal_wan_t2v", "native_wan_compile", "low_vram", "profile_run", "tiny_smoke",
                      "native_causal_wan", "native_causal_tiny", "streaming_t2v", "matrix_game2_play"}

FILE_LIST = "FILE_LIST"  # a combo listing model files: its choices depend on the user's models folder
WIDGET_TYPES = {"INT", "FLOAT", "BOOLEAN", "STRING", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
FRONTEND_ONLY = {"Note", "MarkdownNote"}  # drawn by the frontend, never sent to the server
U64 = 18446744073709551615
MODEL_EXT = (".safetensors", ".sft", ".gguf")
IMAGE_EXT = (".png", ".jpg", ".jpeg", ".webp")

_SAMPLERS = ("euler euler_cfg_pp euler_ancestral euler_ancestral_cfg_pp heun heunpp2 exp_heun_2_x0 exp_heun_2_x0_sde "
             "dpm_2 dpm_2_ancestral lms dpm_fast dpm_adaptive dpmpp_2s_ancestral dpmpp_2s_ancestral_cfg_pp dpmpp_sde "
             "dpmpp_sde_gpu dpmpp_2m dpmpp_2m_cfg_pp dpmpp_2m_sde dpmpp_2m_sde_gpu dpmpp_2m_sde_heun "
             "dpmpp_2m_sde_heun_gpu dpmpp_3m_sde dpmpp_3m_sde_gpu ddpm lcm ipndm ipndm_v deis res_multistep "
             "res_multistep_cfg_pp res_multistep_ancestral res_multistep_ancestral_cfg_pp gradient_estimation "
             "gradient_estimation_cfg_pp er_sde seeds_2 seeds_3 sa_solver sa_solver_pece ddim uni_pc uni_pc_bh2").split()
_SCHEDULERS = "simple sgm_uniform karras exponential ddim_uniform beta normal linear_quadratic kl_optimal".split()
_CLIP_TYPES = ("stable_diffusion stable_cascade sd3 stable_audio mochi ltxv pixart cosmos lumina2 wan hidream chroma "
               "ace omnigen2 qwen_image hunyuan_image flux2 ovis longcat_image cogvideox lens pixeldit ideogram4 boogu "
               "krea2 joyimage mage minimax").split()

# ComfyUI 0.33.0 core nodes used by the workflows: inputs in /object_info order (required, then optional), outputs.
CORE_NODES: dict[str, dict] = {
    "CLIPLoader": {"input": {"required": {"clip_name": (FILE_LIST,), "type": (_CLIP_TYPES,)},
                             "optional": {"device": (["default", "cpu"],)}},
                   "output": ("CLIP",)},
    "CLIPTextEncode": {"input": {"required": {"text": ("STRING", {"multiline": True}), "clip": ("CLIP",)}},
                       "output": ("CONDITIONING",)},
    "UNETLoader": {"input": {"required": {"unet_name": (FILE_LIST,),
                                          "weight_dtype": (["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"],)}},
                   "output": ("MODEL",)},
    "VAELoader": {"input": {"required": {"vae_name": (FILE_LIST,)}}, "output": ("VAE",)},
    "KSampler": {"input": {"required": {
        "model": ("MODEL",),
        "seed": ("INT", {"default": 0, "min": 0, "max": U64, "control_after_generate": True}),
        "steps": ("INT", {"default": 20, "min": 1, "max": 10000}),
        "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1}),
        "sampler_name": (_SAMPLERS,), "scheduler": (_SCHEDULERS,),
        "positive": ("CONDITIONING",), "negative": ("CONDITIONING",), "latent_image": ("LATENT",),
        "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01})}},
        "output": ("LATENT",)},
    "EmptyHunyuanLatentVideo": {"input": {"required": {
        "width": ("INT", {"default": 848, "min": 16, "max": 16384, "step": 16}),
        "height": ("INT", {"default": 480, "min": 16, "max": 16384, "step": 16}),
        "length": ("INT", {"default": 25, "min": 1, "max": 16384, "step": 4}),
        "batch_size": ("INT", {"default": 1, "min": 1, "max": 4096})}},
        "output": ("LATENT",)},
    "ModelSamplingSD3": {"input": {"required": {
        "model": ("MODEL",), "shift": ("FLOAT", {"default": 3.0, "min": 0.0, "max": 100.0, "step": 0.01})}},
        "output": ("MODEL",)},
    "VAEDecode": {"input": {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}, "output": ("IMAGE",)},
    "SaveAnimatedWEBP": {"input": {"required": {
        "images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI", "multiline": False}),
        "fps": ("FLOAT", {"default": 6.0, "min": 0.01, "max": 1000.0, "step": 0.01}),
        "lossless": ("BOOLEAN", {"default": True}), "quality": ("INT", {"default": 80, "min": 0, "max": 100}),
        "method": (["default", "fastest", "slowest"],)}},
        "output": ("IMAGE",)},
    "SaveImage": {"input": {"required": {"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})}},
                  "output": ("IMAGE",)},
    "PreviewImage": {"input": {"required": {"images": ("IMAGE",)}}, "output": ("IMAGE",)},
    "PreviewAny": {"input": {"required": {"source": ("*",)}}, "output": ("STRING",)},
    "LoadImage": {"input": {"required": {"image": (FILE_LIST, {"image_upload": True, "ext": IMAGE_EXT})}},
                  "output": ("IMAGE", "MASK")},
    "ImageScale": {"input": {"required": {
        "image": ("IMAGE",), "upscale_method": (["nearest-exact", "bilinear", "area", "bicubic", "lanczos"],),
        "width": ("INT", {"default": 512, "min": 0, "max": 16384, "step": 1}),
        "height": ("INT", {"default": 512, "min": 0, "max": 16384, "step": 1}),
        "crop": (["disabled", "center"],)}},
        "output": ("IMAGE",)},
    "VAEEncode": {"input": {"required": {"pixels": ("IMAGE",), "vae": ("VAE",)}}, "output": ("LATENT",)},
    "CLIPVisionLoader": {"input": {"required": {"clip_name": (FILE_LIST,)}}, "output": ("CLIP_VISION",)},
    "CLIPVisionEncode": {"input": {"required": {"clip_vision": ("CLIP_VISION",), "image": ("IMAGE",),
                                                "crop": (["center", "none"],)}},
                         "output": ("CLIP_VISION_OUTPUT",)},
    "LoraLoaderModelOnly": {"input": {"required": {
        "model": ("MODEL",), "lora_name": (FILE_LIST,),
        "strength_model": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01})}},
        "output": ("MODEL",)},
    "RandomNoise": {"input": {"required": {
        "noise_seed": ("INT", {"default": 0, "min": 0, "max": U64, "control_after_generate": True})}},
        "output": ("NOISE",)},
    "BasicGuider": {"input": {"required": {"model": ("MODEL",), "conditioning": ("CONDITIONING",)}},
                    "output": ("GUIDER",)},
    "SamplerCustomAdvanced": {"input": {"required": {
        "noise": ("NOISE",), "guider": ("GUIDER",), "sampler": ("SAMPLER",), "sigmas": ("SIGMAS",),
        "latent_image": ("LATENT",)}},
        "output": ("LATENT", "LATENT")},
    "EmptyARVideoLatent": {"input": {"required": {
        "width": ("INT", {"default": 832, "min": 16, "max": 8192, "step": 16}),
        "height": ("INT", {"default": 480, "min": 16, "max": 8192, "step": 16}),
        "length": ("INT", {"default": 81, "min": 1, "max": 1024, "step": 4}),
        "batch_size": ("INT", {"default": 1, "min": 1, "max": 64})}},
        "output": ("LATENT",)},
}

# Pack inputs that list model files inside ComfyUI (a STRING outside it): a model file name or one of these.
PACK_FILE_INPUTS = {
    ("CausalWanModelLoader", "checkpoint"): ["(built-in tiny model)"],
    ("WanAccelVRAMPlan", "checkpoint"): ["none"],
    ("CausalWanModelLoader", "lora"): ["(none)"],
}


# ------------------------------------------------------------------------------------------ node specs
def node_spec(node_type: str) -> dict:
    """{"inputs": [(name, type, opts, required)], "output": tuple} for a pack or recorded core node."""
    if node_type in NODE_CLASS_MAPPINGS:
        cls = NODE_CLASS_MAPPINGS[node_type]
        spec, outputs = cls.INPUT_TYPES(), tuple(cls.RETURN_TYPES)
    elif node_type in CORE_NODES:
        spec, outputs = CORE_NODES[node_type]["input"], CORE_NODES[node_type]["output"]
    else:
        raise KeyError(f"unknown node type {node_type!r}: not in the pack and not a recorded ComfyUI core node")
    inputs = []
    for section in ("required", "optional"):
        for name, decl in spec.get(section, {}).items():
            kind = decl[0]
            opts = dict(decl[1]) if len(decl) > 1 and isinstance(decl[1], dict) else {}
            if kind == "COMBO":  # the V3 way of writing a combo: ("COMBO", {"options": [...]})
                kind = list(opts.get("options", []))
            if (node_type, name) in PACK_FILE_INPUTS:
                kind, opts = FILE_LIST, dict(opts, also=PACK_FILE_INPUTS[(node_type, name)])
            inputs.append((name, kind, opts, section == "required"))
    return {"inputs": inputs, "output": outputs}


def is_widget(kind, opts) -> bool:
    if opts.get("forceInput"):
        return False
    return isinstance(kind, (list, tuple)) or kind == FILE_LIST or kind in WIDGET_TYPES


def has_control_widget(name, kind, opts) -> bool:
    """The frontend adds a 'control after generate' value after this widget (serialised in widgets_values)."""
    if kind == "INT":
        flag = opts.get("control_after_generate")
        return bool(flag) if flag is not None else name in ("seed", "noise_seed")
    return bool(opts.get("control_after_generate"))


def widget_layout(spec: dict) -> list[tuple]:
    """(input name or None for a control value, kind, opts) for every value in widgets_values, in order."""
    layout = []
    for name, kind, opts, _ in spec["inputs"]:
        if is_widget(kind, opts):
            layout.append((name, kind, opts))
            if has_control_widget(name, kind, opts):
                layout.append((None, "CONTROL", {}))
            if opts.get("image_upload"):  # the frontend's upload button: a widget whose value is "image"
                layout.append(("upload", "UPLOAD", {}))
    return layout


def value_problem(kind, opts, value) -> str | None:
    """Why ``value`` is not valid for this widget, or None."""
    if kind == "CONTROL":
        return None if value in CONTROL_VALUES else f"{value!r} is not one of {sorted(CONTROL_VALUES)}"
    if kind == "UPLOAD":
        return None if value == "image" else f"{value!r} is not 'image'"
    if kind == FILE_LIST:
        ok = isinstance(value, str) and (value in opts.get("also", ()) or value.endswith(opts.get("ext", MODEL_EXT)))
        return None if ok else f"{value!r} is not a file name ({', '.join(opts.get('ext', MODEL_EXT))})"
    if isinstance(kind, (list, tuple)):
        return None if value in kind else f"{value!r} is not one of {list(kind)}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if kind in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{value!r} is not a number"
        if kind == "INT" and not isinstance(value, int):
            return f"{value!r} is not an integer"
        lo, hi = opts.get("min"), opts.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return f"{value!r} is outside [{lo}, {hi}]"
        return None
    return f"no widget for type {kind!r}"


def types_match(out_type: str, in_type) -> bool:
    if isinstance(in_type, (list, tuple)) or in_type == FILE_LIST:  # a widget turned into an input
        return out_type in ("STRING", "COMBO", "*")
    if "*" in (out_type, in_type):
        return True
    return bool(set(out_type.split(",")) & set(str(in_type).split(",")))


# ------------------------------------------------------------------------------------------ UI -> API
def ui_to_api(ui: dict) -> dict:
    """The API-format prompt of a UI-format graph, as the frontend builds it (active nodes, widgets by name,
    links as [origin id, origin slot]; frontend-only nodes and control values left out)."""
    links = {link[0]: link for link in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node["type"] in FRONTEND_ONLY or node.get("mode", 0) != 0:
            continue
        spec = node_spec(node["type"])
        inputs = {}
        values = node.get("widgets_values", [])
        for (name, kind, _), value in zip(widget_layout(spec), values):
            if name is not None and kind != "UPLOAD":
                inputs[name] = value
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs,
                                   "_meta": {"title": node.get("title") or node["type"]}}
    return prompt


# ------------------------------------------------------------------------------------------ tests
def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_expected_workflows_exist():
    names = {p.stem for p in UI_FILES}
    assert EXPECTED_WORKFLOWS <= names, f"missing workflows: {sorted(EXPECTED_WORKFLOWS - names)}"
    assert {p.stem for p in API_DIR.glob("*.json")} == names, "every UI workflow needs an API copy and vice versa"


@pytest.fixture(params=UI_FILES, ids=[p.stem for p in UI_FILES])
def workflow(request) -> tuple[str, dict]:
    return request.param.stem, _load(request.param)


def test_node_types_are_known(workflow):
    name, ui = workflow
    for node in ui["nodes"]:
        t = node["type"]
        assert t in NODE_CLASS_MAPPINGS or t in CORE_NODES or t in FRONTEND_ONLY, f"{name}: node {node['id']} has unknown type {t!r}"


TITLE_HEIGHT = 30  # the frontend's title bar, drawn above a node's pos


def file_overlaps(ui: dict) -> list:
    """Pairs of node ids whose boxes as the file asks for them (title bar included) overlap."""
    boxes = [(n["id"], n["pos"][0], n["pos"][1] - TITLE_HEIGHT, n["size"][0], n["size"][1] + TITLE_HEIGHT)
             for n in ui["nodes"]]
    return [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if min(a[1] + a[3], b[1] + b[3]) > max(a[1], b[1]) and min(a[2] + a[4], b[2] + b[4]) > max(a[2], b[2])]


def test_nodes_keep_apart_in_the_file(workflow):
    """The offline half of the layout check: no node asks for a place over another (or over its note). The browser
    check (tests/e2e) measures the boxes each renderer draws, which can be larger (Nodes 2.0)."""
    name, ui = workflow
    assert file_overlaps(ui) == [], f"{name}: nodes placed over each other"
    moved = json.loads(json.dumps(ui))
    moved["nodes"][1]["pos"] = list(moved["nodes"][0]["pos"])     # the checker itself sees a node put on another
    assert file_overlaps(moved)

def test_ids_and_links_are_consistent(workflow):
    name, ui = workflow
    ids = [n["id"] for n in ui["nodes"]]
    assert len(ids) == len(set(ids)), f"{name}: duplicate node ids"
    assert ui["last_node_id"] >= max(ids), f"{name}: last_node_id below a node id"
    link_ids = [link[0] for link in ui["links"]]
    assert len(link_ids) == len(set(link_ids)), f"{name}: duplicate link ids"
    assert not link_ids or ui["last_link_id"] >= max(link_ids), f"{name}: last_link_id below a link id"
    nodes = {n["id"]: n for n in ui["nodes"]}
    for lid, src, src_slot, dst, dst_slot, ltype in ui["links"]:
        assert src in nodes and dst in nodes, f"{name}: link {lid} joins a missing node"
        out = nodes[src]["outputs"][src_slot]
        assert lid in (out.get("links") or []), f"{name}: link {lid} not listed on node {src} output {src_slot}"
        assert out["type"] == ltype, f"{name}: link {lid} type {ltype} but node {src} output is {out['type']}"
        inp = nodes[dst]["inputs"][dst_slot]
        assert inp.get("link") == lid, f"{name}: node {dst} input {dst_slot} does not point back at link {lid}"
    listed = {lid for n in ui["nodes"] for o in n.get("outputs", []) for lid in (o.get("links") or [])}
    targeted = {i["link"] for n in ui["nodes"] for i in n.get("inputs", []) if i.get("link") is not None}
    assert listed == set(link_ids) == targeted, f"{name}: node link lists disagree with the links table"


def test_sockets_and_links_match_node_definitions(workflow):
    name, ui = workflow
    nodes = {n["id"]: n for n in ui["nodes"]}
    for node in ui["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        spec = node_spec(node["type"])
        where = f"{name}: node {node['id']} ({node['type']})"
        outs = node.get("outputs", [])
        assert [o["type"] for o in outs] == list(spec["output"]), f"{where}: outputs differ from RETURN_TYPES"
        by_name = {n: (k, o, req) for n, k, o, req in spec["inputs"]}
        by_name.update({n: (k, o, False) for n, k, o in widget_layout(spec) if k == "UPLOAD"})
        linked = set()
        for slot in node.get("inputs", []):
            assert slot["name"] in by_name, f"{where}: input {slot['name']!r} is not in INPUT_TYPES"
            kind, opts, _ = by_name[slot["name"]]
            if is_widget(kind, opts) or kind == "UPLOAD":
                assert slot.get("widget", {}).get("name") == slot["name"], f"{where}: widget input {slot['name']} lacks 'widget'"
            else:
                assert slot["type"] == kind, f"{where}: input {slot['name']} has type {slot['type']}, node says {kind}"
            if slot.get("link") is not None:
                linked.add(slot["name"])
                link = next(lk for lk in ui["links"] if lk[0] == slot["link"])
                src_type = nodes[link[1]]["outputs"][link[2]]["type"]
                assert types_match(src_type, kind), f"{where}: input {slot['name']} ({kind}) fed by {src_type}"
        for in_name, kind, opts, required in spec["inputs"]:
            if required and not is_widget(kind, opts):
                assert in_name in linked, f"{where}: required input {in_name!r} is not connected"


def test_widget_values_match_input_types(workflow):
    name, ui = workflow
    for node in ui["nodes"]:
        if node["type"] in FRONTEND_ONLY:
            continue
        layout = widget_layout(node_spec(node["type"]))
        values = node.get("widgets_values", [])
        where = f"{name}: node {node['id']} ({node['type']})"
        assert isinstance(values, list), f"{where}: widgets_values must be a list"
        assert len(values) == len(layout), \
            f"{where}: {len(values)} widget values, INPUT_TYPES gives {len(layout)}: {[n for n, _, _ in layout]}"
        for (in_name, kind, opts), value in zip(layout, values):
            problem = value_problem(kind, opts, value)
            assert problem is None, f"{where}: widget {in_name or 'control_after_generate'}: {problem}"
        named = node.get("widgets_values_named")
        if named is not None:  # newer frontends also save the values by name; both must agree
            expected = {(n or "control_after_generate"): v for (n, _, _), v in zip(layout, values)}
            assert named == expected, f"{where}: widgets_values_named disagrees with widgets_values"


def test_api_copy_matches_ui_graph(workflow):
    name, ui = workflow
    api = _load(API_DIR / f"{name}.json")
    expected = ui_to_api(ui)
    strip = lambda p: {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in p.items()}  # noqa: E731
    assert strip(api) == strip(expected), f"{name}: workflows/api/{name}.json differs from the UI graph"


def test_workflows_carry_pack_metadata(workflow):
    # saved pack nodes name the pack (as the registry does) so the Manager can offer to install it
    name, ui = workflow
    for node in ui["nodes"]:
        if node["type"] in NODE_CLASS_MAPPINGS:
            assert node.get("properties", {}).get("cnr_id") == "comfyui-wan-accel", f"{name}: node {node['id']}"


# ------------------------------------------------------------------------------------------ the checker itself
def test_checker_catches_broken_graphs():
    ui = {"last_node_id": 2, "last_link_id": 1, "links": [[1, 1, 0, 2, 0, "IMAGE"]], "nodes": [
        {"id": 1, "type": "VAEDecode", "inputs": [], "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [1]}],
         "widgets_values": []},
        {"id": 2, "type": "SaveAnimatedWEBP", "inputs": [{"name": "images", "type": "IMAGE", "link": 1}],
         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": []}],
         "widgets_values": ["x", 16.0, False, 90, "default"]}]}
    layout = widget_layout(node_spec("SaveAnimatedWEBP"))
    assert [n for n, _, _ in layout] == ["filename_prefix", "fps", "lossless", "quality", "method"]
    assert [value_problem(k, o, v) for (_, k, o), v in zip(layout, ui["nodes"][1]["widgets_values"])] == [None] * 5
    assert value_problem("INT", {"min": 0, "max": 100}, 101) and value_problem("INT", {}, 1.5)
    assert value_problem(["a", "b"], {}, "c") and value_problem("BOOLEAN", {}, 1)
    assert [n for n, _, _ in widget_layout(node_spec("KSampler"))][:2] == ["seed", None]
    assert ui_to_api(ui)["2"]["inputs"] == {"filename_prefix": "x", "fps": 16.0, "lossless": False, "quality": 90,
                                            "method": "default", "images": ["1", 0]}
    assert not types_match("LATENT", "IMAGE") and types_match("IMAGE", "*")
    with pytest.raises(KeyError):
        node_spec("NoSuchNode")


# ------------------------------------------------------------------ a user can finish every workflow
FILE_WIDGET_NODES = {"CLIPLoader": 0, "UNETLoader": 0, "VAELoader": 0, "CLIPVisionLoader": 0,
                     "CausalWanModelLoader": 0, "LoadImage": 0}
OUTPUT_TYPES = {"SaveAnimatedWEBP", "SaveImage", "PreviewImage", "WanAccelLimitCache", "WanAccelVRAMPlan",
                "WanAccelProfileReport"}
TINY = "(built-in tiny model)"


def _files_needed(wf: dict) -> list[str]:
    out = []
    for n in wf["nodes"]:
        if n["type"] in FILE_WIDGET_NODES and n.get("mode", 0) == 0:
            value = n["widgets_values"][FILE_WIDGET_NODES[n["type"]]]
            if value != TINY:
                out.append(value)
        if n["type"] == "WanAccelVRAMPlan" and n["widgets_values"][0] == "checkpoint":
            out.append(n["widgets_values"][1])
    return out


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_note_says_which_files_where_and_from_where(path):
    wf = json.loads(path.read_text())
    note = " ".join(n["widgets_values"][0] for n in wf["nodes"] if n["type"] in FRONTEND_ONLY)
    for name in _files_needed(wf):
        assert f"`{name}`" in note, f"{path.name}: the note does not name {name}"
    if _files_needed(wf):
        assert "models/" in note and ("huggingface.co/" in note or "github.com/" in note), path.name
        files = (REPO / "docs" / "comfyui.md").read_text().split("### Model files", 1)[1].split("\n## ", 1)[0]
        for name in _files_needed(wf):
            assert f"`{name}`" in files, f"docs/comfyui.md's model files table does not say where {name} comes from"


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_no_output_runs_without_the_model_files(path):
    """With model files missing, ComfyUI would still run every output that needs none of them and report the
    rest as errors: a half-run graph. Every output of a workflow that needs files depends on one of them."""
    wf = json.loads(path.read_text())
    if not _files_needed(wf):
        return
    ups: dict[int, set] = {}
    for link in wf["links"]:
        ups.setdefault(link[3], set()).add(link[1])
    needs = {n["id"] for n in wf["nodes"] if n["type"] in FILE_WIDGET_NODES
             or (n["type"] == "WanAccelVRAMPlan" and n["widgets_values"][0] == "checkpoint")}
    for n in wf["nodes"]:
        if n["type"] not in OUTPUT_TYPES:
            continue
        seen, todo = set(), [n["id"]]
        while todo:
            i = todo.pop()
            if i not in seen:
                seen.add(i)
                todo.extend(ups.get(i, ()))
        assert seen & needs, f"{path.name}: output node {n['id']} ({n['type']}) runs without any model file"


def test_matrix_game2_ships_its_start_image():
    from PIL import Image

    wf = json.loads((WORKFLOWS / "matrix_game2.json").read_text())
    name = next(n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "LoadImage")
    with Image.open(WORKFLOWS / name) as im:
        assert im.size == (640, 352)


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_every_template_has_its_thumbnail(path):
    """The template browser asks for ``<name>.jpg`` beside ``<name>.json`` (custom node templates)."""
    from PIL import Image

    thumb = path.with_suffix(".jpg")
    assert thumb.is_file(), f"{thumb.name} is missing (make it with tests/e2e/thumbnails.py)"
    with Image.open(thumb) as im:
        assert im.format == "JPEG" and im.size == (640, 480)
