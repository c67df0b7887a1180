// H3 MultiStream (async) — ComfyUI frontend extension.
//
// The live panel as a sidebar tab next to the graph (panel.js's Panel, fed by ComfyUI's websocket through its api
// events: every "h3multistream.step" record as it happens, the status on each queue change); a main-menu entry
// "H3 MultiStream" with the status toast, the panel tab, the standalone panel page and the release/clear/detach
// actions; and a toast naming the rank and its log when a prompt fails in a worker.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ACTIONS, Panel, describe, fmtBytes, fmtSec, human } from "./panel.js";

const EXT = "H3MultiStreamAsync";
const TAB_ID = "h3multistream";

function toast(severity, summary, detail) {
  const t = app.extensionManager && app.extensionManager.toast;
  if (t && typeof t.add === "function") {
    t.add({ severity, summary, detail, life: severity === "error" ? undefined : 5000 }); // errors stay until closed
    return;
  }
  // older frontends have no toast API
  (severity === "error" ? console.error : console.log)(`[H3 MultiStream] ${summary}: ${detail}`);
  if (severity === "error" || severity === "warn") alert(`${summary}\n${detail}`);
}

async function call(path, method = "POST") {
  const resp = await api.fetchApi(path, { method });
  let body = {};
  try { body = await resp.json(); } catch { body = {}; }
  if (!resp.ok) throw new Error(body.error || `${resp.status} ${resp.statusText}`);
  return body;
}

function statusLines(st) {
  const lines = [];
  const plans = Object.entries(st.plans || {});
  if (st.plans && st.plans.error) lines.push(`GPUs: ${st.plans.error}`);
  else if (plans.length === 0) lines.push("GPUs: no plan yet");
  else for (const [k, v] of plans) lines.push(`GPUs (${k}): ${human(k, v)}`);
  const s = st.last_step;
  if (s && s.ranks) {
    const per = (k) => s.ranks.map((r) => fmtSec(r[k])).join("/");
    lines.push(`Last step: ${fmtSec(s.wall_s)}s on ${s.devices.join("+")} (${s.tokens} tokens, exchange ` +
      `${s.exchange}${s.chunks > 1 ? " x" + s.chunks : ""}; compute ${per("compute_s")}s, exchange ` +
      `${per("exchange_s")}s, wait ${per("wait_s")}s; ${fmtBytes(s.moved_bytes)} moved)`);
  } else {
    lines.push("Last step: none yet");
  }
  if (!Array.isArray(st.workers)) lines.push(`Workers: ${st.workers.error}`);
  else lines.push("Workers: " + (st.workers.length
    ? st.workers.map((w) => `r${w.rank} ${w.device}: ${w.state}`).join(", ") : "none"));
  for (const eng of (st.attention && st.attention.engines) || []) {
    const last = eng.recent_calls.length ? eng.recent_calls[eng.recent_calls.length - 1] : null;
    lines.push(`Attention parallel: ${eng.devices.join("+")} (${eng.transport}), ${eng.calls} call(s)` +
      (last ? `; last ${fmtSec(last.wall_s)}s, compute ${last.ranks.map((r) => fmtSec(r.compute_s)).join("/")}s`
        : ""));
  }
  const ws = st.weight_store || {};
  lines.push("Weight store: " + (ws.error || describe(ws)));
  const list = (v, f) => (!Array.isArray(v) ? v.error : v.length ? v.map(f).join(", ") : "none");
  lines.push("Caches: " + list(st.caches, (c) => c.group));
  lines.push("Hooks attached: " + list(st.hooks, (h) => h.hook || h.kind));
  lines.push(st.ram.text);
  return lines;
}

const FAILURE_LOG_LINES = 3;
const FAILURE_LINE_CHARS = 140;

// What a failed prompt's ComfyUI "execution_error" detail says about the pack: null when the pack did not raise it,
// else { summary, detail }. A worker failure's message is "worker rank R on DEV (pid P, STATE) WHAT",
// then "--- last lines of LOG ---" and the log's tail (h3ms_async/runtime/worker_handle.py words it so); the summary names the
// rank, the detail the log file and its last lines.
function packFailure(err) {
  if (!err || typeof err.exception_message !== "string") return null;
  const msg = err.exception_message;
  const worker = msg.match(/worker rank (\d+) on (\S+) \(([^)]*)\) ([^\n]*)/);
  if (!worker && !String(err.exception_type || "").startsWith("h3ms_async.")) return null;
  const first = msg.split("\n", 1)[0];
  if (!worker) return { summary: "H3 MultiStream failed", detail: first };
  const [, rank, device, state, what] = worker;
  const log = msg.match(/--- last lines of (.+?) ---\n?([\s\S]*)$/);
  const lines = [`rank ${rank} on ${device} (${state}) ${what}`];
  if (log) {
    lines.push(`log: ${log[1]}`);
    const tail = log[2].replace(/\s+$/, "").split("\n").filter((l) => l.trim()).slice(-FAILURE_LOG_LINES);
    const cut = (l) => (l.length > FAILURE_LINE_CHARS ? l.slice(0, FAILURE_LINE_CHARS - 1) + "…" : l);
    lines.push(...tail.map(cut));
  }
  return { summary: `H3 MultiStream: worker rank ${rank} failed`, detail: lines.join("\n") };
}

// ---- the sidebar tab

// One panel for the page's life: the step records keep arriving while the tab is closed, the status refreshes
// only while it is open.
const tab = { root: null, panel: null };

function tabPanel() {
  if (!tab.panel) {
    const css = document.createElement("link");
    css.rel = "stylesheet";
    css.href = new URL("./panel.css", import.meta.url).href;
    document.head.appendChild(css);
    tab.root = document.createElement("div");
    tab.root.className = "h3ms-tab";
    tab.panel = new Panel(tab.root, api.apiURL("/h3multistream/"));
    tab.panel.followComfyApi(api);
  }
  return tab.panel;
}

function registerTab() {
  const em = app.extensionManager;
  if (!em || typeof em.registerSidebarTab !== "function") {
    console.warn("[H3 MultiStream] this ComfyUI frontend has no sidebar tabs; use the menu's Open live panel");
    return;
  }
  em.registerSidebarTab({
    id: TAB_ID, icon: "pi pi-chart-bar", title: "H3 MultiStream", tooltip: "H3 MultiStream live panel",
    type: "custom",
    render: (container) => {
      const panel = tabPanel();
      container.appendChild(tab.root);
      panel.load();
    },
    destroy: () => { if (tab.panel) tab.panel.stopStatus(); },
  });
}

// ---- commands

function action(path, summary) {
  return async () => {
    try {
      const body = await call(path);
      toast(body.busy ? "warn" : "success", summary, body.message || describe(body));
    } catch (err) {
      toast("error", summary, err.message);
    }
  };
}

// a release action's tooltip: what it frees (panel.js's ACTIONS, shared with the panel's buttons)
const tip = (path) => ACTIONS.find(([p]) => p === path)[2];

const commands = [
  {
    id: `${EXT}.Status`, label: "Show status", icon: "pi pi-info-circle",
    function: async () => {
      try {
        toast("info", "H3 MultiStream status", statusLines(await call("/h3multistream/status", "GET")).join("\n"));
      } catch (err) {
        toast("error", "H3 MultiStream status", err.message);
      }
    },
  },
  {
    id: `${EXT}.OpenPanel`, label: "Open live panel", icon: "pi pi-chart-bar",
    function: () => window.open(api.apiURL("/h3multistream/panel"), "_blank", "noopener"),
  },
  { id: `${EXT}.ShowTab`, label: "Show live panel tab", icon: "pi pi-window-maximize",
    function: () => app.extensionManager.command.execute(`Workspace.ToggleSidebarTab.${TAB_ID}`) },
  { id: `${EXT}.ReleaseWorkers`, label: "Release workers", icon: "pi pi-power-off", tooltip: tip("workers/release"),
    function: action("/h3multistream/workers/release", "Release workers") },
  { id: `${EXT}.ClearWeightStore`, label: "Clear weight store", icon: "pi pi-trash",
    tooltip: tip("cache/clear_weights"),
    function: action("/h3multistream/cache/clear_weights", "Clear weight store") },
  { id: `${EXT}.DetachHooks`, label: "Detach hooks", icon: "pi pi-link", tooltip: tip("hooks/detach"),
    function: action("/h3multistream/hooks/detach", "Detach hooks") },
];

app.registerExtension({
  name: `${EXT}.Controls`,
  commands,
  menuCommands: [{ path: ["H3 MultiStream"], commands: commands.map((c) => c.id) }],
  setup() {
    registerTab();
    tabPanel(); // follows the step records from the start, so the tab shows the run it opens into
    // ComfyUI's own error dialog shows the whole traceback; this toast says which rank failed and where its log is
    api.addEventListener("execution_error", (e) => {
      const failure = packFailure(e.detail);
      if (failure) toast("error", failure.summary, failure.detail);
    });
  },
});
