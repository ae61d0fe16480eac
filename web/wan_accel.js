// Frontend extension of comfyui-wan-accel.
//  * "Wan Accel" panel (a sidebar tab, or a floating panel on frontends without sidebar tabs): the limit cache
//    per namespace (entries measured on this machine, best configs, learned memory limits) with a clear
//    button per namespace. Talks to GET /api/wan_accel/limits and POST /api/wan_accel/limits/clear.
//    Below it, the doctor: each accelerated feature's verdict on this machine with a re-check button
//    (GET /api/wan_accel/doctor, POST /api/wan_accel/doctor/recheck).
//    Above it, Matrix-Game-2 play mode (web/wan_accel_play.js, told by the event "wan_accel:panel").
//  * Badges on compile settings nodes: EXTREME-PLUS tiling preset (red), lock_global_ops on (blue), as a row of
//    pills in a DOM widget (the classic canvas and Nodes 2.0 both show it), kept in step with the two widgets.
//  * A read-only text box on the pack's output nodes that return {"ui": {"text": [...]}} (from the api's
//    "executed" event and onExecuted, whichever the frontend sends).
// Only the public modules scripts/app.js and scripts/api.js are imported; el, toast and the frame player are shared
// with the pack's other scripts (with the panel's STYLE).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EXT_NAME = "wan_accel.panel";
const CATEGORY_PREFIX = "wan_accel";
const TEXT_WIDGET = "wan_accel_text";
const BADGE_WIDGET = "wan_accel_badges";
const RISKY_PRESET = "EXTREME-PLUS";

// ------------------------------------------------------------------------------------------------ helpers
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function plural(n, one, many) {
  return `${n} ${n === 1 ? one : many}`;
}

function renderNotices(notices) {
  // the cache file itself: a damaged file moved aside, a refused or unwritable location (never silent)
  return (notices || []).map((text) => el("div", {
    class: "wan-accel-notice",
    style: { background: "rgba(200, 120, 0, 0.18)", border: "1px solid rgba(200, 120, 0, 0.6)",
             borderRadius: "4px", padding: "4px 6px", margin: "4px 0", whiteSpace: "normal" },
  }, `⚠ ${text}`));
}

function renderSetAside(aside) {
  // entries that could not be used (a wrong type, a number that is not finite): set aside alone, never used
  if (!aside || !aside.count) return [];
  const list = el("details", { class: "wan-accel-set-aside", style: { margin: "4px 0" } },
    el("summary", { title: aside.path || "" },
      `${plural(aside.count, "entry", "entries")} set aside (could not be used; kept in ${aside.path})`));
  for (const item of aside.items || []) {
    list.append(el("div", { style: STYLE.row, title: JSON.stringify(item.entry, null, 1) },
      el("div", { style: STYLE.key }, [item.namespace, item.key].filter(Boolean).join("/") ||
        `fingerprint ${item.fingerprint}`),
      el("div", { style: { opacity: "0.75" } }, item.reason)));
  }
  return [list];
}

export function toast(severity, summary, detail, life = 4000) {
  const t = app.extensionManager?.toast;
  if (t?.add) t.add({ severity, summary, detail, life });
  else console[severity === "error" ? "error" : "log"](`[wan_accel] ${summary}: ${detail}`);
}

// The frame player of the live frames and of play mode: { img, frames (base64 JPEG), shown, fps, timer, onFrame };
// the frames play into img at fps (onFrame after each); caught up, it waits for feedFrames to bring a chunk's more.
export function playFrames(player) {
  if (player.timer || !player.img) return;
  player.timer = setInterval(() => {
    if (player.shown >= player.frames.length) {    // caught up: wait for the next chunk
      clearInterval(player.timer);
      player.timer = null;
      return;
    }
    player.img.src = "data:image/jpeg;base64," + player.frames[player.shown];
    player.shown += 1;
    player.onFrame?.();
  }, 1000 / player.fps);
}

export function feedFrames(player, d) {
  player.fps = d.fps || 16;
  player.frames.push(...(d.frames || []));
  playFrames(player);
}

async function confirmDialog(title, message) {
  const d = app.extensionManager?.dialog;
  if (d?.confirm) return (await d.confirm({ title, message, type: "delete" })) === true;
  return window.confirm(`${title}\n\n${message}`);
}

function fmtBytes(n) {
  if (typeof n !== "number" || !isFinite(n)) return String(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

// Short readable text of an entry value: byte-like fields as sizes, nested configs as k=v.
function fmtValue(value) {
  if (value === null || typeof value !== "object") return String(value);
  const parts = [];
  for (const [k, v] of Object.entries(value)) {
    let s;
    if (typeof v === "number" && /bytes/i.test(k)) s = fmtBytes(v);
    else if (typeof v === "number") s = Number.isInteger(v) ? String(v) : v.toPrecision(4);
    else if (v && typeof v === "object") s = Object.entries(v).map(([a, b]) => `${a}=${JSON.stringify(b)}`).join(" ");
    else if (typeof v === "string") s = v;
    else s = JSON.stringify(v);
    parts.push(`${k}: ${s}`);
  }
  return parts.join(" · ");
}

// ------------------------------------------------------------------------------------------------ panel
export const STYLE = {
  root: { padding: "8px", fontSize: "12px", lineHeight: "1.4", color: "var(--fg-color, #ddd)",
          overflowY: "auto", height: "100%", boxSizing: "border-box" },
  head: { display: "flex", justifyContent: "space-between", alignItems: "center", marginBottom: "6px" },
  machine: { opacity: "0.75", marginBottom: "8px", wordBreak: "break-word" },
  ns: { border: "1px solid var(--border-color, #444)", borderRadius: "6px", padding: "6px", marginBottom: "8px" },
  nsHead: { display: "flex", justifyContent: "space-between", alignItems: "center", fontWeight: "bold" },
  row: { padding: "3px 0", borderTop: "1px solid var(--border-color, #333)", wordBreak: "break-word" },
  key: { fontFamily: "monospace", color: "var(--input-text, #9cf)" },
  button: { cursor: "pointer", fontSize: "11px", padding: "2px 8px", borderRadius: "4px",
            border: "1px solid var(--border-color, #555)", background: "var(--comfy-input-bg, #222)",
            color: "var(--fg-color, #ddd)" },
};

const NS_HINT = {
  operator: "best kernel configs per shape",
  compile: "compile settings and artifacts",
  memory: "learned memory limits",
  sampler: "sampler capabilities",
};

// GET (no body) or POST (a JSON body) to one of the server's routes; the answer's JSON, or an Error with the reason
// the server gave (its "error", or the first node error of a refused prompt).
export async function callJson(path, body) {
  const init = body === undefined ? { cache: "no-store" }
    : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const r = await api.fetchApi(path, init);
  const data = await r.json().catch(() => ({}));
  if (!r.ok) {
    const nodeErr = Object.values(data.node_errors || {})[0]?.errors?.[0];
    throw new Error(nodeErr ? `${nodeErr.message}: ${nodeErr.details}` : data.error?.message || data.error || `HTTP ${r.status}`);
  }
  return data;
}

const VERDICT_COLOR = { passed: "#4caf50", failed: "#e53935", slower: "#fb8c00" };

function renderDoctor(data, refresh) {
  const box = el("div", { style: STYLE.ns, class: "wan-accel-doctor" },
    el("div", { style: STYLE.nsHead }, el("span", {}, "doctor ",
      el("span", { style: { fontWeight: "normal", opacity: "0.7" } }, "accelerated paths checked on this machine"))));
  for (const f of data.features) {
    const recheck = el("button", {
      style: STYLE.button, title: `Probe ${f.feature} again against its fallback`,
      onclick: async () => {
        recheck.disabled = true;
        recheck.textContent = "checking…";
        try {
          const res = await callJson("/wan_accel/doctor/recheck", { feature: f.feature });
          const row = res.features.find((x) => x.feature === f.feature);
          toast(row?.status === "passed" ? "success" : "warn", "Doctor", `${f.feature}: ${row?.verified ?? "?"}`);
        } catch (e) {
          toast("error", "Doctor", String(e.message || e));
        }
        refresh();
      },
    }, "Re-check");
    if (!f.available) recheck.disabled = true;
    const color = VERDICT_COLOR[f.status] || "var(--fg-color, #ddd)";
    box.append(el("div", { style: STYLE.row, "data-feature": f.feature, "data-status": f.status },
      el("div", { style: STYLE.nsHead },
        el("span", { style: STYLE.key, title: f.summary }, f.feature),
        el("span", {}, el("span", { style: { color, marginRight: "6px" } },
          f.available ? f.verified : "not available"), recheck)),
      f.available && f.difference !== "-" ? el("div", { style: { opacity: "0.75" } },
        `difference ${f.difference} · ${f.speed}`) : "",
      f.why_off ? el("div", { style: { opacity: "0.75" } }, f.why_off) : "",
      f.fix ? el("div", { style: { opacity: "0.6" } }, f.fix) : ""));
  }
  return box;
}

function renderNamespace(ns, refresh) {
  const clear = el("button", {
    style: STYLE.button, title: `Remove every entry of '${ns.name}' (all machines)`,
    onclick: async () => {
      const total = ns.count + ns.other_machines;
      const ok = await confirmDialog(`Clear '${ns.name}'?`,
        `This removes ${plural(total, "entry", "entries")} of '${ns.name}' (of every machine). ` +
        "They are measured again the next time they are needed.");
      if (!ok) return;
      try {
        const res = await callJson("/wan_accel/limits/clear", { namespace: ns.name });
        toast("success", "Limit cache", `Cleared ${plural(res.cleared, "entry", "entries")} from ${res.namespace}.`);
      } catch (e) {
        toast("error", "Limit cache", String(e.message || e));
      }
      refresh();
    },
  }, "Clear");
  if (!ns.count && !ns.other_machines) clear.disabled = true;
  const box = el("div", { style: STYLE.ns, "data-namespace": ns.name,
                          "data-total": String(ns.count + ns.other_machines) },
    el("div", { style: STYLE.nsHead },
      el("span", {}, `${ns.name} `, el("span", { style: { fontWeight: "normal", opacity: "0.7" } },
        plural(ns.count, "entry", "entries") +
        (ns.other_machines ? `, ${ns.other_machines} from other machines` : ""))),
      clear));
  if (NS_HINT[ns.name]) box.append(el("div", { style: { opacity: "0.6", marginBottom: "2px" } }, NS_HINT[ns.name]));
  for (const e of ns.entries) {
    box.append(el("div", { style: STYLE.row, title: JSON.stringify(e.value, null, 1) },
      el("div", { style: STYLE.key }, e.key, el("span", { style: { opacity: "0.6" } }, `  (hits ${e.hits})`)),
      el("div", {}, fmtValue(e.value))));
  }
  if (ns.truncated) box.append(el("div", { style: { opacity: "0.6" } }, `… ${ns.truncated} more`));
  return box;
}

function mountPanel(container) {
  const root = el("div", { style: STYLE.root, class: "wan-accel-panel" });
  container.append(root);
  // other parts of the pack (Matrix-Game-2 play mode) add their boxes above the limit cache
  document.dispatchEvent(new CustomEvent("wan_accel:panel", { detail: { container } }));
  const refresh = async () => {
    const reload = el("button", { style: STYLE.button, onclick: refresh }, "Reload");
    root.replaceChildren(el("div", { style: STYLE.head }, el("b", {}, "Wan Accel limit cache"), reload),
      el("div", { style: { opacity: "0.6" } }, "loading…"));
    let data;
    try {
      data = await callJson("/wan_accel/limits");
    } catch (e) {
      root.lastChild.textContent = `Could not read the limit cache: ${e.message || e}`;
      return;
    }
    const fp = data.fingerprint || {};
    root.replaceChildren(
      el("div", { style: STYLE.head }, el("b", { title: data.path }, "Wan Accel limit cache"), reload),
      el("div", { style: STYLE.machine },
        `${fp.gpu ?? "?"} [${fp.device ?? "?"} ${fp.capability ?? ""}] · torch ${fp.torch ?? "?"} · triton ${fp.triton ?? "?"}`,
        el("br"), el("span", { style: { fontFamily: "monospace" } }, `id ${data.fingerprint_id}`)),
      ...renderNotices(data.notices),
      ...renderSetAside(data.set_aside),
      ...data.namespaces.map((ns) => renderNamespace(ns, refresh)));
    try {
      root.append(renderDoctor(await callJson("/wan_accel/doctor"), refresh));
    } catch (e) {
      root.append(el("div", { style: { opacity: "0.6" } }, `Could not read the doctor's verdicts: ${e.message || e}`));
    }
  };
  refresh();
  return root;
}

function floatingPanel() {
  // for frontends without sidebar tabs: a small button that opens the same panel in a floating box
  let box = null;
  const toggle = () => {
    if (box) { box.remove(); box = null; return; }
    box = el("div", { style: { position: "fixed", right: "12px", bottom: "52px", width: "360px", height: "60vh",
                               zIndex: 1000, background: "var(--comfy-menu-bg, #202020)",
                               border: "1px solid var(--border-color, #444)", borderRadius: "8px" } });
    document.body.append(box);
    mountPanel(box);
  };
  document.body.append(el("button", {
    style: { ...STYLE.button, position: "fixed", right: "12px", bottom: "12px", zIndex: 1000 },
    title: "Wan Accel limit cache", onclick: toggle }, "Wan Accel"));
}

// ------------------------------------------------------------------------------------------------ node helpers
// obj[name] (a node's or a widget's hook) runs as before, then fn(this, ...its arguments); its answer is kept.
function after(obj, name, fn) {
  const previous = obj[name];
  obj[name] = function (...args) {
    const r = previous?.apply(this, args);
    fn(this, ...args);
    return r;
  };
}

function isPackNode(nodeData) {
  return typeof nodeData?.category === "string" && nodeData.category.startsWith(CATEGORY_PREFIX);
}

// Badges for compile settings worth noticing: [text, background colour].
function compileBadges(node) {
  const w = (name) => node.widgets?.find((x) => x.name === name);
  const out = [];
  const preset = w("tiling_preset");
  if (preset && String(preset.value).toUpperCase() === RISKY_PRESET) out.push([RISKY_PRESET, "#b3261e"]);
  const lock = w("lock_global_ops");
  if (lock && lock.value === true) out.push(["GLOBAL OPS LOCKED", "#2f5d8a"]);
  return out;
}

// The badges live in a DOM widget (a row of pills under the node's widgets): both renderers, the classic canvas
// and Nodes 2.0 (Vue nodes), mount DOM widgets, whereas a canvas-drawn title badge never shows under Nodes 2.0 and
// a node's badge list is read there only when the node mounts. The row is rebuilt when the graph is loaded and
// whenever one of the two widgets changes (their callbacks run in both renderers).
function badgeWidget(node) {
  let widget = node.widgets?.find((w) => w.name === BADGE_WIDGET);
  if (widget) return widget;
  const row = el("div", { class: "wan-accel-badges", style: { display: "flex", flexWrap: "wrap", gap: "4px",
                                                              alignItems: "center", minHeight: "20px",
                                                              padding: "2px 0", boxSizing: "border-box" } });
  widget = node.addDOMWidget(BADGE_WIDGET, "wan_accel_badges", row, {
    serialize: false, hideOnZoom: false, getMinHeight: () => 26, getMaxHeight: () => 48,
    getValue: () => row.dataset.badges || "", setValue: () => {},
  });
  widget.serialize = false;
  widget._row = row;
  return widget;
}

function syncBadges(node) {
  const widget = badgeWidget(node);
  const wanted = compileBadges(node);
  const key = wanted.map(([t]) => t).join("|");
  widget._row.dataset.wanAccelNode = String(node.id);        // the id a node gets when it is added to a graph
  if (widget._row.dataset.badges === key && widget._row.childElementCount === wanted.length) return;
  widget._row.dataset.badges = key;
  widget._row.replaceChildren(...wanted.map(([text, bg]) => el("span", { class: "wan-accel-badge", "data-badge": text,
    style: { background: bg, color: "#fff", font: "bold 11px sans-serif", padding: "2px 6px", borderRadius: "5px",
             whiteSpace: "nowrap" } }, text)));
  node.setDirtyCanvas?.(true, true);
}

function watchBadgeInputs(node) {
  for (const w of node.widgets || []) {
    if (w.name !== "tiling_preset" && w.name !== "lock_global_ops" || w._wanAccelWatched) continue;
    after(w, "callback", () => syncBadges(node));
    w._wanAccelWatched = true;
  }
  syncBadges(node);
}

function showText(node, message) {
  const lines = message?.text;
  if (!Array.isArray(lines) || !lines.length) return;
  const text = lines.map(String).join("\n");
  let widget = node.widgets?.find((w) => w.name === TEXT_WIDGET);
  if (!widget) {
    const area = el("textarea", { readonly: "readonly", spellcheck: "false", class: "wan-accel-text",
      "data-wan-accel-node": String(node.id),
      style: { width: "100%", height: "100%", boxSizing: "border-box", fontFamily: "monospace", fontSize: "11px",
               resize: "none", background: "var(--comfy-input-bg, #222)", color: "var(--input-text, #ddd)",
               border: "1px solid var(--border-color, #444)", borderRadius: "4px", whiteSpace: "pre" } });
    widget = node.addDOMWidget(TEXT_WIDGET, "wan_accel_text", area, {
      serialize: false, hideOnZoom: false, getMinHeight: () => 120,
      getValue: () => area.value, setValue: (v) => { area.value = v ?? ""; },
    });
    widget.serialize = false;
    widget._area = area;
    node.setSize?.([Math.max(node.size[0], 420), Math.max(node.size[1], 260)]);
  }
  widget._area.value = text;
  node.setDirtyCanvas?.(true, true);
}

// The api's "executed" event reaches the page under every renderer (onExecuted is reported not to run under some
// Nodes 2.0 builds); showing the same text twice is harmless.
api.addEventListener("executed", (ev) => {
  const d = ev.detail || {};
  const node = app.graph?.getNodeById?.(d.display_node ?? d.node);
  if (node && isPackNode(node.constructor?.nodeData)) showText(node, d.output);
});

// ------------------------------------------------------------------------------------------------ extension
app.registerExtension({
  name: EXT_NAME,

  async setup() {
    const mgr = app.extensionManager;
    if (mgr?.registerSidebarTab) {
      mgr.registerSidebarTab({
        id: "wan-accel-limits", icon: "pi pi-bolt", title: "Wan Accel", label: "Wan Accel",
        tooltip: "Wan Accel: limit cache", type: "custom",
        render: (container) => { container.replaceChildren(); mountPanel(container); },
      });
    } else {
      floatingPanel();
    }
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!isPackNode(nodeData)) return;
    const inputs = { ...(nodeData.input?.required || {}), ...(nodeData.input?.optional || {}) };
    if ("tiling_preset" in inputs || "lock_global_ops" in inputs) {
      after(nodeType.prototype, "onNodeCreated", watchBadgeInputs);
      for (const hook of ["onConfigure", "onAdded"]) {   // a loaded workflow's values; a node put on a graph
        after(nodeType.prototype, hook, syncBadges);
      }
    }
    // output nodes, and any pack node that reports something (e.g. a feature switched off by the doctor); the
    // api's "executed" event (below) does the same where a frontend does not call onExecuted
    after(nodeType.prototype, "onExecuted", showText);
  },
});
