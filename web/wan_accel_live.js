// Live frames of comfyui-wan-accel: the CausalWan Sampler + Decode node sends each decoded chunk's frames
// (event "wan_accel.frames": node, chunk, chunks, first_frame, fps, latency_s, frames as base64 JPEG) while it
// samples; they play in the node (and in the pack's panel when it is open) at the video's frame rate with the
// chunk's latency shown.
// window.__wanAccelLive keeps an arrival log (time, node, chunk, frame count) and the prompt end times, read by the
// end-to-end check.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { el, feedFrames } from "./wan_accel.js";

const EVENT = "wan_accel.frames";
const LIVE_WIDGET = "wan_accel_live";
const log = (window.__wanAccelLive = window.__wanAccelLive || { events: [], ends: [] });

function makePlayer(box, imgHeight) {
  const img = el("img", { style: { width: "100%", height: imgHeight, objectFit: "contain", display: "block",
                                   background: "#000" } });
  const caption = el("div", { style: { font: "11px monospace", color: "var(--input-text, #ddd)", height: "18px",
                                       whiteSpace: "nowrap", overflow: "hidden" } });
  box.append(img, caption);
  const player = { img, frames: [], shown: 0, fps: 16, timer: null, info: "" };
  player.onFrame = () => { caption.textContent = `frame ${player.shown}/${player.frames.length} · ${player.info}`; };
  return player;
}

function livePlayer(node) {
  let widget = node.widgets?.find((w) => w.name === LIVE_WIDGET);
  if (widget) return widget._player;
  const box = el("div", { class: "wan-accel-live", style: { width: "100%", height: "100%", boxSizing: "border-box" } });
  const player = makePlayer(box, "calc(100% - 18px)");
  widget = node.addDOMWidget(LIVE_WIDGET, "wan_accel_live", box, { serialize: false, hideOnZoom: false,
                                                                   getMinHeight: () => 220 });
  widget.serialize = false;
  widget._player = player;
  node.setSize?.([Math.max(node.size[0], 360), node.size[1] + 240]);
  return player;
}

// The pack's panel (when open) shows the newest live video too, above the limit cache.
function panelPlayer() {
  const panel = document.querySelector(".wan-accel-panel");
  if (!panel?.parentElement) return null;
  const host = panel.parentElement;
  let box = host.querySelector(".wan-accel-panel-live");
  if (!box) {
    box = el("div", { class: "wan-accel-panel-live",
                      style: { padding: "8px", borderBottom: "1px solid var(--border-color, #444)" } },
             el("b", {}, "Live frames"));
    box._player = makePlayer(box, "200px");
    host.prepend(box);
  }
  return box._player;
}

function feed(player, d) {
  if (d.chunk === 0 || d.first_frame === 0) { player.frames = []; player.shown = 0; }
  player.info = `node ${d.node} · chunk ${d.chunk + 1}/${d.chunks} · ${Math.round((d.latency_s || 0) * 1000)} ms`;
  feedFrames(player, d);
}

api.addEventListener(EVENT, (ev) => {
  const d = ev.detail || {};
  log.events.push({ t: performance.now(), node: d.node, chunk: d.chunk, frames: (d.frames || []).length,
                    latency_s: d.latency_s });
  const panel = panelPlayer();
  if (panel) feed(panel, d);
  const node = app.graph?.getNodeById?.(Number(d.node)) ?? app.graph?.getNodeById?.(d.node);
  if (!node) return;
  feed(livePlayer(node), d);
  node.setDirtyCanvas?.(true, true);
});

for (const name of ["execution_success", "execution_error", "execution_interrupted"]) {
  api.addEventListener(name, (ev) => log.ends.push({ t: performance.now(), kind: name,
                                                     prompt_id: ev.detail?.prompt_id }));
}

app.registerExtension({ name: "wan_accel.live" });
