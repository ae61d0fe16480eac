// Matrix-Game-2 play mode of comfyui-wan-accel, in the pack's panel.
//  * "Start session" runs the graph holding a Matrix-Game-2 Play Session node (it loads the model and the start
//    image and registers a session; event "wan_accel.play", kind "ready").
//  * Play: each chunk is one short prompt (MatrixGame2PlayStep) queued with the keys held since the last chunk
//    was asked for (W A S D, or the checkpoint's keys; arrows turn the camera) and the mouse drag over the video
//    (camera pitch/yaw); the next chunk is asked for when this one's frames arrive (kind "chunk") and have nearly
//    played out (no growing backlog between the keys and the screen), so other prompts never wait longer than
//    one chunk. Pause stops asking; Resume goes on. Save queues MatrixGame2PlaySave (the
//    video, the Game Actions script, the latent). End frees the session's memory at once; a session nobody plays
//    or watches is freed by the server after its idle timeout (the panel tells the server it is watching).
// A prompt play session (CausalWan Prompt Play Session, a causal text-to-video model) plays the same way with a
// text box instead of keys: each chunk is asked for with the prompt in the box (CausalWanPromptPlayStep), which takes
// effect at that chunk; Save writes the video and the prompt schedule that reproduces it.
// window.__wanAccelPlay keeps what was sent and what arrived (and how many frames have played), read by the
// end-to-end check.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { STYLE, callJson, el, feedFrames, playFrames, toast as toastFor } from "./wan_accel.js";

const EVENT = "wan_accel.play";
const SESSION_NODES = ["MatrixGame2PlaySession", "CausalWanPromptPlaySession"];
const isText = () => S.info?.type === "t2v";
const HEARTBEAT_MS = 20000;
const DRAG_PER_PX = 0.002;          // camera motion per pixel dragged during a chunk (50 px -> 0.1, the demos' value)
const DRAG_MAX = 0.3;
const LOOK = 0.1;
const TEMPLERUN_KEYS = { " ": "jump", arrowup: "jump", arrowdown: "slide", s: "slide", q: "turnleft",
                         e: "turnright", a: "leftside", arrowleft: "leftside", d: "rightside",
                         arrowright: "rightside", x: "nomove" };
const CAMERA_KEYS = { arrowup: [LOOK, 0], arrowdown: [-LOOK, 0], arrowleft: [0, -LOOK], arrowright: [0, LOOK] };

const log = (window.__wanAccelPlay = window.__wanAccelPlay || { sent: [], chunks: [], saved: [], ended: [],
                                                                 ready: [], errors: [] });
// S is play mode's frame player too (img, frames, shown, fps, timer, onFrame: see playFrames in wan_accel.js).
const S = { session: null, info: null, playing: false, waiting: null, held: new Set(), tapped: new Set(),
            drag: [0, 0], dragging: null, frames: [], shown: 0, fps: 16, timer: null, view: null, beat: null,
            onFrame: () => { log.shown = S.shown; } };

const BUTTON = { ...STYLE.button, marginRight: "4px" };

const toast = (severity, summary, detail) => toastFor(severity, summary, detail, 5000);

// One-node prompt for this page (its events come back here).
async function queueNode(classType, inputs) {
  const prompt = { 1: { class_type: classType, inputs } };
  const res = await callJson("/prompt", { prompt, client_id: api.clientId ?? api.initialClientId });
  return res.prompt_id;
}

// ------------------------------------------------------------------------------------------------ actions
function keyName(ev) {
  const k = ev.key.toLowerCase();
  if (!S.info) return null;
  if (S.info.mode === "templerun") return TEMPLERUN_KEYS[k] || null;
  return S.info.keys.includes(k) ? k : null;
}

// The keys held now plus every key pressed since the last chunk was asked for (a quick tap is not lost), and the
// camera motion of the drag and the arrow keys.
function takeActions() {
  const keys = [...new Set([...S.held, ...S.tapped])].filter((k) => !k.startsWith("camera:"));
  let [pitch, yaw] = [S.drag[1] * -DRAG_PER_PX, S.drag[0] * DRAG_PER_PX];
  for (const k of new Set([...S.held, ...S.tapped])) {
    if (k.startsWith("camera:")) { const [p, y] = CAMERA_KEYS[k.slice(7)]; pitch += p; yaw += y; }
  }
  S.tapped = new Set();
  S.drag = [0, 0];
  const clamp = (v) => Math.round(Math.max(-DRAG_MAX, Math.min(DRAG_MAX, v)) * 1000) / 1000;
  if (!S.info?.mouse) [pitch, yaw] = [0, 0];
  return { keys: keys.join("+"), mouse_pitch: clamp(pitch), mouse_yaw: clamp(yaw) };
}

function onKey(ev, down) {
  const k = ev.key.toLowerCase();
  let name = keyName(ev);
  if (!name && S.info?.mouse && CAMERA_KEYS[k]) name = `camera:${k}`;
  if (!name) return;
  ev.preventDefault();
  ev.stopPropagation();                       // not a ComfyUI shortcut while the video has the focus
  if (down) { S.held.add(name); S.tapped.add(name); } else S.held.delete(name);
  renderKeys();
}

// ------------------------------------------------------------------------------------------------ the loop
// A chunk's frames (or its prompt's failure) may come over the websocket before /prompt has answered: what has
// come is kept, and waiting for it then ends at once.
const came = { chunks: new Map(), prompts: new Map() };

function waitFor(promptId, chunk) {
  const done = came.chunks.get(chunk) || came.prompts.get(promptId);
  if (done) return Promise.resolve(done);
  return new Promise((resolve) => { S.waiting = { promptId, chunk, resolve }; });
}

function settle(result) {
  const w = S.waiting;
  S.waiting = null;
  w?.resolve(result);
}

async function loop() {
  if (S.looping) return;                      // Resume while a chunk is still being made: that loop goes on
  S.looping = true;
  try {
    await steps();
  } finally {
    S.looping = false;
    renderButtons();
  }
}

async function steps() {
  while (S.playing && S.session && !S.info?.ended) {
    const chunk = S.info.chunks;
    const acts = isText() ? { prompt: (S.promptEl?.value || "").trim() } : takeActions();
    const asked = performance.now();
    let promptId;
    try {
      promptId = await queueNode(isText() ? "CausalWanPromptPlayStep" : "MatrixGame2PlayStep",
                                 { session: S.session, chunk, ...acts });
    } catch (e) {
      log.errors.push(String(e.message || e));
      toast("error", "Play", String(e.message || e));
      S.playing = false;
      break;
    }
    log.sent.push({ t: asked, chunk, prompt_id: promptId, ...acts });
    setStatus(`making chunk ${chunk + 1}…`);
    const res = await waitFor(promptId, chunk);
    if (res.kind !== "chunk") { S.playing = false; break; }
    await untilPlayedOut((performance.now() - asked) * 1.2);
  }
}

// When chunks come faster than they play (16 fps), ask for the next one only once the frames still to show last
// about as long as making a chunk takes: the video plays without a gap and the keys act on what is on screen, not
// on a growing backlog.
function untilPlayedOut(leadMs) {
  return new Promise((resolve) => {
    const check = () => {
      const leftMs = (S.frames.length - S.shown) * (1000 / S.fps);
      if (!S.playing || leftMs <= leadMs) resolve();
      else setTimeout(check, 20);
    };
    check();
  });
}

function setPlaying(on) {
  if (on === S.playing) return;
  S.playing = on;
  renderButtons();
  if (on) { S.view?.focus(); loop(); } else setStatus("paused: press Play to go on");
}

api.addEventListener(EVENT, (ev) => {
  const d = ev.detail || {};
  if (d.kind === "ready") {
    log.ready.push({ t: performance.now(), session: d.session });
    adopt(d.session, d);
    if (!S.box?.isConnected) toast("info", "Matrix-Game-2 play", "Session ready: open the Wan Accel panel and press Play.");
    return;
  }
  if (d.session !== S.session) return;
  if (d.kind === "chunk") {
    if (d.prompt !== undefined) S.info.prompt = d.prompt;
    log.chunks.push({ t: performance.now(), chunk: d.chunk, action: d.action, frames: (d.frames || []).length,
                      latency_s: d.latency_s, decode_s: d.decode_s });
    S.info.chunks = d.chunk + 1;
    came.chunks.set(d.chunk, { kind: "chunk" });
    feedFrames(S, d);
    log.frames = S.frames.length;
    setStatus(`chunk ${d.chunk + 1} · ${d.action} · ${Math.round(d.latency_s * 1000)} ms ` +
              `(decode ${Math.round((d.decode_s / Math.max(d.latency_s, 1e-9)) * 100)}%)`);
    if (S.waiting && S.waiting.chunk === d.chunk) settle({ kind: "chunk" });
  } else if (d.kind === "ended") {
    log.ended.push({ t: performance.now(), reason: d.reason });
    S.info.ended = d.reason;
    came.chunks.set(S.info.chunks, { kind: "ended" });
    setStatus(`session ended (${d.reason}); Save still writes what was made`);
    settle({ kind: "ended" });
    renderButtons();
  } else if (d.kind === "saved") {
    log.saved.push({ t: performance.now(), ...d });
    showSaved(d);
  }
});

for (const name of ["execution_error", "execution_interrupted"]) {
  api.addEventListener(name, (ev) => {
    if (ev.detail?.prompt_id) came.prompts.set(ev.detail.prompt_id, { kind: name });
    if (S.waiting && ev.detail?.prompt_id === S.waiting.promptId) {
      const why = ev.detail.exception_message || name.replace("execution_", "");
      log.errors.push(why);
      toast(name === "execution_error" ? "error" : "warn", "Play", why);
      settle({ kind: name });
    }
  });
}

// ------------------------------------------------------------------------------------------------ view
function setStatus(text) {
  if (S.statusEl) S.statusEl.textContent = text;
}

function renderKeys() {
  if (!S.keysEl || !S.info) return;
  const held = new Set([...S.held]);
  S.keysEl.replaceChildren(...S.info.keys.map((k) => el("span", {
    class: "wan-accel-play-key", "data-key": k, "data-held": held.has(k) ? "1" : "0",
    style: { display: "inline-block", minWidth: "18px", padding: "1px 5px", marginRight: "3px", borderRadius: "3px",
             textAlign: "center", fontFamily: "monospace", border: "1px solid var(--border-color, #555)",
             background: held.has(k) ? "#2f7d32" : "transparent" } }, k.length === 1 ? k.toUpperCase() : k)));
}

function renderButtons() {
  if (!S.buttons) return;
  const live = S.session && !S.info?.ended;
  S.buttons.play.textContent = S.playing ? "Pause" : (S.info?.chunks ? "Resume" : "Play");
  S.buttons.play.disabled = !live;
  S.buttons.end.disabled = !live;
  S.buttons.save.disabled = !S.session || !S.info?.chunks;
}

function showSaved(d) {
  if (!S.savedEl) return;
  const f = d.files || {};
  S.savedEl.replaceChildren(el("div", {}, `saved in output/${d.subfolder}: ${Object.values(f).join(", ")} ` +
                                          `(${d.frames} frames, seed ${d.seed})`));
  callJson("/wan_accel/play/touch", { session: S.session }).then((info) => {
    S.savedEl.append(el("textarea", { readonly: "readonly", class: "wan-accel-play-script",
      style: { width: "100%", height: "60px", fontFamily: "monospace", fontSize: "11px", boxSizing: "border-box" } },
      info.script));
  }).catch(() => {});
}

function adopt(session, info) {
  S.session = session;
  S.info = { ...info, chunks: info.chunks || 0 };
  S.frames = [];
  S.shown = 0;
  log.frames = log.shown = 0;
  S.held.clear();
  S.tapped.clear();
  S.drag = [0, 0];
  S.playing = false;
  came.chunks.clear();
  came.prompts.clear();
  settle({ kind: "replaced" });
  clearInterval(S.beat);
  S.beat = setInterval(() => {              // a watched session is not abandoned
    if (!S.session || S.info?.ended) return;
    callJson("/wan_accel/play/touch", { session: S.session }).catch((e) => {
      S.info.ended = String(e.message || e);
      setStatus(`session gone: ${S.info.ended}`);
      setPlaying(false);
      renderButtons();
    });
  }, HEARTBEAT_MS);
  render();
}

async function startSession() {
  const node = app.graph?.nodes?.find((n) => SESSION_NODES.includes(n.type));
  if (!node) {
    toast("warn", "Play", "Add a 'Matrix-Game-2 Play Session' or 'CausalWan Prompt Play Session' node to the graph " +
                          "(or load the matrix_game2_play / longlive_prompt_switch workflow), then press Start session.");
    return;
  }
  if (S.session && !S.info?.ended) await endSession();   // its caches and model go before the new ones load
  setStatus("starting: running the graph (loads the model and the start image)…");
  await app.queuePrompt(0, 1);
}

async function endSession() {
  if (!S.session) return;
  setPlaying(false);
  try {
    const res = await callJson("/wan_accel/play/end", { session: S.session });
    S.info.ended = res.ended;
    log.ended.push({ t: performance.now(), reason: res.ended });
    setStatus(`session ended: its memory is freed; Save still writes what was made`);
  } catch (e) {
    toast("error", "Play", String(e.message || e));
  }
  renderButtons();
}

async function saveSession() {
  if (!S.session) return;
  setPlaying(false);
  try {
    await queueNode("MatrixGame2PlaySave", { session: S.session, filename_prefix: "wan_accel/play",
                                             video_format: "mp4" });
    setStatus("saving…");
  } catch (e) {
    toast("error", "Play", String(e.message || e));
  }
}

function render() {
  const box = S.box;
  if (!box) return;
  const img = el("img", { class: "wan-accel-play-video", draggable: "false",
    style: { width: "100%", height: "200px", objectFit: "contain", background: "#000", display: "block",
             cursor: S.info?.mouse ? "grab" : "default", userSelect: "none" } });
  const view = el("div", { class: "wan-accel-play-view", tabindex: "0", title:
    "Click here, then hold keys while the chunks are made; drag on the video to turn the camera",
    style: { outline: "none", border: "1px solid var(--border-color, #444)", borderRadius: "4px" },
    onkeydown: (ev) => onKey(ev, true), onkeyup: (ev) => onKey(ev, false),
    onblur: () => { S.held.clear(); renderKeys(); } }, img);
  img.addEventListener("pointerdown", (ev) => { S.dragging = [ev.clientX, ev.clientY]; view.focus(); });
  S.img = img;
  S.view = view;
  S.statusEl = el("div", { class: "wan-accel-play-status", style: { fontFamily: "monospace", fontSize: "11px" } });
  S.keysEl = el("div", { style: { margin: "4px 0" } });
  S.savedEl = el("div", { class: "wan-accel-play-saved", style: { fontSize: "11px", opacity: "0.85" } });
  S.buttons = {
    start: el("button", { style: BUTTON, onclick: startSession, title: "Run the graph with a Matrix-Game-2 Play " +
                          "Session node: loads the model and the start image and starts a new session" },
              "Start session"),
    play: el("button", { style: BUTTON, class: "wan-accel-play-toggle", onclick: () => setPlaying(!S.playing) }, "Play"),
    save: el("button", { style: BUTTON, onclick: saveSession, title: "Write the video, the Game Actions script " +
                         "that reproduces it and the latent to the output folder" }, "Save"),
    end: el("button", { style: BUTTON, onclick: endSession, title: "End the session and free its memory" }, "End"),
  };
  S.promptEl = isText() ? el("input", { type: "text", class: "wan-accel-play-prompt", value: S.info.prompt || "",
    placeholder: "type a prompt: it takes effect at the next chunk",
    onkeydown: (ev) => ev.stopPropagation(),        // typing is not a ComfyUI shortcut
    style: { width: "100%", boxSizing: "border-box", margin: "4px 0", fontSize: "12px" } }) : null;
  const head = el("div", { style: { display: "flex", justifyContent: "space-between", alignItems: "center" } },
    el("b", {}, isText() ? "Prompt play" : "Matrix-Game-2 play"),
    el("span", { style: { opacity: "0.7", fontFamily: "monospace" } }, S.session ? `session ${S.session}` : ""));
  const help = isText()
    ? "Type a prompt while it plays: the next chunk follows it (a mix: 'a red fox :0.7 | snow :0.3')." +
      (S.info?.recache === "krea" ? " recache krea: it eases in over 4 chunks, as Krea's server does; " +
        "'<prompt> (blend 0)' switches at once." : "")
    : S.info
    ? `${S.info.mode}: hold ${S.info.keys.map((k) => (k.length === 1 ? k.toUpperCase() : k)).join(" ")}` +
      (S.info.mouse ? "; drag on the video or use the arrow keys to turn the camera" : "") + "."
    : "Add a Matrix-Game-2 Play Session (or CausalWan Prompt Play Session) node, press Start session, then Play.";
  box.replaceChildren(head, view, ...(S.promptEl ? [S.promptEl] : []), S.keysEl, el("div", { style: { opacity: "0.7", fontSize: "11px" } }, help),
    el("div", { style: { margin: "4px 0" } }, ...Object.values(S.buttons)), S.statusEl, S.savedEl);
  renderKeys();
  renderButtons();
  if (S.frames.length) { S.shown = Math.max(0, S.frames.length - 1); playFrames(S); }
  setStatus(S.session ? (S.info?.ended ? `session ended (${S.info.ended})`
                                       : `ready: ${S.info?.chunks || 0} chunks made; press Play`) : "no session");
}

window.addEventListener("pointermove", (ev) => {     // a drag that started on the video, wherever it goes
  if (!S.dragging) return;
  S.drag[0] += ev.clientX - S.dragging[0];
  S.drag[1] += ev.clientY - S.dragging[1];
  S.dragging = [ev.clientX, ev.clientY];
});
window.addEventListener("pointerup", () => { S.dragging = null; });

// The panel (re)mounted: put the play box at its top; pick up a session the server already has.
document.addEventListener("wan_accel:panel", async (ev) => {
  const host = ev.detail?.container;
  if (!host) return;
  S.box = el("div", { class: "wan-accel-play", style: { padding: "8px", borderBottom: "1px solid var(--border-color, #444)" } });
  host.prepend(S.box);
  render();
  if (S.session) return;
  try {
    const live = ((await callJson("/wan_accel/play")).sessions || []).filter((s) => !s.ended);
    if (live.length && !S.session) adopt(live[live.length - 1].session, live[live.length - 1]);
  } catch (e) { /* no sessions to pick up */ }
});

app.registerExtension({ name: "wan_accel.play" });
