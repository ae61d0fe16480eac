// Live frames of comfyui-wan-accel: the CausalWan Sampler + Decode node sends each decoded chunk's frames
// (event "wan_accel.frames": node, chunk, chunks, first_frame, fps, latency_s, frames as base64 JPEG) while it
// samples; they play in the node at the video's frame rate with the chunk's latency shown.
// window.__wanAccelLive keeps an arrival log (time, node, chunk, frame count) and the prompt end times, read by the
// end-to-end check.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EVENT = "wan_accel.frames";
const LIVE_WIDGET = "wan_accel_live";
const log = (window.__wanAccelLive = window.__wanAccelLive || { events: [], ends: [] });

function livePlayer(node) {
  let widget = node.widgets?.find((w) => w.name === LIVE_WIDGET);
  if (widget) return widget._player;
  const img = document.createElement("img");
  Object.assign(img.style, { width: "100%", height: "calc(100% - 18px)", objectFit: "contain", display: "block",
                             background: "#000" });
  const caption = document.createElement("div");
  Object.assign(caption.style, { font: "11px monospace", color: "var(--input-text, #ddd)", height: "18px",
                                 whiteSpace: "nowrap", overflow: "hidden" });
  const box = document.createElement("div");
  box.className = "wan-accel-live";
  Object.assign(box.style, { width: "100%", height: "100%", boxSizing: "border-box" });
  box.append(img, caption);
  widget = node.addDOMWidget(LIVE_WIDGET, "wan_accel_live", box, { serialize: false, hideOnZoom: false,
                                                                   getMinHeight: () => 220 });
  widget.serialize = false;
  const player = { img, caption, frames: [], shown: 0, fps: 16, timer: null, info: "" };
  widget._player = player;
  node.setSize?.([Math.max(node.size[0], 360), node.size[1] + 240]);
  return player;
}

function play(player) {
  if (player.timer) return;
  player.timer = setInterval(() => {
    if (player.shown >= player.frames.length) {    // caught up: wait for the next chunk
      clearInterval(player.timer);
      player.timer = null;
      return;
    }
    player.img.src = "data:image/jpeg;base64," + player.frames[player.shown];
    player.shown += 1;
    player.caption.textContent = `frame ${player.shown}/${player.frames.length} · ${player.info}`;
  }, 1000 / player.fps);
}

api.addEventListener(EVENT, (ev) => {
  const d = ev.detail || {};
  log.events.push({ t: performance.now(), node: d.node, chunk: d.chunk, frames: (d.frames || []).length,
                    latency_s: d.latency_s });
  const node = app.graph?.getNodeById?.(Number(d.node)) ?? app.graph?.getNodeById?.(d.node);
  if (!node) return;
  const player = livePlayer(node);
  if (d.chunk === 0 || d.first_frame === 0) { player.frames = []; player.shown = 0; }
  player.fps = d.fps || 16;
  player.frames.push(...(d.frames || []));
  player.info = `chunk ${d.chunk + 1}/${d.chunks} · ${Math.round((d.latency_s || 0) * 1000)} ms`;
  play(player);
  node.setDirtyCanvas?.(true, true);
});

for (const name of ["execution_success", "execution_error", "execution_interrupted"]) {
  api.addEventListener(name, () => log.ends.push({ t: performance.now(), kind: name }));
}

app.registerExtension({ name: "wan_accel.live" });
