"""End to end inside a real ComfyUI (skipped unless COMFYUI_DIR and COMFYUI_VENV are set).

    COMFYUI_DIR=<ComfyUI work tree> COMFYUI_VENV=<its venv> python -m pytest -q tests/e2e

Starts ``main.py --cpu`` on a free loopback port with the pack linked into ``custom_nodes`` as
``comfyui-wan-accel`` (all writable state in a temporary folder), then checks: the pack imports and
``/object_info`` lists every node with a tooltip on every input; the web panel's routes answer; the example
workflows are served; ``tiny_smoke`` runs through ``/prompt`` and writes its image; every workflow loads in
headless Chromium with no missing node type and no node over another, with the pack's badges, report text, live
frames, panel and play mode working (needs Playwright in COMFYUI_VENV and a ``chromium`` on PATH, or CHROMIUM), for
the bundled frontend and each frontend static folder in WAN_ACCEL_E2E_FRONTENDS (os.pathsep-separated), each with
Nodes 2.0 off and on. Screenshots go to a temporary folder, or to WAN_ACCEL_SCREENSHOTS when set (e.g. docs/images).
WAN_ACCEL_PACK_DIR loads another copy of the pack (e.g. an installed one) instead of this checkout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACK_DIR = Path(os.environ.get("WAN_ACCEL_PACK_DIR") or REPO).resolve()  # the pack folder to load (default: here)
WORKFLOWS = REPO / "workflows"
PACK_NAME = "comfyui-wan-accel"
COMFY_DIR = os.environ.get("COMFYUI_DIR")
COMFY_VENV = os.environ.get("COMFYUI_VENV")

pytestmark = pytest.mark.skipif(not (COMFY_DIR and COMFY_VENV),
                                reason="set COMFYUI_DIR and COMFYUI_VENV to run the ComfyUI end-to-end check")


def _python() -> Path:
    return Path(COMFY_VENV) / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body=None, timeout: float = 60):
    """(status, decoded JSON or text) of a GET, or of a POST when ``body`` is given."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def comfy_server(tmp_path_factory, extra_args=(), extra_env=None):
    """Start ComfyUI (generator: yields the url, the work folder and the log; stops it after); extra_args go to main.py,
    extra_env to its environment."""
    comfy_dir = Path(COMFY_DIR)
    assert (comfy_dir / "main.py").is_file(), f"COMFYUI_DIR={comfy_dir} has no main.py"
    assert _python().is_file(), f"COMFYUI_VENV={COMFY_VENV} has no bin/python"
    link = comfy_dir / "custom_nodes" / PACK_NAME
    created = False
    if link.is_symlink() or link.exists():
        if link.resolve() != PACK_DIR:
            pytest.skip(f"{link} exists and is not {PACK_DIR}; remove it to run the check")
    else:
        link.symlink_to(PACK_DIR, target_is_directory=True)
        created = True
    work = tmp_path_factory.mktemp("comfy_run")
    for sub in ("output", "input", "temp", "user"):
        (work / sub).mkdir()
    # a small random-weight Wan 2.1 VAE under the run's own model folder (the streaming decode node loads it)
    vae = subprocess.run([str(_python()), str(Path(__file__).with_name("streaming_decode_check.py")), "write-vae",
                          str(work / "models" / "vae" / "wan_2.1_vae.safetensors")], cwd=comfy_dir,
                         capture_output=True, text=True, timeout=300)
    assert vae.returncode == 0, vae.stderr[-3000:]
    # and a small random-weight tiny video decoder (taew2_1's layout), which ComfyUI's Load VAE reads as a TAEHV
    tiny = subprocess.run([str(_python()), str(Path(__file__).with_name("streaming_decode_check.py")),
                           "write-tiny-vae", str(work / "models" / "vae" / "taew2_1.safetensors")], cwd=comfy_dir,
                          capture_output=True, text=True, timeout=300)
    assert tiny.returncode == 0, tiny.stderr[-3000:]
    (work / "extra_model_paths.yaml").write_text(f"wan_accel_e2e:\n    base_path: {work}\n    vae: models/vae\n")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, WAN_ACCEL_CACHE=str(work / "wan_accel" / "limits.json"))
    env.pop("PYTHONPATH", None)
    env.update(extra_env or {})
    log_path = work / "comfy.log"
    cmd = [str(_python()), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--disable-auto-launch", "--output-directory", str(work / "output"), "--input-directory",
           str(work / "input"), "--temp-directory", str(work / "temp"), "--user-directory", str(work / "user"),
           "--database-url", f"sqlite:///{work / 'comfy.db'}", "--extra-model-paths-config",
           str(work / "extra_model_paths.yaml"), *extra_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=comfy_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
    try:
        deadline = time.time() + float(os.environ.get("COMFYUI_READY_TIMEOUT", "300"))
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ComfyUI exited ({proc.returncode}) before it was ready:\n{log_path.read_text()[-3000:]}")
            try:
                if http(url + "/system_stats", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail(f"ComfyUI not ready in time:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield {"url": url, "work": work, "log": log_path}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if created:
            link.unlink()


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    yield from comfy_server(tmp_path_factory)


@pytest.fixture(scope="module")
def object_info(comfy):
    status, info = http(comfy["url"] + "/object_info", timeout=120)
    assert status == 200
    return info


def test_pack_imports_without_errors(comfy, object_info):
    log = comfy["log"].read_text(errors="replace")
    assert "IMPORT FAILED" not in "\n".join(l for l in log.splitlines() if PACK_NAME in l), log[-3000:]
    assert "wan_accel: node module" not in log, log[-3000:]  # an area of the pack failed to import


def test_object_info_lists_every_node_with_tooltips(object_info):
    mine = {k: v for k, v in object_info.items() if v.get("python_module") == f"custom_nodes.{PACK_NAME}"}
    from wan_accel import NODE_CLASS_MAPPINGS  # the checkout's own list, imported here without ComfyUI

    assert set(mine) == set(NODE_CLASS_MAPPINGS)
    for name, info in mine.items():
        assert info["category"].startswith("wan_accel"), name
        assert info.get("description"), f"{name} has no description"
        for section in ("required", "optional"):
            for inp, decl in info["input"].get(section, {}).items():
                assert len(decl) > 1 and decl[1].get("tooltip"), f"{name}.{inp} has no tooltip in /object_info"


def test_web_routes_answer_inside_comfyui(comfy):
    status, data = http(comfy["url"] + "/api/wan_accel/limits")
    assert status == 200, data
    assert {"fingerprint_id", "fingerprint", "namespaces", "path"} <= set(data)
    assert {"operator", "compile", "memory", "sampler"} <= {ns["name"] for ns in data["namespaces"]}
    assert http(comfy["url"] + "/api/wan_accel/limits/clear", {"namespace": "../x"})[0] == 400
    assert http(comfy["url"] + "/api/wan_accel/limits/clear", b"not json")[0] == 400
    for body in (b"[" * 2000 + b"]" * 2000, b'{"namespace": NaN}', b'{"namespace": "all", "x": 1e999}'):
        status, why = http(comfy["url"] + "/api/wan_accel/limits/clear", body)     # deep nesting, non-finite
        assert status == 400 and "error" in why, (status, why)
    assert http(comfy["url"] + "/api/wan_accel/limits/clear", {"namespace": "all"}) == \
        (200, {"cleared": 0, "namespace": "all"})
    status, js = http(comfy["url"] + f"/extensions/{PACK_NAME}/wan_accel.js")
    assert status == 200 and "registerExtension" in js


def test_doctor_routes_and_node_inside_comfyui(comfy):
    status, page = http(comfy["url"] + "/api/wan_accel/doctor")
    assert status == 200, page
    rows = {f["feature"]: f for f in page["features"]}
    assert {"attention.sdpa", "fused_qkv", "cuda_graphs", "block_swap", "native_model"} <= set(rows)
    assert rows["cuda_graphs"]["available"] is False and rows["cuda_graphs"]["why_off"]   # --cpu: says why
    assert http(comfy["url"] + "/api/wan_accel/doctor/recheck", {"feature": "../x"})[0] == 400
    status, after = http(comfy["url"] + "/api/wan_accel/doctor/recheck", {"feature": "fused_qkv"})
    assert status == 200 and {f["feature"]: f for f in after["features"]}["fused_qkv"]["status"] == "passed"
    prompt = {"1": {"class_type": "WanAccelDoctor",
                    "inputs": {"feature": "all", "recheck": False, "dtype": "auto", "with_compile": False}}}
    status, resp = http(comfy["url"] + "/prompt", {"prompt": prompt, "client_id": "wan_accel_e2e"})
    assert status == 200, resp
    pid, deadline, entry = resp["prompt_id"], time.time() + 120, None
    while time.time() < deadline and entry is None:
        hist = http(comfy["url"] + f"/history/{pid}")[1]
        if pid in hist and hist[pid].get("status", {}).get("status_str") in ("success", "error"):
            entry = hist[pid]
        time.sleep(0.5)
    assert entry is not None and entry["status"]["status_str"] == "success", entry
    text = "\n".join(entry["outputs"]["1"]["text"])
    assert "fused_qkv" in text and "passed" in text and "CUDA graphs need a CUDA GPU" in text


def test_example_workflows_are_served(comfy):
    status, listing = http(comfy["url"] + "/api/workflow_templates")
    assert status == 200
    names = {p.stem for p in WORKFLOWS.glob("*.json")}
    assert set(listing.get(PACK_NAME, [])) == names
    status, served = http(comfy["url"] + f"/api/workflow_templates/{PACK_NAME}/tiny_smoke.json")
    assert status == 200 and served == json.loads((WORKFLOWS / "tiny_smoke.json").read_text())
    for name in names:  # the thumbnail the template browser shows (custom node templates: <name>.jpg)
        req = urllib.request.Request(comfy["url"] + f"/api/workflow_templates/{PACK_NAME}/{name}.jpg")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and r.read(3) == b"\xff\xd8\xff", name


def test_tiny_smoke_runs_and_saves_its_image(comfy):
    prompt = json.loads((WORKFLOWS / "api" / "tiny_smoke.json").read_text())
    status, resp = http(comfy["url"] + "/prompt", {"prompt": prompt, "client_id": "wan_accel_e2e"})
    assert status == 200, resp
    pid = resp["prompt_id"]
    deadline = time.time() + 300
    entry = None
    while time.time() < deadline:
        hist = http(comfy["url"] + f"/history/{pid}")[1]
        if pid in hist and hist[pid].get("status", {}).get("status_str") in ("success", "error"):
            entry = hist[pid]
            break
        time.sleep(0.5)
    assert entry is not None, "tiny_smoke did not finish in 300 s"
    errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors
    images = [img for out in entry["outputs"].values() for img in out.get("images", []) if img.get("type") == "output"]
    assert images, entry["outputs"]
    for img in images:
        path = comfy["work"] / "output" / img.get("subfolder", "") / img["filename"]
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


# Bad values sent to the nodes inside ComfyUI (values within the widgets' ranges, so they reach the nodes): each
# run ends in a node error whose message names the input and the fix, raised as the pack's ValueError.
E2E_BAD_INPUTS = [
    ("frames-not-4k1", {"3": {"num_frames": 10}}, ["num_frames 10", "use 9 or 21"]),
    ("frames-not-blocks", {"3": {"num_frames": 13}}, ["num_frames 13", "use 9 or 21"]),
    ("sink-over-window", {"3": {"kv_window": 3, "sink": 5}}, ["sink 5", "latent frames"]),
    ("kv-window-zero", {"3": {"kv_window": 0}}, ["kv_window 0", "-1"]),
    ("custom-steps-bogus", {"3": {"preset": "custom", "custom_steps": "fast"}}, ["steps", "fast"]),
    # non-finite numbers pass ComfyUI's min/max validation (NaN compares false): the pack's one validator stops them
    ("shift-nan", {"3": {"preset": "custom", "shift": float("nan")}}, ["shift", "finite"]),
    ("custom-steps-nan", {"3": {"preset": "custom", "custom_steps": "1000,nan,250"}}, ["steps", "nan"]),
]


def _run_prompt(comfy, prompt, timeout_s: float = 120) -> dict:
    status, resp = http(comfy["url"] + "/prompt", {"prompt": prompt, "client_id": "wan_accel_e2e"})
    if status != 200:
        return {"rejected": resp}
    pid = resp["prompt_id"]
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        hist = http(comfy["url"] + f"/history/{pid}")[1]
        if pid in hist and hist[pid].get("status", {}).get("status_str") in ("success", "error"):
            return hist[pid]
        time.sleep(0.3)
    raise AssertionError(f"the prompt did not finish in {timeout_s:.0f} s")


@pytest.mark.parametrize("case", E2E_BAD_INPUTS, ids=[c[0] for c in E2E_BAD_INPUTS])
def test_bad_values_give_node_errors_that_name_the_fix(comfy, case):
    _, changes, expect = case
    prompt = json.loads((WORKFLOWS / "api" / "tiny_smoke.json").read_text())
    for node, inputs in changes.items():
        prompt[node]["inputs"].update(inputs)
    entry = _run_prompt(comfy, prompt)
    assert "rejected" not in entry, entry
    errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "error" and errors, entry["status"]
    err = errors[0]
    assert err["exception_type"].rsplit(".", 1)[-1] in ("UsageError", "ValueError", "CheckpointError"), err
    for text in expect:
        assert text in err["exception_message"], err["exception_message"]


def test_sequence_parallel_node_samples_on_two_ranks(comfy):
    """tiny_smoke with CausalWan Sequence Parallel (2 ranks: the server process and one worker, gloo on the CPU)
    between the loader and the sampler: the run succeeds and saves its image."""
    prompt = json.loads((WORKFLOWS / "api" / "tiny_smoke.json").read_text())
    prompt["9"] = {"inputs": {"model": ["2", 0], "world_size": 2, "timeout_s": 120},
                   "class_type": "CausalWanSequenceParallel"}
    prompt["3"]["inputs"].update(model=["9", 0], sampler="reference")
    prompt["5"]["inputs"]["filename_prefix"] = "wan_accel/tiny_parallel"
    entry = _run_prompt(comfy, prompt, timeout_s=300)
    assert "rejected" not in entry, entry
    errors = [m[1] for m in entry["status"].get("messages", []) if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors
    images = [img for out in entry["outputs"].values() for img in out.get("images", []) if img.get("type") == "output"]
    assert images and all((comfy["work"] / "output" / i.get("subfolder", "") / i["filename"]).is_file()
                          for i in images)


def test_native_causal_tiny_runs_through_prompt(comfy):
    """The no-model-files native workflow: the tiny model as core's WAN21_CausalAR MODEL, the Wan Accel AR Sampler
    in SamplerCustomAdvanced, a preview image saved."""
    prompt = json.loads((WORKFLOWS / "api" / "native_causal_tiny.json").read_text())
    entry = _run_prompt(comfy, prompt, timeout_s=300)
    assert entry.get("status", {}).get("status_str") == "success", entry.get("status", entry)
    images = [img for out in entry["outputs"].values() for img in out.get("images", []) if img.get("type") == "output"]
    assert images, entry["outputs"]


def _browser_ready() -> str | None:
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium")
    if not chromium:
        return "no chromium on PATH (set CHROMIUM)"
    if subprocess.run([str(_python()), "-c", "import playwright"], capture_output=True).returncode:
        return "playwright is not installed in COMFYUI_VENV"
    return None


def _need_browser() -> None:
    """Skip without a browser; under CI=true, where tools/setup_comfyui.sh installs one, its absence fails."""
    why = _browser_ready()
    if why:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(why)


# The frontends the browser half runs against: the one ComfyUI bundles, then every frontend static folder named in
# WAN_ACCEL_E2E_FRONTENDS (os.pathsep-separated; each given to ComfyUI's --front-end-root). One server per frontend;
# within it the page runs with each renderer (Nodes 2.0 off and on).
BUNDLED = "bundled"
FRONTENDS = [BUNDLED] + [p for p in os.environ.get("WAN_ACCEL_E2E_FRONTENDS", "").split(os.pathsep) if p.strip()]
RENDERERS = ["classic", "vue"]


def _frontend_id(root: str) -> str:
    if root == BUNDLED:
        return BUNDLED
    version = re.search(r"\d+\.\d+\.\d+", root)
    return f"frontend-{version.group(0) if version else Path(root).name}"


@pytest.fixture(scope="module")
def frontend_servers(comfy, tmp_path_factory):
    """A ComfyUI per frontend (get(root)), each started when first asked for and kept for the module: the module's
    server for the bundled one, one with --front-end-root for each other."""
    started, running = {BUNDLED: dict(comfy, frontend=BUNDLED)}, []

    def get(root: str) -> dict:
        if root not in started:
            assert (Path(root) / "index.html").is_file(), \
                f"WAN_ACCEL_E2E_FRONTENDS names {root}, which is not a frontend's static folder (no index.html)"
            server = comfy_server(tmp_path_factory, ("--front-end-root", str(Path(root))))
            running.append(server)
            started[root] = dict(next(server), frontend=_frontend_id(root))
        return started[root]

    yield get
    for server in running:
        next(server, None)                          # stops it


def _shots(server: dict, renderer: str, tmp: Path) -> tuple[Path, Path | None]:
    """Where a browser run's screenshots go, and where its docs images are copied: WAN_ACCEL_SCREENSHOTS (e.g.
    docs/images) takes the bundled frontend's classic screenshots and every configuration's web_*.jpg."""
    docs = os.environ.get("WAN_ACCEL_SCREENSHOTS")
    if docs and server["frontend"] == BUNDLED and renderer == "classic":
        return Path(docs), Path(docs)
    return tmp / "shots", Path(docs) if docs else None


def _browser(server: dict, renderer: str, tmp: Path, args: list[str], timeout_s: float) -> dict:
    """Run browser_check.py against the server with the renderer and ``args``; its report, with the files it made
    (docs images copied to WAN_ACCEL_SCREENSHOTS when set). Fails when the page did not come up."""
    shots, docs = _shots(server, renderer, tmp)
    report_path = tmp / "browser.json"
    out = subprocess.run([str(_python()), str(Path(__file__).with_name("browser_check.py")), "--url", server["url"],
                          "--renderer", renderer, "--out-dir", str(shots), "--report", str(report_path),
                          "--timeout", str(timeout_s), *args], capture_output=True, text=True, timeout=1500)
    assert report_path.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert "error" not in report, (report["error"], server["log"].read_text()[-3000:])
    assert report["renderer"] == renderer, report["renderer"]
    if docs is not None:
        for jpg in shots.glob("web_*.jpg"):
            if jpg.parent != docs:
                shutil.copy(jpg, docs / jpg.name)
    return report


def live_prompt(num_frames: int = 21, side: int = 64, vae: str = "wan_2.1_vae.safetensors") -> dict:
    """The tiny model sampled by CausalWan Sampler + Decode with the run's small Wan 2.1 VAE file (or ``vae``: its
    tiny decoder, taew2_1.safetensors)."""
    return {
        "1": {"class_type": "CausalWanModelLoader", "inputs": {"checkpoint": "(built-in tiny model)", "dtype": "fp32",
                                                               "precision": "float32", "attention": "sdpa"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "3": {"class_type": "CausalWanSamplerDecode", "inputs": {
            "vae": ["2", 0], "model": ["1", 0], "width": side, "height": side, "num_frames": num_frames, "seed": 1,
            "preset": "self_forcing", "frames_per_block": 3, "kv_window": -1, "sink": 0,
            "custom_steps": "1000,750,500,250", "shift": 5.0, "skip_last_refresh": False, "sampler": "auto",
            "keep_state": False, "live_preview": True}},
        "4": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["3", 0], "filename_prefix": "wan_accel/live",
                                                           "fps": 16.0, "lossless": False, "quality": 80,
                                                           "method": "default"}},
    }


CONFIGS = [(f, r) for f in FRONTENDS for r in RENDERERS]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{_frontend_id(f)}-{r}" for f, r in CONFIGS])
def ui_check(frontend_servers, request, tmp_path_factory):
    """One browser session per frontend and renderer: every workflow loaded (and tiny_smoke and native_causal_tiny
    run from the page), the compile badges followed through widget changes beside a report text, live frames of a
    CausalWan Sampler + Decode run, the panel opened and one namespace cleared with its button."""
    from wan_accel.cache import LimitCache

    _need_browser()
    comfy_ui, renderer = frontend_servers(request.param[0]), request.param[1]
    tmp = tmp_path_factory.mktemp(f"ui_{comfy_ui['frontend']}_{renderer}")
    # an entry for the panel's Clear button to remove (written by this process: it counts as another machine
    # unless this Python has the same torch/triton as ComfyUI's)
    LimitCache(comfy_ui["work"] / "wan_accel" / "limits.json").put(
        "sampler", "e2e-check", {"note": "written by the end-to-end test"})
    (tmp / "live.json").write_text(json.dumps(live_prompt()))
    args = ["--api-dir", str(WORKFLOWS / "api"), "--queue", "tiny_smoke", "--queue", "native_causal_tiny",
            "--showcase", "--live", str(tmp / "live.json"), "--panel", "--clear", "sampler"]
    for wf in sorted(WORKFLOWS.glob("*.json")):
        args += ["--workflow", str(wf)]
    report = _browser(comfy_ui, renderer, tmp, args, timeout_s=300)
    if os.environ.get("WAN_ACCEL_SCREENSHOTS"):      # the timings, for the docs
        (Path(os.environ["WAN_ACCEL_SCREENSHOTS"]) / f"browser_{comfy_ui['frontend']}_{renderer}.json").write_text(
            json.dumps({"frontend": report["frontend_version"], "renderer": renderer, "seconds": report["seconds"]}))
    return dict(report, server=comfy_ui)


def _badges_in_file(path: Path) -> dict:
    """The badges each compile settings node of a UI workflow should show, from its widget values."""
    out = {}
    for n in json.loads(path.read_text())["nodes"]:
        if n["type"] == "WanAccelCompileSettings":
            named = n["widgets_values_named"]
            out[str(n["id"])] = [t for t, on in (("EXTREME-PLUS", named["tiling_preset"] == "EXTREME-PLUS"),
                                                 ("GLOBAL OPS LOCKED", named["lock_global_ops"] is True)) if on]
    return {k: v for k, v in out.items() if v}


def test_every_workflow_loads_in_the_browser(ui_check):
    """Per frontend and renderer: every workflow loads with no missing node, no node over another or over its note
    (boxes measured on the page), the compile badges as the file's widgets ask; tiny_smoke and native_causal_tiny run
    from the page and the Limit Cache node's report text shows."""
    report = ui_check
    assert report["extension_loaded"], "the pack's frontend extension did not load"
    assert len(report["workflows"]) == len(list(WORKFLOWS.glob("*.json")))
    for wf in report["workflows"]:
        assert not wf["missing_node_types"], (wf["workflow"], wf["missing_node_types"])
        assert wf["overlaps"] == [], (wf["workflow"], wf["overlaps"])
        assert not wf["problems"], (wf["workflow"], wf["problems"])
        assert len(wf["boxes"]) == len(json.loads((WORKFLOWS / f"{wf['workflow']}.json").read_text())["nodes"])
        assert wf["badges"] == _badges_in_file(WORKFLOWS / f"{wf['workflow']}.json"), wf["workflow"]
        assert Path(wf["screenshot"]).stat().st_size > 10_000
    assert any(wf["badges"] for wf in report["workflows"])      # some workflow shows a badge at all
    smoke = next(w for w in report["workflows"] if w["workflow"] == "tiny_smoke")
    assert smoke["run"]["status"] == "success", smoke["run"]
    native = next(w for w in report["workflows"] if w["workflow"] == "native_causal_tiny")
    assert native["run"]["status"] == "success", native["run"]      # the native MODEL path, run in the browser
    # the Limit Cache node's text shows on the node after the run (the pack's text display)
    limit_node = next(n["id"] for n in json.loads((WORKFLOWS / "tiny_smoke.json").read_text())["nodes"]
                      if n["type"] == "WanAccelLimitCache")
    assert str(limit_node) in smoke["run"]["text_reported"] and smoke["run"]["text_shown"], smoke["run"]


def test_compile_badges_follow_their_widgets_beside_a_report_text(ui_check):
    show = ui_check["showcase"]
    assert show["added"] == ["GLOBAL OPS LOCKED"], show           # the node's defaults: the lock on
    assert show["both_on"] == ["EXTREME-PLUS", "GLOBAL OPS LOCKED"], show
    assert show["lock_off"] == ["EXTREME-PLUS"], show
    assert show["text_shown"], show
    assert Path(show["screenshot"]).stat().st_size > 5_000


def test_the_panel_opens_and_clears_a_namespace(ui_check):
    assert ui_check["panel"]["tab_button"] == 1, "the side-bar tab button was not found by its label"
    assert {"operator", "compile", "memory", "sampler"} <= set(ui_check["panel"]["namespaces"])
    clear = ui_check["panel"]["clear"]
    assert clear["before"]["sampler"] == "1" and clear["after"]["sampler"] == "0", clear
    assert "sampler" in clear["dialog"], clear["dialog"]
    from wan_accel.cache import LimitCache
    limits = LimitCache(ui_check["server"]["work"] / "wan_accel" / "limits.json")
    assert limits.entries("sampler", all_fingerprints=True) == []


def _assert_live(live: dict, log: Path) -> None:
    assert live["ends"] and live["ends"][0]["kind"] == "execution_success", (live, log.read_text()[-3000:])
    events = live["events"]
    assert [e["chunk"] for e in events] == [0, 1], events           # 6 latent frames: two 3-frame chunks
    assert all(e["node"] == "3" for e in events)
    assert sum(e["frames"] for e in events) == 21                    # every video frame, chunk by chunk
    assert events[0]["t"] < live["ends"][0]["t"]                     # the first frames came before the end
    assert all(e["latency_s"] > 0 for e in events)
    assert live["panel_playing"], "the pack's panel shows no live frames"
    assert live["played_out"], live["players"]                     # both players showed every frame
    assert Path(live["screenshot_after"]).stat().st_size > 10_000


def test_live_frames_reach_the_page_before_the_prompt_ends(ui_check):
    live = ui_check["live"]
    _assert_live(live, ui_check["server"]["log"])
    assert live["node_playing"], live["players"]                   # in the node, on the page


def test_live_frames_of_the_tiny_video_decoder(comfy, tmp_path):
    """ComfyUI's tiny video decoder (Load VAE of a taew2_1 file): the same stream (the bundled frontend)."""
    _need_browser()
    (tmp_path / "live.json").write_text(json.dumps(live_prompt(vae="taew2_1.safetensors")))
    server = dict(comfy, frontend="taew")            # its screenshots stay out of the docs
    report = _browser(server, "classic", tmp_path, ["--live", str(tmp_path / "live.json")], timeout_s=300)
    _assert_live(report["live"], comfy["log"])


TINY_MG2 = "(built-in tiny Matrix-Game-2 model)"


def play_prompt(seed: int = 7, side: int = 64) -> dict:
    """The tiny Matrix-Game-2 model, the run's small Wan 2.1 VAE and a flat start image, into a Play Session node."""
    return {
        "1": {"class_type": "CausalWanModelLoader", "inputs": {"checkpoint": TINY_MG2, "dtype": "fp32",
                                                               "precision": "float32", "attention": "sdpa"}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
        "3": {"class_type": "EmptyImage", "inputs": {"width": side, "height": side, "batch_size": 1, "color": 0x708090}},
        "4": {"class_type": "MatrixGame2StartLatent", "inputs": {"vae": ["2", 0], "start_image": ["3", 0],
                                                                 "latent_frames": 1}},
        "5": {"class_type": "MatrixGame2PlaySession", "inputs": {
            "model": ["1", 0], "vae": ["2", 0], "start_latent": ["4", 0], "seed": seed, "preset": "universal",
            "kv_window": 0, "idle_timeout_s": 300, "state_on": "model device"}},
    }


def replay_prompt(script: str, seed: int, prefix: str) -> dict:
    """The same model and start latent, the saved script through Game Actions and the Matrix-Game-2 Sampler."""
    prompt = {k: v for k, v in play_prompt(seed).items() if k != "5"}
    prompt.update({
        "6": {"class_type": "MatrixGame2Actions", "inputs": {"script": script, "mode": "universal"}},
        "7": {"class_type": "MatrixGame2Sampler", "inputs": {
            "model": ["1", 0], "start_latent": ["4", 0], "actions": ["6", 0], "seed": seed, "num_frames": 0,
            "preset": "universal", "kv_window": 0, "keep_state": False}},
        "8": {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0], "filename_prefix": prefix}},
    })
    return prompt


def _latent_of(comfy, entry) -> "torch.Tensor":
    from safetensors.torch import load_file
    saved = [x for out in entry["outputs"].values() for x in out.get("latents", [])]
    assert saved, entry["outputs"]
    f = comfy["work"] / "output" / saved[0]["subfolder"] / saved[0]["filename"]
    return load_file(str(f))["latent_tensor"]


def _one_hot(keys: str) -> list:
    return [[float(k in keys.split("+")) for k in ("w", "s", "a", "d")]]


def _browser_with_prompt(server: dict, tmp_path: Path, mode: str, prompt: dict, timeout_s: float,
                         renderer: str = "classic") -> dict:
    """browser_check.py with ``--<mode> <API prompt>`` against the server; its report."""
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(prompt))
    return _browser(dict(server, frontend=server.get("frontend", BUNDLED)), renderer, tmp_path,
                    [f"--{mode}", str(path)], timeout_s)


@pytest.fixture(scope="module", params=FRONTENDS, ids=[_frontend_id(f) for f in FRONTENDS])
def play_check(frontend_servers, request, tmp_path_factory):
    """Play mode and prompt play from the panel, once per frontend: under the classic canvas with the bundled
    frontend, under Nodes 2.0 with the others (the panel is the same under both; the graph it runs differs)."""
    _need_browser()
    comfy_ui = frontend_servers(request.param)
    renderer = "classic" if comfy_ui["frontend"] == BUNDLED else "vue"
    tmp = tmp_path_factory.mktemp(f"play_{comfy_ui['frontend']}")
    from e2e.test_prompt_play_e2e import session_prompt
    (tmp / "play.json").write_text(json.dumps(play_prompt()))
    (tmp / "prompt_play.json").write_text(json.dumps(session_prompt()))
    report = _browser(comfy_ui, renderer, tmp, ["--play", str(tmp / "play.json"),
                                                "--prompt-play", str(tmp / "prompt_play.json")], timeout_s=240)
    return dict(report, server=comfy_ui)


def test_prompt_box_reaches_the_model(play_check):
    """The prompt box of prompt play (its schedule and rows are checked in test_prompt_play_e2e.py)."""
    play = play_check["prompt_play"]
    assert not play["errors"], play["errors"]
    sent, given = play["sent"], play["server"]["chunk_actions"]
    switch = next(i for i, s in enumerate(sent) if s["prompt"] == play["new_prompt"])
    assert switch >= 2 and len(given) == len(sent) >= switch + 2
    assert [row["prompt"] for row in given] == [s["prompt"] for s in sent]
    assert play["ended"]["reason"] == "ended by the user"


def test_play_mode_keys_reach_the_model_and_the_saved_script_reproduces_it(play_check):
    import torch
    from safetensors.torch import load_file
    comfy = play_check["server"]
    play = play_check["play"]
    assert not play["errors"], play["errors"]
    sent, server = play["sent"], play["server"]["chunk_actions"]
    assert [s["chunk"] for s in sent] == list(range(len(sent))) == [c["chunk"] for c in play["chunks"]]
    assert len(server) == len(sent)
    for s, given in zip(sent, server):              # what the page sent is what the model was given, chunk by chunk
        assert given["keyboard"] == _one_hot(s["keys"]) * len(given["keyboard"]), (s, given)
        assert given["mouse"] == [[pytest.approx(s["mouse_pitch"]), pytest.approx(s["mouse_yaw"])]] * len(given["mouse"])
    assert any(s["keys"] == "w" for s in sent) and any(s["mouse_yaw"] > 0 for s in sent) and sent[-1]["keys"] == ""
    assert all(c["frames"] > 0 for c in play["chunks"][1:]) and play["chunks"][0]["frames"] == 9
    assert Path(play["screenshot"]).stat().st_size > 10_000
    assert play["ended"]["reason"] == "ended by the user"

    # the saved files: a video, the script, the latent; the script with the seed reproduces the session exactly
    saved = play["saved"]
    folder = comfy["work"] / "output" / saved["subfolder"]
    assert (folder / saved["files"]["video"]).stat().st_size > 1000 and saved["files"]["video"].endswith(".mp4")
    assert saved["frames"] == 1 + 4 * (3 * len(sent) - 1)
    script = (folder / saved["files"]["script"]).read_text()
    session_latent = load_file(str(folder / saved["files"]["latent"]))["latent_tensor"]

    # a second, stalled session does not hold the queue: other prompts (the replays) run while it waits
    started = _run_prompt(comfy, play_prompt(seed=3), timeout_s=300)
    assert started["status"]["status_str"] == "success", started["status"]
    other = started["outputs"]["5"]["wan_accel_play"][0]
    step = _run_prompt(comfy, {"1": {"class_type": "MatrixGame2PlayStep", "inputs": {
        "session": other, "keys": "d", "mouse_pitch": 0.0, "mouse_yaw": 0.0, "chunk": 0}}}, timeout_s=300)
    assert step["status"]["status_str"] == "success", step["status"]

    replay = _run_prompt(comfy, replay_prompt(script, 7, "wan_accel/replay"), timeout_s=300)
    assert replay["status"]["status_str"] == "success", replay["status"]
    assert torch.equal(_latent_of(comfy, replay), session_latent)          # same seed, same actions: same frames
    items = script.strip().splitlines()[-1].split(", ")                 # one item per chunk
    i = next(k for k, x in enumerate(sent) if x["keys"] == "w")        # the chunk W was held for
    assert items[i].startswith("w*"), (i, items)
    items[i] = "s" + items[i][1:]
    changed = _run_prompt(comfy, replay_prompt(", ".join(items), 7, "wan_accel/changed"), timeout_s=300)
    other_latent = _latent_of(comfy, changed)
    assert torch.equal(other_latent[:, :, :3 * i], session_latent[:, :, :3 * i])
    assert not torch.equal(other_latent[:, :, 3 * i:3 * i + 3], session_latent[:, :, 3 * i:3 * i + 3])  # S, not W

    sessions = {s["session"]: s for s in http(comfy["url"] + "/api/wan_accel/play")[1]["sessions"]}
    assert sessions[other]["ended"] is None and sessions[other]["chunks"] == 1    # stalled, still there
    assert sessions[play["session"]]["ended"] == "ended by the user"
    status, ended = http(comfy["url"] + "/api/wan_accel/play/end", {"session": other})
    assert status == 200 and ended["ended"] == "ended by the user"
    status, err = http(comfy["url"] + "/api/wan_accel/play/touch", {"session": "../etc"})
    assert status == 400 and "not a play session id" in err["error"]
    for sid, says in ((other, "has ended (ended by the user): start a new one"), ("beef", "there is no play session")):
        late = _run_prompt(comfy, {"1": {"class_type": "MatrixGame2PlayStep", "inputs": {
            "session": sid, "keys": "w", "mouse_pitch": 0.0, "mouse_yaw": 0.0, "chunk": -1}}})
        errors = [m[1] for m in late["status"].get("messages", []) if m[0] == "execution_error"]
        assert late["status"]["status_str"] == "error" and says in errors[0]["exception_message"], late["status"]
