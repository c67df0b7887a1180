// H3 MultiStream (async) — ComfyUI frontend extension.
//
// Main-menu entry "H3 MultiStream" with the status toast, the live panel, and the release/clear/detach actions,
// plus a small docked panel fed by the "h3multistream.step" websocket event (per-rank compute / exchange / wait bars
// of the latest step and the per-rank chart of step times), and a toast naming the rank and its log when a prompt
// fails in a worker.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { renderCompact, fmtBytes, fmtSec } from "./panel.js";

const EXT = "H3MultiStreamAsync";
const STEPS_KEPT = 60;

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
  else for (const [k, v] of plans) lines.push(`GPUs (${k}): ${typeof v === "string" ? v : JSON.stringify(v)}`);
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
    lines.push(`Attention parallel: ${eng.devices.join("+")} (${eng.transport}), ${eng.calls} call(s)` + (last ? `; last ` +
      `${fmtSec(last.wall_s)}s, compute ${last.ranks.map((r) => fmtSec(r.compute_s)).join("/")}s` : ""));
  }
  const ws = st.weight_store || {};
  lines.push("Weight store: " + (ws.error || ws.state || JSON.stringify(ws)));
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
// then "--- last lines of LOG ---" and the log's tail (h3ms_async/runtime/pool.py words it so); the summary names the rank,
// the detail the log file and its last lines.
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

// ---- docked live panel

const dock = { el: null, body: null, steps: [], dismissed: false };

function ensureDock() {
  if (dock.el) return dock.el;
  const el = document.createElement("div");
  el.id = "h3ms-dock";
  el.style.cssText = "position:fixed;right:12px;bottom:12px;z-index:1000;width:360px;padding:8px 10px;" +
    "background:rgba(22,24,29,.94);color:#e4e6eb;border:1px solid #3a3f4a;border-radius:8px;" +
    "font:12px/1.35 system-ui,sans-serif;box-shadow:0 4px 16px rgba(0,0,0,.4)";
  const head = document.createElement("div");
  head.style.cssText = "display:flex;justify-content:space-between;align-items:center;margin-bottom:4px";
  const title = document.createElement("b");
  title.textContent = "H3 MultiStream — live";
  const close = document.createElement("button");
  close.textContent = "×";
  close.title = "hide (H3 MultiStream menu: Show docked panel)";
  close.style.cssText = "background:none;border:none;color:inherit;font-size:16px;cursor:pointer";
  close.addEventListener("click", () => { dock.dismissed = true; el.style.display = "none"; });
  head.append(title, close);
  dock.body = document.createElement("div");
  el.append(head, dock.body);
  document.body.appendChild(el);
  dock.el = el;
  renderCompact(dock.body, dock.steps);
  return el;
}

function onStep(rec) {
  if (!rec || !Array.isArray(rec.ranks)) return;
  dock.steps.push(rec);
  if (dock.steps.length > STEPS_KEPT) dock.steps.splice(0, dock.steps.length - STEPS_KEPT);
  if (dock.dismissed) return;
  ensureDock().style.display = "";
  renderCompact(dock.body, dock.steps);
}

function toggleDock() {
  const el = ensureDock();
  const hidden = el.style.display === "none";
  dock.dismissed = !hidden;
  el.style.display = hidden ? "" : "none";
}

// ---- commands

function action(path, summary) {
  return async () => {
    try {
      const body = await call(path);
      toast(body.busy ? "warn" : "success", summary, body.message || JSON.stringify(body));
    } catch (err) {
      toast("error", summary, err.message);
    }
  };
}

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
  { id: `${EXT}.ToggleDock`, label: "Show docked panel", icon: "pi pi-window-maximize", function: toggleDock },
  { id: `${EXT}.ReleaseWorkers`, label: "Release workers", icon: "pi pi-power-off",
    function: action("/h3multistream/workers/release", "Release workers") },
  { id: `${EXT}.ClearWeightStore`, label: "Clear weight store", icon: "pi pi-trash",
    function: action("/h3multistream/cache/clear_weights", "Clear weight store") },
  { id: `${EXT}.DetachHooks`, label: "Detach hooks", icon: "pi pi-link",
    function: action("/h3multistream/hooks/detach", "Detach hooks") },
];

app.registerExtension({
  name: `${EXT}.Controls`,
  commands,
  menuCommands: [{ path: ["H3 MultiStream"], commands: commands.map((c) => c.id) }],
  setup() {
    api.addEventListener("h3multistream.step", (e) => onStep(e.detail));
    // ComfyUI's own error dialog shows the whole traceback; this toast says which rank failed and where its log is
    api.addEventListener("execution_error", (e) => {
      const failure = packFailure(e.detail);
      if (failure) toast("error", failure.summary, failure.detail);
    });
  },
});
