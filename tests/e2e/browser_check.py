#!/usr/bin/env python3
"""Browser half of the end-to-end check; runs with ComfyUI's Python (it needs Playwright and a system Chromium).

The page runs with the renderer asked for (--renderer: ``classic``, the LiteGraph canvas, or ``vue``, Nodes 2.0:
the setting ``Comfy.VueNodes.Enabled`` set through ``app.extensionManager.setting``). For each UI-format workflow:
load it into the running ComfyUI page (``app.loadGraphData``), fit the view, save a screenshot, and report the graph
as the frontend sees it: node types the server does not know, nodes flagged with errors, widget values after
loading (compared with the file), the API prompt the frontend builds (``app.graphToPrompt``, compared with the API
copy), the pack's badges as they show on the page, and every node's box on the page (a DOM node's box under
Nodes 2.0, the canvas' node bounds otherwise) with the pairs of nodes that overlap. Optionally runs workflows
through the Run path (``app.queuePrompt``), shows the compile badges following their widgets beside a node's report
text (--showcase), plays live frames, and opens the pack's sidebar panel. Prints a JSON report (also to --report).
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

from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]



# Page-side helpers, installed before the page's own scripts run (window.__wanAccelCheck).
PAGE_HELPERS = """
window.__wanAccelCheck = (() => {
// the box of every node on the page, in page pixels: its DOM element under Nodes 2.0, else the canvas' node bounds
// (title bar included) mapped to the page
function NODE_BOXES() {
  const app = window.app, ds = app.canvas.ds, cr = app.canvas.canvas.getBoundingClientRect();
  return app.graph.nodes.map((n) => {
    const el = LiteGraph.vueNodesMode ? document.querySelector(`.lg-node[data-node-id="${n.id}"]`) : null;
    let box = null;
    if (el) { const r = el.getBoundingClientRect(); box = [r.left, r.top, r.width, r.height]; }
    else if (!LiteGraph.vueNodesMode) {
      const b = n.getBounding(), [x, y] = ds.convertOffsetToCanvas([b[0], b[1]]);
      box = [cr.left + x, cr.top + y, b[2] * ds.scale, b[3] * ds.scale];
    }
    return {id: String(n.id), type: n.type, box};
  });
}
// the pack's badge rows that a person can see: attached, laid out, not hidden
function SHOWN_BADGES() {
  const out = {};
  for (const row of document.querySelectorAll('.wan-accel-badges')) {
    const r = row.getBoundingClientRect();
    const seen = row.isConnected && r.width > 0 && r.height > 0 && (!row.checkVisibility || row.checkVisibility())
      && r.bottom > 0 && r.right > 0 && r.top < innerHeight && r.left < innerWidth;
    if (seen) out[row.dataset.wanAccelNode] = [...row.querySelectorAll('[data-badge]')].map(b => b.dataset.badge);
  }
  return out;
}
// the pack's report text boxes that a person can see, by node
function SHOWN_TEXT() {
  const out = {};
  for (const area of document.querySelectorAll('textarea.wan-accel-text')) {
    const r = area.getBoundingClientRect();
    if (area.isConnected && r.width > 0 && r.height > 0 && (!area.checkVisibility || area.checkVisibility()))
      out[area.dataset.wanAccelNode] = area.value;
  }
  return out;
}
return {nodeBoxes: NODE_BOXES, shownBadges: SHOWN_BADGES, shownText: SHOWN_TEXT};
})();
"""

# Until the page shows the graph as loaded: under Nodes 2.0 every node mounted; every node's box the same for a few
# animation frames (Nodes 2.0 lays nodes out after they mount).
SETTLED = """() => {
  const boxes = __wanAccelCheck.nodeBoxes();
  if (boxes.some(b => !b.box)) return false;
  const key = JSON.stringify(boxes);
  const s = window.__wanAccelSettle || (window.__wanAccelSettle = {key: '', frames: 0});
  s.frames = s.key === key ? s.frames + 1 : 0;
  s.key = key;
  return s.frames >= 3;
}"""


GRAPH_STATE = """async () => {
  const app = window.app;
  const nodes = app.graph.nodes.map(n => ({
    id: n.id, type: n.type, virtual: !!n.isVirtualNode, has_errors: !!n.has_errors,
    registered: !!LiteGraph.registered_node_types[n.type],
    // combo values the server does not offer (a model file that is not installed here)
    unavailable: (n.widgets || []).filter(w => w.type === 'combo' && Array.isArray(w.options?.values)
                                           && !w.options.values.includes(w.value)).map(w => w.name),
  }));
  const serialized = app.graph.serialize();
  const prompt = (await app.graphToPrompt()).output;
  return JSON.parse(JSON.stringify({nodes, serialized, prompt, boxes: __wanAccelCheck.nodeBoxes(), badges: __wanAccelCheck.shownBadges()}));
}"""


def settle(page, timeout_s: float = 30) -> None:
    page.evaluate("() => { window.__wanAccelSettle = null; }")
    page.wait_for_function(SETTLED, polling="raf", timeout=timeout_s * 1000)


def overlaps(boxes: list[dict], tolerance: float = 1.0) -> list[dict]:
    """Pairs of nodes whose boxes on the page overlap by more than ``tolerance`` pixels both ways."""
    out = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            (ax, ay, aw, ah), (bx, by, bw, bh) = a["box"], b["box"]
            dx = min(ax + aw, bx + bw) - max(ax, bx)
            dy = min(ay + ah, by + bh) - max(ay, by)
            if dx > tolerance and dy > tolerance:
                out.append({"nodes": [a["id"], b["id"]], "types": [a["type"], b["type"]],
                            "overlap_px": [round(dx, 1), round(dy, 1)]})
    return out


def get_json(url: str, timeout: float = 30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def post_setting(base: str, key: str, value) -> None:
    """Set one of the user's frontend settings on the server (before the page reads them)."""
    req = urllib.request.Request(f"{base}/settings/{key}", data=json.dumps(value).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30):
        pass


def close_dialogs(page, report: dict) -> None:
    """Note and close the dialogs the page opened by itself (e.g. missing models), waiting for each to go."""
    dialogs = page.locator("[role=dialog]")
    for _ in range(3):
        if not dialogs.count():
            return
        report.setdefault("dialogs", []).append(dialogs.first.inner_text()[:500])
        count = dialogs.count()
        page.keyboard.press("Escape")
        page.wait_for_function("(n) => document.querySelectorAll('[role=dialog]').length < n", arg=count,
                               timeout=10000)

# the page is up: the app, its graph and canvas, its settings, and the pack's extension registered
PAGE_READY = """() => !!(window.app && window.app.graph && window.app.canvas && window.app.extensionManager?.setting
  && (window.app.extensions || []).some(e => e.name === 'wan_accel.panel'))"""


def set_renderer(page, renderer: str) -> str:
    """Switch Nodes 2.0 on (``vue``) or off (``classic``) through the settings API and wait until the canvas runs
    that way; the renderer the page then uses."""
    want = renderer == "vue"
    page.evaluate("async (on) => { await window.app.extensionManager.setting.set('Comfy.VueNodes.Enabled', on); }",
                  want)
    page.wait_for_function("(on) => !!LiteGraph.vueNodesMode === on", arg=want, timeout=30000)
    return "vue" if page.evaluate("() => !!LiteGraph.vueNodesMode") else "classic"


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


def load_graph(page, wf: dict) -> None:
    page.evaluate("async (wf) => { await window.app.loadGraphData(wf); }", wf)
    settle(page)


def fit_view(page) -> None:
    page.evaluate("async () => { await window.app.extensionManager.command.execute('Comfy.Canvas.FitView');"
                  " window.app.canvas.setDirty(true, true); }")
    settle(page)


def check_workflow(page, path: Path, api_dir: Path | None, known: dict, out_dir: Path) -> dict:
    wf = json.loads(path.read_text(encoding="utf-8"))
    res = {"workflow": path.stem, "problems": []}
    load_graph(page, wf)
    close_dialogs(page, res)
    fit_view(page)
    overlay = page.locator("[data-testid=error-overlay-dismiss]")
    if overlay.count():  # the frontend's error summary (e.g. model files not installed here); kept in the report
        res["error_overlay"] = overlay.first.locator("xpath=..").inner_text()[:300]
    close_toasts(page)
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
    res["badges"] = {k: v for k, v in state["badges"].items() if v}
    res["boxes"] = state["boxes"]
    res["overlaps"] = overlaps(state["boxes"])
    if res["missing_node_types"] or res["unregistered"]:
        res["problems"].append(f"missing node types {res['missing_node_types'] or res['unregistered']}")
    if res["nodes_with_errors"]:
        res["problems"].append(f"nodes with errors {res['nodes_with_errors']}")
    if res["overlaps"]:
        res["problems"].append(f"nodes overlap on the page: {res['overlaps']}")
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


def _queue_and_wait(page, timeout: float) -> None:
    """Queue the page's graph (the Run path) and wait for the prompt's end event (web/wan_accel_live.js logs them)."""
    ends = page.evaluate("() => window.__wanAccelLive.ends.length")
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")
    page.wait_for_function("(n) => window.__wanAccelLive.ends.length > n", arg=ends, timeout=timeout * 1000)


def run_queued(page, base: str, timeout: float, out_dir: Path, stem: str) -> dict:
    before = set(get_json(base + "/history"))
    saved_before = page.evaluate(SAVED_WIDGETS)
    try:
        _queue_and_wait(page, timeout)
    except PlaywrightTimeout:
        pass                                     # reported below: not queued, or not finished
    new = [v for k, v in get_json(base + "/history").items() if k not in before]
    shot = out_dir / f"{stem}_after_run.png"
    if not new:
        page.screenshot(path=str(shot))
        return {"status": "not queued", "screenshot": str(shot)}
    status = new[-1].get("status", {})
    # every node that reported text shows it on the page
    texts = {k: "\n".join(map(str, v["text"])) for k, v in (new[-1].get("outputs") or {}).items() if v.get("text")}
    try:
        page.wait_for_function("(want) => { const shown = __wanAccelCheck.shownText();"
                               " return Object.entries(want).every(([k, t]) => shown[k] === t); }",
                               arg=texts, timeout=15000)
    except PlaywrightTimeout:
        pass                                     # reported below: the text boxes the page shows
    settle(page)
    page.screenshot(path=str(shot))
    errors = [m[1] for m in status.get("messages", []) if m[0] == "execution_error"]
    # what a run adds to nodes (text boxes, previews) must not end up in a saved workflow
    saved_after = page.evaluate(SAVED_WIDGETS)
    shown = page.evaluate("() => __wanAccelCheck.shownText()")
    return {"status": status.get("status_str"), "outputs": new[-1].get("outputs"), "screenshot": str(shot),
            "errors": [{k: e.get(k) for k in ("node_id", "node_type", "exception_message")} for e in errors],
            "saved_widgets_unchanged": saved_before == saved_after,
            "text_reported": sorted(texts), "text_boxes": sorted(k for k, v in shown.items() if v),
            "text_shown": all(shown.get(k) == t for k, t in texts.items())}


SHOWCASE_ADD = """() => {
  const app = window.app;
  const host = app.graph.nodes.find(n => n.type === 'WanAccelLimitCache') || app.graph.nodes[0];
  const node = LiteGraph.createNode('WanAccelCompileSettings');
  const b = host.getBounding();
  node.pos = [b[0], b[1] + b[3] + 70];
  app.graph.add(node);
  const ds = app.canvas.ds;
  ds.scale = 1;
  ds.offset = [-b[0] + 440, -b[1] + 60];
  app.canvas.setDirty(true, true);
  return [String(host.id), String(node.id)];
}"""

SET_WIDGET = """([id, name, value]) => {
  // what the frontend does when a person changes the widget (either renderer): the value, then its callback
  const node = window.app.graph.getNodeById(id);
  const w = node.widgets.find(w => w.name === name);
  w.value = value;
  w.callback?.(value, window.app.canvas, node);
}"""


def _union(boxes: list, margin: float) -> dict:
    x0 = max(0, min(b[0] for b in boxes) - margin)
    y0 = max(0, min(b[1] for b in boxes) - margin)
    x1 = max(b[0] + b[2] for b in boxes) + margin
    y1 = max(b[1] + b[3] for b in boxes) + margin
    return {"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0}


def run_showcase(page, out_dir: Path, name: str) -> dict:
    """After a run of tiny_smoke: a Wan Compile Settings node added under the Limit Cache node (whose report text
    shows); its badges followed through widget changes (EXTREME-PLUS and GLOBAL OPS LOCKED on, then the lock off);
    a JPEG of the two nodes (``<name>.jpg``)."""
    host, node = page.evaluate(SHOWCASE_ADD)
    shown = lambda: page.evaluate("(id) => __wanAccelCheck.shownBadges()[id] || null", node)

    def change(name_value: list, want: list) -> list | None:
        for widget, value in name_value:
            page.evaluate(SET_WIDGET, [node, widget, value])
        try:
            page.wait_for_function("([id, want]) => JSON.stringify(__wanAccelCheck.shownBadges()[id] || null)"
                                   " === JSON.stringify(want)", arg=[node, want], timeout=10000)
        except PlaywrightTimeout:
            pass                                 # reported: what the page shows
        settle(page)
        return shown()

    settle(page)
    res = {"node": node, "host": host, "added": shown()}
    res["both_on"] = change([["tiling_preset", "EXTREME-PLUS"], ["lock_global_ops", True]],
                            ["EXTREME-PLUS", "GLOBAL OPS LOCKED"])
    res["text_shown"] = bool(page.evaluate("(id) => __wanAccelCheck.shownText()[id]", host))
    boxes = {b["id"]: b["box"] for b in page.evaluate("() => __wanAccelCheck.nodeBoxes()")}
    shot = out_dir / f"{name}.jpg"
    page.screenshot(path=str(shot), type="jpeg", quality=80, clip=_union([boxes[host], boxes[node]], 16))
    res["screenshot"] = str(shot)
    res["lock_off"] = change([["lock_global_ops", False]], ["EXTREME-PLUS"])
    return res


TAB = '[data-testid="side-toolbar"] button[aria-label="Wan Accel: limit cache"]'


def open_panel_tab(page) -> int:
    """Open the pack's panel (if it is not open): its side-bar tab button, found by its label (the same in every
    frontend this check knows), or the floating button of frontends without side-bar tabs. The tab button count."""
    tab = page.locator(TAB)
    count = tab.count()
    if not page.locator(".wan-accel-panel").count():
        if count:
            tab.first.click()
        else:
            page.get_by_role("button", name="Wan Accel").first.click()
    page.wait_for_selector(".wan-accel-panel", timeout=15000)
    return count


PLAYED_OUT = """() => {
  // every player (the node's, the panel's) shows the last of the frames that came
  const total = window.__wanAccelLive.events.reduce((a, e) => a + e.frames, 0);
  const captions = [...document.querySelectorAll('.wan-accel-live > div, .wan-accel-panel-live > div')];
  return total > 0 && captions.length >= 2 && captions.every(c => c.textContent.startsWith(`frame ${total}/${total} `));
}"""

PLAYERS = """() => [...document.querySelectorAll('.wan-accel-live, .wan-accel-panel-live')].map(b => {
  const img = b.querySelector('img'), r = img.getBoundingClientRect();
  return {where: b.classList.contains('wan-accel-panel-live') ? 'panel' : 'node', playing: img.src.startsWith('data:image/jpeg'),
          shown: r.width > 0 && r.height > 0 && (!img.checkVisibility || img.checkVisibility()),
          caption: b.querySelector(':scope > div')?.textContent || ''};
})"""


def run_live(page, base: str, api_path: Path, timeout: float, out_dir: Path) -> dict:
    """Load an API-format prompt, queue it from the page and record when the pack's live frames arrive
    (``window.__wanAccelLive``, kept by web/wan_accel_live.js) against when the prompt ends; screenshots of the
    node while frames play and after the run."""
    prompt = json.loads(api_path.read_text())
    page.evaluate("async (p) => { await window.app.loadApiJson(p, 'streaming_live'); }", prompt)
    settle(page)
    open_panel_tab(page)                                      # the panel open: it plays the frames too
    page.evaluate("() => { window.__wanAccelLive.events.length = 0; window.__wanAccelLive.ends.length = 0; }")
    queued = page.evaluate("async () => { const t = performance.now(); await window.app.queuePrompt(0, 1); return t; }")
    mid = None
    try:
        page.wait_for_function("() => [...document.querySelectorAll('.wan-accel-live img')]"
                               ".some(i => i.src.startsWith('data:image/jpeg'))", timeout=timeout * 1000)
        fit_view(page)
        mid = out_dir / "streaming_live_during_run.png"
        page.screenshot(path=str(mid))
    except PlaywrightTimeout:
        pass                                                  # reported below: no frames
    page.wait_for_function("() => window.__wanAccelLive.ends.length > 0", timeout=timeout * 1000)
    try:
        page.wait_for_function(PLAYED_OUT, timeout=30000)
    except PlaywrightTimeout:
        pass                                                  # reported below: the players' state
    fit_view(page)
    after = out_dir / "streaming_live_after_run.png"
    page.screenshot(path=str(after))
    log = page.evaluate("() => JSON.parse(JSON.stringify(window.__wanAccelLive))")
    players = page.evaluate(PLAYERS)
    return {"queued_at": queued, "events": log["events"], "ends": log["ends"], "players": players,
            "played_out": page.evaluate(PLAYED_OUT),
            "panel_playing": any(p["where"] == "panel" and p["playing"] for p in players),
            "node_playing": any(p["where"] == "node" and p["playing"] and p["shown"] for p in players),
            "screenshot_during": str(mid) if mid else None, "screenshot_after": str(after)}


PLAY_LOG = "() => JSON.parse(JSON.stringify(window.__wanAccelPlay || {}))"
# every chunk asked for has come, its prompt has ended on the server (what the server records of a chunk is
# complete then; web/wan_accel_live.js logs every prompt's end) and its frames have played (the play box shows the
# last one)
PLAYED = ("p.chunks.length >= p.sent.length && p.sent.every(s => window.__wanAccelLive.ends.some("
          "e => e.prompt_id === s.prompt_id)) && p.shown >= p.frames")


def _wait_play(page, condition: str, timeout: float, what: str) -> dict:
    """Wait until ``condition`` (a JS expression over ``p``, the page's play log) holds; the log then."""
    try:
        page.wait_for_function(f"() => {{ const p = window.__wanAccelPlay; return !!(p && ({condition})); }}",
                               timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise TimeoutError(f"play mode: {what} did not happen in {timeout:.0f} s; "
                           f"log: {json.dumps(page.evaluate(PLAY_LOG))[:1500]}") from None
    return page.evaluate(PLAY_LOG)


def _start_session(page, api_path: Path, name: str, timeout: float):
    """Load the graph (API form) as workflow ``name``, open the Wan Accel panel and press Start session; returns the
    play box once the session is ready."""
    prompt = json.loads(api_path.read_text())
    page.evaluate("async ([p, n]) => { await window.app.loadApiJson(p, n); }", [prompt, name])
    settle(page)
    open_panel_tab(page)
    page.wait_for_selector(".wan-accel-play", timeout=15000)
    # a fresh log for this session (an earlier session of the same page logged into it too)
    page.evaluate("() => { const p = window.__wanAccelPlay;"
                  " for (const k of Object.keys(p)) if (Array.isArray(p[k])) p[k].length = 0; }")
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
    box.get_by_role("button", name="Play").click()
    sent = lambda cond: f"p.sent.some(s => {cond}) && p.chunks.length >= p.sent.length"
    page.keyboard.down("w")                              # held until a chunk was asked for with it, and made
    _wait_play(page, sent("s.keys === 'w'"), timeout, "a chunk with W held")
    page.keyboard.up("w")
    img = page.locator(".wan-accel-play-video").bounding_box()
    cx, cy = img["x"] + img["width"] / 2, img["y"] + img["height"] / 2
    page.mouse.move(cx, cy)
    page.mouse.down()
    page.mouse.move(cx + 60, cy, steps=6)                # a 60 px drag to the right: the camera turns right
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
    log = _wait_play(page, PLAYED, timeout, "the last chunk after Pause, played out")
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
    box.get_by_role("button", name="Play").click()
    _wait_play(page, "p.chunks.length >= 2", timeout, "two chunks with the first prompt")
    field = page.locator(".wan-accel-play-prompt")
    field.click()
    field.fill(new_prompt)                               # typed while the video plays
    _wait_play(page, f"p.sent.some(s => s.prompt === {json.dumps(new_prompt)}) && "
                     f"p.chunks.length >= p.sent.findIndex(s => s.prompt === {json.dumps(new_prompt)}) + 2",
               timeout, "two chunks after the new prompt")
    box.get_by_role("button", name="Pause").click()
    log = _wait_play(page, PLAYED, timeout, "the last chunk after Pause, played out")
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
    res = {"tab_button": open_panel_tab(page)}
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
    ap.add_argument("--renderer", choices=["classic", "vue"], default="classic",
                    help="classic: the LiteGraph canvas; vue: Nodes 2.0 (setting Comfy.VueNodes.Enabled)")
    ap.add_argument("--showcase", action="store_true", help="with --queue tiny_smoke: add a Wan Compile Settings "
                    "node after the run, follow its badges through widget changes and save a JPEG of it beside the "
                    "Limit Cache node's report text (web_<frontend version>_<renderer>.jpg)")
    ap.add_argument("--report", help="write the JSON report here")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM") or shutil.which("chromium") or "chromium")
    args = ap.parse_args()
    base = args.url.rstrip("/")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"workflows": [], "console_errors": [], "page_errors": [], "seconds": {}}
    mark = [time.monotonic()]

    def took(step: str) -> None:                  # how long each part took (the report's "seconds")
        now = time.monotonic()
        report["seconds"][step] = round(now - mark[0], 1)
        mark[0] = now
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
                page.add_init_script(PAGE_HELPERS)
                post_setting(base, "Comfy.TutorialCompleted", True)    # no first-run template browser on top
                page.goto(base + "/", wait_until="domcontentloaded", timeout=args.timeout * 1000)
                page.wait_for_function(PAGE_READY, timeout=args.timeout * 1000)
                close_dialogs(page, report)
                page.evaluate(SCREENSHOT_SETTINGS)
                report["renderer"] = set_renderer(page, args.renderer)
                report["frontend_version"] = page.evaluate("() => window.__COMFYUI_FRONTEND_VERSION__ || null")
                report["extension_loaded"] = page.evaluate(
                    "() => (window.app.extensions || []).some(e => e.name === 'wan_accel.panel')")
                took("page")
                known = get_json(base + "/object_info")
                api_dir = Path(args.api_dir) if args.api_dir else None
                for wf in args.workflow:
                    res = check_workflow(page, Path(wf), api_dir, known, out_dir)
                    if Path(wf).stem in args.queue:
                        res["run"] = run_queued(page, base, args.timeout, out_dir, Path(wf).stem)
                        if res["run"]["status"] != "success" or not res["run"].get("saved_widgets_unchanged") \
                                or not res["run"].get("text_shown"):
                            res["problems"].append(f"run: {res['run']}")
                        if args.showcase and Path(wf).stem == "tiny_smoke":
                            name = f"web_{report['frontend_version']}_{report['renderer']}"
                            report["showcase"] = run_showcase(page, out_dir, name)
                    report["workflows"].append(res)
                    if res["problems"]:
                        status = 1
                took("workflows")
                if args.live:
                    report["live"] = run_live(page, base, Path(args.live), args.timeout, out_dir)
                    if not report["live"]["events"]:
                        status = 1
                took("live")
                if args.play:
                    report["play"] = run_play(page, Path(args.play), args.timeout, out_dir)
                    report["play"]["ended"] = end_play(page, args.timeout)
                if args.prompt_play:
                    report["prompt_play"] = run_prompt_play(page, Path(args.prompt_play), args.timeout, out_dir)
                    report["prompt_play"]["ended"] = end_play(page, args.timeout)
                took("play")
                if args.panel:
                    report["panel"] = open_panel(page, out_dir)
                    if args.clear:
                        report["panel"]["clear"] = clear_from_panel(page, args.clear, out_dir)
                took("panel")
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
