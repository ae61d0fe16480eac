#!/usr/bin/env python3
"""Browser half of the end-to-end check; runs with ComfyUI's Python (it needs Playwright and a system Chromium).

For each UI-format workflow: load it into the running ComfyUI page (``app.loadGraphData``), fit the view, save a
screenshot, and report the graph as the frontend sees it: node types the server does not know, nodes flagged with
errors, widget values after loading (compared with the file), the API prompt the frontend builds
(``app.graphToPrompt``, compared with the API copy) and the pack's badges. Optionally runs one workflow through the
Run path (``app.queuePrompt``) and opens the pack's sidebar panel. Prints a JSON report (also to --report).
Exit status: 0 all good, 1 a check failed, 2 the page did not come up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

GRAPH_STATE = """async () => {
  const app = window.app;
  const nodes = app.graph.nodes.map(n => ({
    id: n.id, type: n.type, virtual: !!n.isVirtualNode, has_errors: !!n.has_errors,
    registered: !!LiteGraph.registered_node_types[n.type],
    badges: (n.badges || []).filter(b => b && b._wanAccel).map(b => b.text),
    // combo values the server does not offer (a model file that is not installed here)
    unavailable: (n.widgets || []).filter(w => w.type === 'combo' && Array.isArray(w.options?.values)
                                           && !w.options.values.includes(w.value)).map(w => w.name),
  }));
  const serialized = app.graph.serialize();
  const prompt = (await app.graphToPrompt()).output;
  return JSON.parse(JSON.stringify({nodes, serialized, prompt}));
}"""


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def close_dialogs(page, report: dict) -> None:
    for _ in range(3):
        dialogs = page.locator("[role=dialog]")
        if not dialogs.count():
            return
        report.setdefault("dialogs", []).append(dialogs.first.inner_text()[:500])
        page.keyboard.press("Escape")
        page.wait_for_timeout(300)


SCREENSHOT_SETTINGS = """async () => {
  const s = window.app.extensionManager?.setting;
  if (!s) return;
  await s.set('LiteGraph.Canvas.MinFontSizeForLOD', 0);   // draw text at any zoom (readable screenshots)
  await s.set('Comfy.Minimap.Visible', false);
}"""


def close_toasts(page) -> None:
    buttons = page.locator("[data-testid=error-overlay-dismiss], .p-toast-close-button, .p-toast-icon-close")
    for i in range(buttons.count()):
        try:
            buttons.nth(i).click(timeout=1000)
        except Exception:  # noqa: BLE001 - a toast that went away by itself
            pass


def strip_prompt(prompt: dict) -> dict:
    return {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in prompt.items()}


def check_workflow(page, path: Path, api_dir: Path | None, known: dict, out_dir: Path) -> dict:
    wf = json.loads(path.read_text(encoding="utf-8"))
    res = {"workflow": path.stem, "problems": []}
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", wf)
    page.wait_for_timeout(1200)
    close_dialogs(page, res)
    page.evaluate("async () => { await window.app.extensionManager.command.execute('Comfy.Canvas.FitView'); }")
    page.wait_for_timeout(600)
    overlay = page.locator("[data-testid=error-overlay-dismiss]")
    if overlay.count():  # the frontend's error summary (e.g. model files not installed here); kept in the report
        res["error_overlay"] = overlay.first.locator("xpath=..").inner_text()[:300]
    close_toasts(page)
    page.evaluate("() => window.app.canvas.setDirty(true, true)")
    page.wait_for_timeout(400)
    state = page.evaluate(GRAPH_STATE)
    shot = out_dir / f"{path.stem}.png"
    page.screenshot(path=str(shot))
    res["screenshot"] = str(shot)
    nodes = state["nodes"]
    res["node_types"] = sorted({n["type"] for n in nodes})
    res["missing_node_types"] = sorted({n["type"] for n in nodes if not n["virtual"] and n["type"] not in known})
    res["unregistered"] = sorted({n["type"] for n in nodes if not n["registered"]})
    # a node flagged only because a model file it names is not installed here is expected (no models in CI)
    res["missing_files"] = {str(n["id"]): n["unavailable"] for n in nodes if n["unavailable"]}
    res["nodes_with_errors"] = [n["id"] for n in nodes if n["has_errors"] and not n["unavailable"]]
    res["badges"] = {str(n["id"]): n["badges"] for n in nodes if n["badges"]}
    if res["missing_node_types"] or res["unregistered"]:
        res["problems"].append(f"missing node types {res['missing_node_types'] or res['unregistered']}")
    if res["nodes_with_errors"]:
        res["problems"].append(f"nodes with errors {res['nodes_with_errors']}")
    if len(nodes) != len(wf["nodes"]):
        res["problems"].append(f"{len(nodes)} nodes on the canvas, the file has {len(wf['nodes'])}")
    # widget values as the frontend holds them after loading (a combo it had to reset, a value it clamped, ...)
    after = {n["id"]: n.get("widgets_values", []) for n in state["serialized"]["nodes"]}
    for n in wf["nodes"]:
        if after.get(n["id"]) != n.get("widgets_values", []):
            res["problems"].append(f"node {n['id']} widgets changed on load: {n.get('widgets_values')} -> {after.get(n['id'])}")
    if api_dir is not None:
        api = json.loads((api_dir / path.name).read_text(encoding="utf-8"))
        if strip_prompt(state["prompt"]) != strip_prompt(api):
            res["problems"].append("graphToPrompt differs from the API copy")
            res["prompt"] = state["prompt"]
    res["serialized"] = state["serialized"]
    return res


SAVED_WIDGETS = "() => JSON.parse(JSON.stringify(window.app.graph.serialize().nodes.map(n => [n.id, n.widgets_values])))"


def run_queued(page, base: str, timeout: float, out_dir: Path, stem: str) -> dict:
    before = set(get_json(base + "/history"))
    saved_before = page.evaluate(SAVED_WIDGETS)
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    end = time.time() + timeout
    page.wait_for_timeout(1000)
    while time.time() < end:
        q = get_json(base + "/queue")
        if not q.get("queue_running") and not q.get("queue_pending"):
            break
        time.sleep(0.5)
    new = [v for k, v in get_json(base + "/history").items() if k not in before]
    page.wait_for_timeout(1500)
    shot = out_dir / f"{stem}_after_run.png"
    page.screenshot(path=str(shot))
    if not new:
        return {"status": "not queued", "screenshot": str(shot)}
    status = new[-1].get("status", {})
    errors = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
    # what a run adds to nodes (text boxes, previews) must not end up in a saved workflow
    saved_after = page.evaluate(SAVED_WIDGETS)
    return {"status": status.get("status_str"), "outputs": new[-1].get("outputs"), "screenshot": str(shot),
            "errors": [{k: e.get(k) for k in ("node_id", "node_type", "exception_message")} for e in errors],
            "saved_widgets_unchanged": saved_before == saved_after,
            "text_boxes": page.evaluate("() => window.app.graph.nodes.filter(n => (n.widgets || []).some("
                                        "w => w.name === 'wan_accel_text' && w.value)).map(n => n.id)")}


LIVE_STATE = "() => ({events: window.__wanAccelLive?.events.length || 0, ends: window.__wanAccelLive?.ends.length || 0})"


def run_live(page, base: str, api_path: Path, timeout: float, out_dir: Path) -> dict:
    """Load an API-format prompt, queue it from the page and record when the pack's live frames arrive
    (``window.__wanAccelLive``, kept by web/wan_accel_live.js) against when the prompt ends; screenshots of the
    node while frames play and after the run."""
    prompt = json.loads(api_path.read_text())
    page.evaluate("async (p) => { await window.app.loadApiJson(p, 'streaming_live'); }", prompt)
    page.wait_for_timeout(1000)
    tab = page.locator(".wan-accel-limits-tab-button")        # the panel open: it plays the frames too
    if tab.count():
        tab.first.click()
        page.wait_for_selector(".wan-accel-panel", timeout=15000)
    page.evaluate("() => { window.app.canvas.ds.offset = [40, 40]; window.app.canvas.setDirty(true, true); }")
    page.evaluate("() => { window.__wanAccelLive.events.length = 0; window.__wanAccelLive.ends.length = 0; }")
    queued = page.evaluate("async () => { const t = performance.now(); await window.app.queuePrompt(0, 1); return t; }")
    end, mid = time.time() + timeout, None
    while time.time() < end:
        state = page.evaluate(LIVE_STATE)
        if state["ends"]:
            break
        if state["events"] and mid is None:
            page.wait_for_timeout(400)
            mid = out_dir / "streaming_live_during_run.png"
            page.screenshot(path=str(mid))
        time.sleep(0.2)
    page.wait_for_timeout(2500)
    after = out_dir / "streaming_live_after_run.png"
    page.screenshot(path=str(after))
    log = page.evaluate("() => JSON.parse(JSON.stringify(window.__wanAccelLive))")
    panel_src = page.evaluate("() => document.querySelector('.wan-accel-panel-live img')?.src || ''")
    return {"queued_at": queued, "events": log["events"], "ends": log["ends"],
            "panel_playing": panel_src.startswith("data:image/jpeg"),
            "screenshot_during": str(mid) if mid else None, "screenshot_after": str(after)}


PLAY_LOG = "() => JSON.parse(JSON.stringify(window.__wanAccelPlay || {}))"


def _wait_play(page, condition: str, timeout: float, what: str) -> dict:
    """Poll the page's play log until ``condition`` (a JS expression over ``p``, the log) holds."""
    end = time.time() + timeout
    while time.time() < end:
        log = page.evaluate(PLAY_LOG)
        if page.evaluate(f"(p) => !!({condition})", log):
            return log
        time.sleep(0.2)
    raise TimeoutError(f"play mode: {what} did not happen in {timeout:.0f} s; log: {json.dumps(page.evaluate(PLAY_LOG))[:1500]}")


def _start_session(page, api_path: Path, name: str, timeout: float):
    """Load the graph (API form) as workflow ``name``, open the Wan Accel panel and press Start session; returns the
    play box once the session is ready."""
    prompt = json.loads(api_path.read_text())
    page.evaluate("async ([p, n]) => { await window.app.loadApiJson(p, n); }", [prompt, name])
    page.wait_for_timeout(800)
    tab = page.locator(".wan-accel-limits-tab-button")
    if tab.count():
        tab.first.click()
    else:
        page.get_by_role("button", name="Wan Accel").first.click()
    page.wait_for_selector(".wan-accel-play", timeout=15000)
    box = page.locator(".wan-accel-play")
    box.get_by_role("button", name="Start session").click()
    _wait_play(page, "p.ready.length > 0", timeout, "the session start")
    return box


def run_play(page, api_path: Path, timeout: float, out_dir: Path) -> dict:
    """Matrix-Game-2 play mode as a user drives it: load the graph with a Play Session node, open the panel, press
    Start session, then Play; hold W for a chunk, drag on the video, let go of everything; Pause and Resume at once;
    Pause, Save, End. Reports
    what the page sent per chunk, what arrived, and what the server says the model was given."""
    box = _start_session(page, api_path, "play", timeout)
    page.wait_for_timeout(300)
    box.get_by_role("button", name="Play").click()
    sent = lambda cond: f"p.sent.some(s => {cond}) && p.chunks.length >= p.sent.length"
    page.keyboard.down("w")                              # held until a chunk was asked for with it, and made
    _wait_play(page, sent("s.keys === 'w'"), timeout, "a chunk with W held")
    page.keyboard.up("w")
    img = page.locator(".wan-accel-play-video").bounding_box()
    cx, cy = img["x"] + img["width"] / 2, img["y"] + img["height"] / 2
    page.mouse.move(cx, cy)
    page.mouse.down()
    for i in range(1, 7):                                # a 60 px drag to the right: the camera turns right
        page.mouse.move(cx + 10 * i, cy)
        page.wait_for_timeout(30)
    page.mouse.up()
    _wait_play(page, sent("s.mouse_yaw > 0"), timeout, "a chunk with a camera drag")
    _wait_play(page, "p.sent.length >= 2 && p.sent[p.sent.length - 1].keys === '' && "
                     "p.sent[p.sent.length - 1].mouse_yaw === 0 && p.chunks.length >= p.sent.length",
               timeout, "an idle chunk")
    # Pause and Resume at once, while a chunk may still be on its way: one loop goes on, no chunk asked twice
    box.get_by_role("button", name="Pause").click()
    box.get_by_role("button", name="Resume").click()
    resumed = len(page.evaluate(PLAY_LOG)["sent"])
    _wait_play(page, f"p.chunks.length >= {resumed + 2}", timeout, "two chunks after Resume")
    box.get_by_role("button", name="Pause").click()
    log = _wait_play(page, "p.chunks.length >= p.sent.length", timeout, "the last chunk after Pause")
    page.wait_for_timeout(1500)                          # the frames play out
    shot = out_dir / "play_mode.png"
    page.screenshot(path=str(shot))
    session = log["ready"][-1]["session"]
    info = page.evaluate("async (s) => { const r = await fetch('/api/wan_accel/play/touch', {method: 'POST', "
                         "headers: {'Content-Type': 'application/json'}, body: JSON.stringify({session: s})}); "
                         "return await r.json(); }", session)
    box.get_by_role("button", name="Save").click()
    log = _wait_play(page, "p.saved.length > 0", timeout, "the save")
    page.wait_for_selector(".wan-accel-play-script", timeout=15000)
    return {"session": session, "sent": log["sent"], "chunks": log["chunks"], "saved": log["saved"][-1],
            "errors": log["errors"], "server": info, "screenshot": str(shot)}


def run_prompt_play(page, api_path: Path, timeout: float, out_dir: Path, new_prompt: str = "a red fox runs "
                    "through fresh snow") -> dict:
    """Live prompt play as a user drives it: load the graph with a CausalWan Prompt Play Session node, open the
    panel, Start session, Play; after two chunks type ``new_prompt`` in the prompt box; two chunks later Pause and
    Save. Reports what the page sent per chunk, what arrived, and what the server says each chunk was given."""
    box = _start_session(page, api_path, "prompt_play", timeout)
    page.wait_for_selector(".wan-accel-play-prompt", timeout=15000)
    page.wait_for_timeout(300)
    box.get_by_role("button", name="Play").click()
    _wait_play(page, "p.chunks.length >= 2", timeout, "two chunks with the first prompt")
    field = page.locator(".wan-accel-play-prompt")
    field.click()
    field.fill(new_prompt)                               # typed while the video plays
    _wait_play(page, f"p.sent.some(s => s.prompt === {json.dumps(new_prompt)}) && "
                     f"p.chunks.length >= p.sent.findIndex(s => s.prompt === {json.dumps(new_prompt)}) + 2",
               timeout, "two chunks after the new prompt")
    box.get_by_role("button", name="Pause").click()
    log = _wait_play(page, "p.chunks.length >= p.sent.length", timeout, "the last chunk after Pause")
    page.wait_for_timeout(1000)
    shot = out_dir / "prompt_play.png"
    page.screenshot(path=str(shot))
    session = log["ready"][-1]["session"]
    info = page.evaluate("async (s) => { const r = await fetch('/api/wan_accel/play/touch', {method: 'POST', "
                         "headers: {'Content-Type': 'application/json'}, body: JSON.stringify({session: s})}); "
                         "return await r.json(); }", session)
    box.get_by_role("button", name="Save").click()
    log = _wait_play(page, "p.saved.length > 0", timeout, "the save")
    page.wait_for_selector(".wan-accel-play-script", timeout=15000)
    return {"session": session, "sent": log["sent"], "chunks": log["chunks"], "saved": log["saved"][-1],
            "errors": log["errors"], "server": info, "screenshot": str(shot), "new_prompt": new_prompt}


def end_play(page, timeout: float) -> dict:
    page.locator(".wan-accel-play").get_by_role("button", name="End").click()
    return _wait_play(page, "p.ended.length > 0", timeout, "the end")["ended"][-1]


def panel_counts(page) -> dict:
    return page.eval_on_selector_all(
        ".wan-accel-panel [data-namespace]",
        "els => Object.fromEntries(els.map(e => [e.getAttribute('data-namespace'), e.getAttribute('data-total')]))")


def clear_from_panel(page, namespace: str, out_dir: Path) -> dict:
    """Press the namespace's Clear button, screenshot the confirmation and accept it."""
    box = page.locator(f".wan-accel-panel [data-namespace='{namespace}']")
    before = panel_counts(page)
    box.get_by_role("button", name="Clear").click()
    dialog = page.locator("[role=dialog]").last
    dialog.wait_for(timeout=10000)
    res = {"before": before, "dialog": dialog.inner_text()[:300]}
    shot = out_dir / "panel_clear_confirm.png"
    page.screenshot(path=str(shot))
    res["screenshot"] = str(shot)
    dialog.get_by_role("button", name="Delete").or_(dialog.get_by_role("button", name="Confirm")).first.click()
    page.wait_for_function(
        "([ns]) => { const e = document.querySelector(`.wan-accel-panel [data-namespace='${ns}']`);"
        " return e && e.getAttribute('data-total') === '0'; }", arg=[namespace], timeout=15000)
    res["after"] = panel_counts(page)
    return res


def open_panel(page, out_dir: Path) -> dict:
    button = page.locator(".wan-accel-limits-tab-button")
    res = {"tab_button": button.count()}
    if button.count():
        button.first.click()
    else:  # frontends without sidebar tabs get a floating button
        page.get_by_role("button", name="Wan Accel").first.click()
    page.wait_for_selector(".wan-accel-panel [data-namespace]", timeout=15000)
    res["namespaces"] = list(panel_counts(page))
    shot = out_dir / "panel.png"
    page.screenshot(path=str(shot))
    res["screenshot"] = str(shot)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--workflow", action="append", default=[], help="UI-format workflow file (repeatable)")
    ap.add_argument("--api-dir", help="folder with API-format copies (same file names) to compare with")
    ap.add_argument("--out-dir", required=True, help="folder for screenshots")
    ap.add_argument("--queue", action="append", default=[],
                    help="file stem of a workflow to run through the UI after loading it (repeatable)")
    ap.add_argument("--panel", action="store_true", help="open the pack's sidebar panel and screenshot it")
    ap.add_argument("--clear", help="with --panel: clear this namespace with the panel's button (confirming)")
    ap.add_argument("--live", help="API-format prompt to queue from the page, recording the live frames it sends")
    ap.add_argument("--play", help="API-format prompt with a Matrix-Game-2 Play Session node: play it from the panel")
    ap.add_argument("--prompt-play", help="API-format prompt with a CausalWan Prompt Play Session node: play it "
                    "from the panel, typing a new prompt mid-stream")
    ap.add_argument("--report", help="write the JSON report here")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM") or shutil.which("chromium") or "chromium")
    args = ap.parse_args()
    base = args.url.rstrip("/")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"workflows": [], "console_errors": [], "page_errors": []}
    status = 0
    profile = tempfile.mkdtemp(prefix="wan_accel_browser_")
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=args.chromium, headless=True,
                                                        args=FLAGS, viewport={"width": 1920, "height": 1080})
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.on("console", lambda m: m.type == "error" and report["console_errors"].append(m.text[:300]))
                page.on("pageerror", lambda e: report["page_errors"].append(str(e)[:300]))
                page.goto(base + "/", wait_until="domcontentloaded", timeout=args.timeout * 1000)
                page.wait_for_function("() => !!(window.app && window.app.graph && window.app.canvas)",
                                       timeout=args.timeout * 1000)
                page.wait_for_timeout(2500)
                close_dialogs(page, report)
                page.evaluate(SCREENSHOT_SETTINGS)
                report["extension_loaded"] = page.evaluate(
                    "() => (window.app.extensions || []).some(e => e.name === 'wan_accel.panel')")
                known = get_json(base + "/object_info")
                api_dir = Path(args.api_dir) if args.api_dir else None
                for wf in args.workflow:
                    res = check_workflow(page, Path(wf), api_dir, known, out_dir)
                    if Path(wf).stem in args.queue:
                        res["run"] = run_queued(page, base, args.timeout, out_dir, Path(wf).stem)
                        if res["run"]["status"] != "success" or not res["run"].get("saved_widgets_unchanged"):
                            res["problems"].append(f"run: {res['run']}")
                    report["workflows"].append(res)
                    if res["problems"]:
                        status = 1
                if args.live:
                    report["live"] = run_live(page, base, Path(args.live), args.timeout, out_dir)
                    if not report["live"]["events"]:
                        status = 1
                if args.play:
                    report["play"] = run_play(page, Path(args.play), args.timeout, out_dir)
                    report["play"]["ended"] = end_play(page, args.timeout)
                if args.prompt_play:
                    report["prompt_play"] = run_prompt_play(page, Path(args.prompt_play), args.timeout, out_dir)
                    report["prompt_play"]["ended"] = end_play(page, args.timeout)
                if args.panel:
                    report["panel"] = open_panel(page, out_dir)
                    if args.clear:
                        report["panel"]["clear"] = clear_from_panel(page, args.clear, out_dir)
                if not report["extension_loaded"]:
                    status = 1
            finally:
                ctx.close()
    except Exception as exc:  # noqa: BLE001 - reported as exit status 2
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        status = 2
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    report["exit_status"] = status
    text = json.dumps(report, indent=1)
    if args.report:
        Path(args.report).write_text(text, encoding="utf-8")
    print(json.dumps({k: v for k, v in report.items() if k != "workflows"} | {
        "workflows": [{k: v for k, v in w.items() if k not in ("serialized", "prompt")} for w in report["workflows"]]},
        indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
