// H3 MultiStream live panel: one renderer (class Panel, which also builds its own DOM) for two places.
//  - web/panel.html (standalone `python -m h3ms_async serve`, or /api/h3multistream/panel inside ComfyUI): the page
//    finds #h3ms-panel and runs the panel fed by the standalone server's event stream or ComfyUI's websocket;
//  - ComfyUI's sidebar tab (h3ms_async.js): the same Panel, fed by ComfyUI's own api events. ComfyUI loads every
//    .js of the pack's web/ as an extension module, so on ComfyUI's page this file only exports and starts nothing.
// Step history with the per-rank chart, per-rank bars, workers and their logs, the GPU plan, weight store, caches,
// hooks and exactness verdicts as readable rows, and the release actions.
// All data goes into the DOM through textContent, never innerHTML: worker states and paths are not trusted markup.

export const COLORS = { compute: "#4e9af1", hidden: "#3fb37f", exposed: "#f0a53a" };
// The rank bar's parts: what its blocks' time was, as the step record's per-block timings say.
export const BAR_PARTS = [["compute", "compute"], ["hidden", "compute with hidden copy"], ["exposed", "exposed wait"]];
const SVG_NS = "http://www.w3.org/2000/svg";

// A rank's block weights as its step record gives them: in VRAM (resident / streamed blocks) or the host store.
export function rankWeights(r) {
  if (r.resident_blocks === null || r.resident_blocks === undefined) return "host store";
  return `${fmtBytes(r.weights_vram_bytes)} in VRAM · ${r.resident_blocks} resident, ${r.streamed_blocks} streamed`;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "n/a";
  const gib = 1024 ** 3;
  if (n >= gib) return (n / gib).toFixed(2) + " GiB";
  if (n >= 1024 ** 2) return (n / 1024 ** 2).toFixed(1) + " MiB";
  return (n / 1024).toFixed(1) + " KiB";
}

export function fmtSec(s) {
  return s === null || s === undefined ? "n/a" : Number(s).toFixed(3);
}

function fmtUptime(s) {
  if (s === null || s === undefined) return "";
  s = Math.floor(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

// The release actions the panel's buttons and the menu entries run: route (under /h3multistream/), label, and what it
// frees (their tooltip). The answer's message says what each gave back.
export const ACTIONS = [
  ["workers/release", "Release workers", "Stop every worker process (the split's, the attention helpers' and the " +
    "VAE split's): their VRAM is freed, and the split's shared-memory weight store with them."],
  ["cache/clear_weights", "Clear weight store", "Drop the split's shared-memory weight store (the workers stay up) " +
    "and the VAE / text-encoder weight caches' copies. RAM is freed where nothing else uses it; a model ComfyUI " +
    "has unloaded keeps its cached weights as its host weights (unpinned): the answer reports them as kept."],
  ["hooks/detach", "Detach hooks", "Make patched models run unsplit until their H3 MultiStream node runs again, " +
    "and remove the VAE split, VAE cache and text-encoder cache hooks. Frees no memory."],
];

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (attrs) for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// A rank's blocks added up (seconds): compute alone, compute while exchange copies ran (the copy hidden behind it),
// the exposed wait (its compute stream stood still for the exchange); `copy` is every copy's time, hidden or not.
export function blockTotals(rank) {
  const t = { compute: 0, copy: 0, hidden: 0, exposed: 0 };
  for (const b of rank.per_block || []) {
    t.compute += b.compute_s; t.copy += b.copy_s; t.hidden += b.hidden_s; t.exposed += b.exposed_s;
  }
  const hidden = Math.min(t.hidden, t.compute);
  return { compute: t.compute - hidden, hidden, exposed: t.exposed, copy: t.copy, blocks: t.compute + t.exposed };
}

const ms = (s) => (s * 1e3).toFixed(1);

// The bar's tooltip: the totals, then each block's four numbers.
export function blockDetail(rank) {
  const t = blockTotals(rank);
  const lines = [`rank ${rank.rank}: ${fmtSec(t.blocks)} s in ${(rank.per_block || []).length} blocks = compute ` +
    `${fmtSec(t.compute + t.hidden)} s (${fmtSec(t.hidden)} s of it hiding copies) + exposed wait ` +
    `${fmtSec(t.exposed)} s; exchange copies ${fmtSec(t.copy)} s`];
  (rank.per_block || []).forEach((b, i) => lines.push(`block ${i}: compute ${ms(b.compute_s)} ms · copy ` +
    `${ms(b.copy_s)} ms (hidden ${ms(b.hidden_s)}) · exposed ${ms(b.exposed_s)} ms`));
  return lines.join("\n");
}

// One stacked bar (compute | compute with hidden copy | exposed wait) for a rank's blocks, scaled so that `scale`
// seconds fill the width; hovering shows every block's numbers.
export function rankBar(rank, scale) {
  const bar = el("div", null, { class: "h3ms-bar", title: blockDetail(rank) });
  bar.style.cssText = "display:flex;height:12px;width:100%;background:rgba(128,128,128,.15);border-radius:3px;" +
    "overflow:hidden";
  const t = blockTotals(rank);
  for (const [part] of BAR_PARTS) {
    const seg = el("div", null, { class: `h3ms-seg ${part}`, "data-part": part, "data-seconds": t[part].toFixed(6) });
    const pct = scale > 0 ? (100 * t[part]) / scale : 0;
    seg.style.cssText = `width:${Math.max(0, Math.min(100, pct)).toFixed(2)}%;background:${COLORS[part]}`;
    bar.appendChild(seg);
  }
  return bar;
}

// The time that fills a bar: the slowest rank's blocks.
export function barScale(rec) {
  return Math.max(0, ...rec.ranks.map((r) => blockTotals(r).blocks));
}

// Line colours of ranks 0..7 (then they repeat).
export const RANK_COLORS = ["#4e9af1", "#f0a53a", "#3fb37f", "#d16ba5", "#a98bf5", "#e0653a", "#5fc9d3", "#c9c35f"];
const CHART_STEPS = 60;

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

// Per-step time per rank, oldest left: one solid line per rank (its compute + exchange seconds: the time it worked)
// and a dashed line for the step's wall time, so the gap under the wall line is that rank's wait. The y axis starts
// at 0. Plain SVG, no chart library.
export function stepChart(steps, width = 600, height = 150) {
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, class: "h3ms-chart", role: "img" });
  const shown = steps.slice(-CHART_STEPS);
  if (shown.length === 0) {
    svg.appendChild(svgEl("text", { x: 8, y: height / 2, class: "h3ms-chart-label" }, "no split step yet"));
    return svg;
  }
  const pad = { l: 46, r: 8, t: 18, b: 18 };
  const worked = (r) => r.compute_s + r.exchange_s;
  const top = Math.max(...shown.map((s) => Math.max(s.wall_s, ...s.ranks.map(worked)))) * 1.1 || 1;
  const dx = shown.length > 1 ? (width - pad.l - pad.r) / (shown.length - 1) : 0;
  const x = (i) => (pad.l + i * dx).toFixed(1);
  const y = (v) => (height - pad.b - (v / top) * (height - pad.t - pad.b)).toFixed(1);
  const axis = { class: "h3ms-chart-axis", stroke: "rgba(128,128,128,.5)", "stroke-width": 1 };
  svg.appendChild(svgEl("line", { ...axis, x1: pad.l, y1: pad.t, x2: pad.l, y2: height - pad.b }));
  svg.appendChild(svgEl("line", { ...axis, x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b }));
  const label = (attrs, text) => svg.appendChild(svgEl("text", { class: "h3ms-chart-label", fill: "currentColor",
    "font-size": 10, ...attrs }, text));
  label({ x: pad.l - 4, y: pad.t + 4, "text-anchor": "end" }, `${top.toFixed(3)} s`);
  label({ x: pad.l - 4, y: height - pad.b, "text-anchor": "end" }, "0");
  label({ x: pad.l, y: height - 4 }, `step ${shown[0].seq}`);
  label({ x: width - pad.r, y: height - 4, "text-anchor": "end" }, `step ${shown[shown.length - 1].seq}`);
  const line = (pts, attrs) => svg.appendChild(svgEl("polyline", { points: pts.join(" "), fill: "none",
    "stroke-width": 2, "stroke-linejoin": "round", ...attrs }));
  line(shown.map((s, i) => `${x(i)},${y(s.wall_s)}`), { class: "h3ms-chart-wall", stroke: "#8a8f99",
    "stroke-dasharray": "4 3" });
  const ranks = Math.max(...shown.map((s) => s.ranks.length));
  let legendX = pad.l + 6;
  for (let r = 0; r < ranks; r++) {
    const color = RANK_COLORS[r % RANK_COLORS.length];
    const pts = [];
    shown.forEach((s, i) => { if (s.ranks[r]) pts.push(`${x(i)},${y(worked(s.ranks[r]))}`); });
    const pl = line(pts, { class: "h3ms-chart-rank", "data-rank": r, stroke: color });
    const last = shown.filter((s) => s.ranks[r]).pop().ranks[r];
    pl.appendChild(svgEl("title", {}, `rank ${r}: compute + exchange per step (latest ${fmtSec(worked(last))} s, ` +
      `wait ${fmtSec(last.wait_s)} s)`));
    label({ x: legendX, y: 11, fill: color }, `r${r}`);
    legendX += 26;
  }
  label({ x: legendX, y: 11 }, "─ compute+exchange   ╌ wall");
  return svg;
}

export function stepSummary(rec) {
  const sigma = rec.sigma === null ? "" : `sigma ${Number(rec.sigma).toFixed(4)} · `;
  const chunks = (rec.chunks > 1 ? ` ×${rec.chunks}` : "") + (rec.ipc_sync ? ` (${rec.ipc_sync}-ordered)` : "");
  const pieces = (rec.head_pieces > 1 ? ` · attention in ${rec.head_pieces} head pieces` : "") +
    (rec.gather_overlap ? " · qkv as the rows arrive" : "") +
    (rec.gather_ahead > 1 ? ` · next block's rows sent in ${rec.gather_ahead} pieces of the MLP` : "") +
    (rec.overlap_tuning ? ` · overlaps ${rec.overlap_tuning}` : "");
  return `step ${rec.seq} · ${sigma}${rec.tokens} tokens × ${rec.blocks} blocks on ${rec.devices.join("+")} · ` +
    `${fmtSec(rec.wall_s)} s · exchange ${rec.exchange}${chunks}${pieces} · ${fmtBytes(rec.moved_bytes)} moved · ` +
    `weight store ${rec.weight_store}`;
}

// ---------------------------------------------------------------------------------------------------------------
// readable rows: a status entry as "label value · label value" text, never JSON

// "fill_seconds" -> "fill", "vram_peak_bytes" -> "vram peak", "max_entries" -> "max entries"
function label(key) {
  return key.replace(/_(bytes|s|seconds|ms|gb)$/, "").replace(/_/g, " ");
}

// One value in words; the key's unit suffix picks the format (bytes, seconds, milliseconds, GB).
export function human(key, v) {
  if (v === null || v === undefined) return "none";
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (typeof v === "number") {
    if (key === "bytes" || key.endsWith("_bytes")) return fmtBytes(v);
    if (key.endsWith("_s") || key.endsWith("_seconds")) return `${fmtSec(v)} s`;
    if (key.endsWith("_ms")) return `${Number(v).toFixed(1)} ms`;
    if (key.endsWith("_gb")) return `${v} GB`;
    return String(v);
  }
  if (Array.isArray(v)) {
    if (v.length === 0) return "none";
    // a cache key: its parts are digests (sizes, times, option reprs); the file it names is what a user knows
    if (key === "key") return v.filter((x) => String(x).includes("/")).join(", ") || String(v[0]);
    return v.map((x) => (x !== null && typeof x === "object" ? `(${describe(x)})` : human(key, x))).join(", ");
  }
  if (typeof v === "object") return describe(v);
  return String(v);
}

// Every field of `obj` but `skip`, in words: "exchange host · exchange chunks 8 · shares 1, 1".
export function describe(obj, skip = []) {
  const parts = Object.entries(obj || {}).filter(([k]) => !skip.includes(k))
    .map(([k, v]) => (v !== null && typeof v === "object" && !Array.isArray(v)
      ? `${label(k)}: ${describe(v)}` : `${label(k)} ${human(k, v)}`));
  return parts.length ? parts.join(" · ") : "—";
}

// The rows of one status section: [label, text] pairs, or an empty-state line.
const SECTIONS = [
  ["plans", "GPU plan", (v) => Object.entries(v).flatMap(([kind, plans]) => (Array.isArray(plans) ? plans : [plans])
    .map((p) => [`${kind} on ${(p.devices || []).join(" + ")}`, describe(p, ["devices"])])), "no plan yet"],
  ["weight_store", "Weight store", (v) => [[v.state || "store", describe(v, ["state"])]], "empty"],
  ["caches", "Caches", (v) => v.map((c) => [c.group, describe(c, ["group"])]), "none"],
  ["hooks", "Hooks", (v) => v.map((h) => [h.hook || h.kind, describe(h, ["hook", "kind"])]), "none attached"],
  ["vae_workers", "VAE workers", (v) => v.map((w) => [`rank ${w.rank} ${w.device}`, describe(w, ["rank", "device"])]),
    "none running"],
  ["vae_split", "VAE split", (v) => (v.engines || []).map((e) => [(e.devices || []).join(" + "),
    describe(e, ["devices"])]), "no engine"],
  ["text_encoder_outputs", "Text-encoder outputs", (v) => [["output cache", describe(v)]], "off"],
];

const VERDICT_COLS = ["program", "op", "device", "dtype", "shape", "shards", "verdict", "detail", "probe_ms", "at"];
const VERIFY_COLS = ["at", "devices", "bit_exact", "max_abs_diff", "first_difference", "steps_checked"];

function table(id, cols) {
  const t = el("table", null, { id });
  const tr = el("tr");
  for (const c of cols) tr.appendChild(el("th", c));
  t.appendChild(el("thead")).appendChild(tr);
  t.appendChild(el("tbody"));
  return t;
}

function section(title, ...children) {
  const s = el("section");
  s.appendChild(el("h2", title));
  s.append(...children);
  return s;
}

const scroll = (child) => { const d = el("div", null, { class: "h3ms-scroll" }); d.appendChild(child); return d; };

// The panel's DOM, built here so the page and the sidebar tab are the same panel.
function buildPanel(root) {
  root.classList.add("h3ms-panel");
  const head = el("header");
  head.appendChild(el("h1", "H3 MultiStream")).appendChild(el("span", " live panel", { class: "sub" }));
  const badges = el("div", null, { class: "badges" });
  badges.append(el("span", "…", { id: "h3ms-running", class: "badge" }), el("span", "", { id: "h3ms-version",
    class: "badge dim" }), el("span", "", { id: "h3ms-feed", class: "badge dim" }));
  head.append(badges, el("div", "", { id: "h3ms-ram", class: "dim" }), el("div", "", { id: "h3ms-error",
    class: "error", hidden: "" }));
  const legend = el("div", null, { class: "legend" });
  for (const [part, text] of BAR_PARTS) {
    const s = el("span");
    s.append(el("i", null, { class: `sw ${part}` }), text);
    legend.appendChild(s);
  }
  legend.appendChild(el("span", "(the bar: a rank's blocks; hover it for each block)", { class: "dim" }));
  const actions = el("div", null, { class: "actions" });
  for (const [path, text, tip] of ACTIONS) actions.appendChild(el("button", text, { "data-action": path, title: tip }));
  actions.appendChild(el("span", "", { id: "h3ms-action-result", class: "dim" }));
  const exact = el("div", null, { id: "h3ms-exactness" });
  const heads = (cols) => cols.map((c) => c.replace(/_/g, " "));
  exact.append(el("h3", "Plan verdicts"), scroll(table("h3ms-verdicts", heads(VERDICT_COLS))),
    el("div", "", { id: "h3ms-verdicts-empty", class: "dim" }), el("h3", "Verify runs"),
    scroll(table("h3ms-verify", heads(VERIFY_COLS))), el("div", "", { id: "h3ms-verify-empty", class: "dim" }));
  const status = el("div", null, { class: "cols" });
  for (const [key, title] of SECTIONS) {
    const box = el("div", null, { id: `h3ms-section-${key}`, class: "h3ms-rows" });
    box.appendChild(el("h3", title));
    box.appendChild(el("dl"));
    status.appendChild(box);
  }
  root.replaceChildren(
    head,
    section("Latest step", el("div", "no split step recorded yet", { id: "h3ms-last-summary", class: "summary" }),
      legend, scroll(table("h3ms-ranks", ["rank", "device", "tokens", "heads", "time split", "compute s",
        "exchange s", "wait s", "moved", "VRAM peak", "weights"]))),
    section("Step history", el("div", null, { id: "h3ms-chart", class: "chart", title: "per step: each rank's " +
      "compute + exchange seconds (solid) and the step's wall time (dashed); the gap is the rank's wait" }),
    scroll(table("h3ms-history", ["seq", "at", "sigma", "tokens × blocks", "ranks", "exchange", "wall s", "moved",
      "weight store"]))),
    section("Workers", scroll(table("h3ms-workers", ["rank", "device", "pid", "state", "uptime", "RSS", "VRAM",
      "jobs", "log"])), actions, el("pre", "", { id: "h3ms-log", hidden: "" })),
    section("Exactness", exact),
    section("Attention parallel", scroll(table("h3ms-attention", ["device", "role", "pid", "state", "heads",
      "transport", "stage s", "copy in s", "compute s", "copy out s", "take-back s", "calls"])),
    el("div", "", { id: "h3ms-attention-summary", class: "dim" })),
    section("Resources", status),
  );
  root.querySelector("#h3ms-ranks th:nth-child(5)").classList.add("barcol");
}

export class Panel {
  // root: an empty element; base: the routes' URL ending in "/" (e.g. http://127.0.0.1:8189/h3multistream/)
  constructor(root, base) {
    this.root = root;
    this.base = base;
    this.steps = [];
    this.lastSeq = null;
    this.pollTimer = null;
    this.statusTimer = null;
    buildPanel(root);
    this.$ = (id) => root.querySelector("#" + id);
    for (const b of root.querySelectorAll("button[data-action]")) {
      b.addEventListener("click", () => this.runAction(b.dataset.action));
    }
  }

  async getJSON(path, opts) {
    const resp = await fetch(this.base + path, { cache: "no-store", ...opts });
    let body = {};
    try { body = await resp.json(); } catch { body = {}; }
    if (!resp.ok) throw new Error(body.error || `${resp.status} ${resp.statusText}`);
    return body;
  }

  showError(err) {
    const box = this.$("h3ms-error");
    box.hidden = !err;
    box.textContent = err ? String(err.message || err) : "";
  }

  addSteps(recs) {
    for (const r of recs) {
      if (this.lastSeq !== null && r.seq <= this.lastSeq) continue;
      this.steps.push(r);
      this.lastSeq = r.seq;
    }
    if (this.steps.length > 256) this.steps.splice(0, this.steps.length - 256);
    this.renderSteps();
  }

  renderSteps() {
    const rec = this.steps[this.steps.length - 1];
    const tbody = this.$("h3ms-ranks").tBodies[0];
    tbody.replaceChildren();
    if (!rec) return;
    this.$("h3ms-last-summary").textContent = stepSummary(rec);
    const scale = barScale(rec);
    for (const r of rec.ranks) {
      const tr = el("tr", null, { id: `h3ms-rank-${r.rank}`, "data-rank": String(r.rank) });
      tr.appendChild(el("td", r.rank));
      tr.appendChild(el("td", r.device));
      tr.appendChild(el("td", `${r.tokens[0]}–${r.tokens[1]} (${r.tokens[1] - r.tokens[0]})`));
      tr.appendChild(el("td", `${r.heads[0]}–${r.heads[1]} (${r.heads[1] - r.heads[0]})`));
      const barTd = el("td", null, { class: "barcol" });
      barTd.appendChild(rankBar(r, scale));
      tr.appendChild(barTd);
      tr.appendChild(el("td", fmtSec(r.compute_s), { class: "num compute" }));
      tr.appendChild(el("td", fmtSec(r.exchange_s), { class: "num exchange" }));
      tr.appendChild(el("td", fmtSec(r.wait_s), { class: "num wait" }));
      tr.appendChild(el("td", fmtBytes(r.moved_bytes), { class: "num" }));
      tr.appendChild(el("td", fmtBytes(r.vram_peak_bytes), { class: "num" }));
      tr.appendChild(el("td", rankWeights(r), { class: "weights", title: "where this rank's block weights " +
        "live: GPU ranks keep as many blocks in VRAM as fit (vram_residency) and stream the rest from the " +
        "pinned store each step; CPU ranks read the host store" }));
      tbody.appendChild(tr);
    }
    const chart = this.$("h3ms-chart");
    chart.replaceChildren(stepChart(this.steps, chart.clientWidth || 1000, 170));
    const hist = this.$("h3ms-history").tBodies[0];
    hist.replaceChildren();
    for (const s of this.steps.slice(-20).reverse()) {
      const tr = el("tr", null, { "data-seq": String(s.seq) });
      tr.appendChild(el("td", s.seq));
      tr.appendChild(el("td", s.at.replace("T", " ")));
      tr.appendChild(el("td", s.sigma === null ? "" : Number(s.sigma).toFixed(4)));
      tr.appendChild(el("td", `${s.tokens} × ${s.blocks}`));
      tr.appendChild(el("td", s.ranks.length));
      tr.appendChild(el("td", s.exchange + (s.chunks > 1 ? ` ×${s.chunks}` : "")));
      tr.appendChild(el("td", fmtSec(s.wall_s), { class: "num" }));
      tr.appendChild(el("td", fmtBytes(s.moved_bytes), { class: "num" }));
      tr.appendChild(el("td", s.weight_store));
      hist.appendChild(tr);
    }
  }

  renderStatus(st) {
    const running = this.$("h3ms-running");
    running.textContent = st.running ? "running" : "idle";
    running.className = "badge " + (st.running ? "running" : "idle");
    this.$("h3ms-version").textContent = "v" + st.version;
    this.$("h3ms-ram").textContent = st.ram.text;
    this.renderWorkers(st.workers);
    this.renderAttention(st.attention);
    this.renderExactness(st.exactness);
    for (const [key, , rows, empty] of SECTIONS) {
      const dl = this.$(`h3ms-section-${key}`).querySelector("dl");
      const v = st[key];
      let pairs;
      if (v && v.error) pairs = [["unavailable", v.error]];
      else pairs = v && (Array.isArray(v) ? v.length : Object.keys(v).length) ? rows(v) : [];
      dl.replaceChildren();
      if (!pairs.length) dl.appendChild(el("dd", empty, { class: "dim" }));
      for (const [k, text] of pairs) dl.append(el("dt", k), el("dd", text));
    }
    // a newer step than the feed has shown: fetch every one since, because adding the lone last one would make
    // addSteps skip the steps recorded between
    const last = st.last_step;
    if (last && last.seq !== undefined && (this.lastSeq === null || last.seq > this.lastSeq)) this.pollSteps();
  }

  renderWorkers(workers) {
    const tbody = this.$("h3ms-workers").tBodies[0];
    tbody.replaceChildren();
    if (!Array.isArray(workers)) {
      const tr = el("tr");
      tr.appendChild(el("td", `workers unavailable: ${workers.error}`, { colspan: "9", class: "error" }));
      tbody.appendChild(tr);
      return;
    }
    if (workers.length === 0) {
      const tr = el("tr");
      tr.appendChild(el("td", "no workers running", { colspan: "9", class: "dim" }));
      tbody.appendChild(tr);
    }
    for (const w of workers) {
      const tr = el("tr", null, { id: `h3ms-worker-${w.rank}` });
      tr.appendChild(el("td", w.rank));
      tr.appendChild(el("td", w.device));
      tr.appendChild(el("td", w.pid ?? ""));
      tr.appendChild(el("td", w.state));
      tr.appendChild(el("td", fmtUptime(w.uptime_s)));
      tr.appendChild(el("td", w.rss_bytes == null ? "" : fmtBytes(w.rss_bytes), { class: "num" }));
      tr.appendChild(el("td", w.vram_bytes == null ? "" : fmtBytes(w.vram_bytes), { class: "num" }));
      tr.appendChild(el("td", w.jobs_done ?? "", { class: "num" }));
      const logTd = el("td");
      const a = el("a", "tail", { href: `${this.base}workers/${w.rank}/log?lines=200` });
      a.addEventListener("click", (ev) => { ev.preventDefault(); this.showLog(w.rank); });
      logTd.appendChild(a);
      tr.appendChild(logTd);
      tbody.appendChild(tr);
    }
  }

  // The exactness section of the status document (STATUS_CONTRACT: the plan's probed verdicts and the verify
  // runs), newest first; an empty state where a producer has nothing (or the server has no such section).
  renderExactness(ex) {
    const fill = (id, cols, list, empty, cls) => {
      const tbody = this.$(id).tBodies[0];
      tbody.replaceChildren();
      const rows = Array.isArray(list) ? list : [];
      this.$(`${id}-empty`).textContent = ex && ex.error ? `unavailable: ${ex.error}` : rows.length ? "" : empty;
      for (const rec of [...rows].reverse()) {
        const tr = el("tr", null, { class: cls(rec) });
        for (const c of cols) {
          const v = c === "bit_exact" ? (rec[c] ? "yes" : "NO") : human(c, rec[c]);
          tr.appendChild(el("td", v, { class: c }));
        }
        tbody.appendChild(tr);
      }
    };
    fill("h3ms-verdicts", VERDICT_COLS, ex && ex.verdicts, "no plan probed yet",
      (r) => `verdict ${r.verdict}`);
    fill("h3ms-verify", VERIFY_COLS, ex && ex.verify, "no verify run yet (H3 MultiStream's verify input)",
      (r) => (r.bit_exact ? "verdict exact" : "verdict differs"));
  }

  // H3 Attention Parallel: one row per device of each engine (rank 0 = the model's device, in ComfyUI's process),
  // with the heads, transport and seconds per phase of the engine's last call.
  renderAttention(section) {
    const tbody = this.$("h3ms-attention").tBodies[0];
    const summary = this.$("h3ms-attention-summary");
    tbody.replaceChildren();
    summary.textContent = "";
    if (!section) { summary.textContent = "not in use"; return; }
    if (section.error) { summary.textContent = `unavailable: ${section.error}`; return; }
    const lines = [];
    for (const eng of section.engines) {
      const last = eng.recent_calls.length ? eng.recent_calls[eng.recent_calls.length - 1] : null;
      eng.devices.forEach((device, r) => {
        const helper = r > 0 ? eng.helpers[r - 1] : null;
        const rank = last ? last.ranks[r] : null;
        const tr = el("tr", null, { class: "h3ms-attention-rank" });
        for (const text of [device, r === 0 ? "model" : `helper ${r}`, helper ? helper.pid ?? "" : "",
          helper ? helper.state : "ComfyUI", rank ? `${rank.heads[0]}–${rank.heads[1]}` : "",
          rank ? rank.transport : (r === 0 ? "local" : eng.transport)]) tr.appendChild(el("td", text));
        // the phases of the last call in pipeline order (summed over a helper's pieces)
        for (const k of ["stage_s", "h2d_s", "compute_s", "d2h_s", "return_s"]) {
          tr.appendChild(el("td", rank ? fmtSec(rank[k]) : "", { class: "num" }));
        }
        tr.appendChild(el("td", r === 0 ? eng.calls : helper ? helper.jobs_done ?? "" : "", { class: "num" }));
        tbody.appendChild(tr);
      });
      if (last) lines.push(`last call: ${last.tokens} tokens × ${last.heads} heads in ${fmtSec(last.wall_s)} s, ` +
        `${fmtBytes(last.moved_bytes)} moved (${last.transport}` +
        `${last.gb_per_s ? `, ${last.gb_per_s.toFixed(1)} GB/s` : ""})`);
    }
    summary.textContent = section.engines.length ? lines.join(" · ") : "no engine";
  }

  async showLog(rank) {
    const pre = this.$("h3ms-log");
    pre.hidden = false;
    try {
      const body = await this.getJSON(`workers/${rank}/log?lines=200`);
      pre.textContent = `rank ${rank} log (last ${body.lines.length} lines)\n` + body.lines.join("\n");
    } catch (err) {
      pre.textContent = `rank ${rank} log: ${err.message}`;
    }
  }

  async runAction(path) {
    const out = this.$("h3ms-action-result");
    try {
      const body = await this.getJSON(path, { method: "POST" });
      out.textContent = (body.busy ? "busy: " : "") + (body.message || describe(body));
    } catch (err) {
      out.textContent = "failed: " + err.message;
    }
    this.refreshStatus();
  }

  async refreshStatus() {
    try {
      this.renderStatus(await this.getJSON("status"));
      this.showError(null);
    } catch (err) {
      this.showError(err);
    }
  }

  // A ComfyUI websocket message: step records as they happen, and queue changes (a prompt that starts or ends may
  // start or release workers). ComfyUI sends both to every client; a prompt's errors go only to the page that
  // queued it (h3ms_async.js toasts them there).
  onComfyMessage(type, data) {
    if (type === "h3multistream.step") this.addSteps([data]);
    else if (type === "status") this.refreshStatus();
  }

  // Inside ComfyUI's own page: its api object already holds the websocket and re-dispatches each message as an
  // event of that type. Returns the function that detaches the listeners.
  followComfyApi(api) {
    const handlers = ["h3multistream.step", "status"].map((type) => {
      const h = (e) => this.onComfyMessage(type, e.detail);
      api.addEventListener(type, h);
      return [type, h];
    });
    this.$("h3ms-feed").textContent = "live (websocket)";
    return () => { for (const [type, h] of handlers) api.removeEventListener(type, h); };
  }

  // On the page inside ComfyUI there is no event stream; ComfyUI's websocket carries the step records instead.
  // Without it (or while it reconnects) the page polls.
  startSocket() {
    let ws;
    try {
      ws = new WebSocket(new URL("../ws", this.base).href.replace(/^http/, "ws"));
    } catch {
      this.startPolling();
      return;
    }
    let opened = false;
    ws.addEventListener("open", () => {
      opened = true;
      clearInterval(this.pollTimer);
      this.pollTimer = null;
      this.$("h3ms-feed").textContent = "live (websocket)";
      this.pollSteps(); // steps recorded before this connection
    });
    ws.addEventListener("message", (ev) => {
      if (typeof ev.data !== "string") return; // previews arrive as binary frames
      let msg;
      try { msg = JSON.parse(ev.data); } catch { return; }
      this.onComfyMessage(msg.type, msg.data);
    });
    ws.addEventListener("close", () => {
      this.startPolling();
      if (opened) setTimeout(() => this.startSocket(), 2000); // it worked before: ComfyUI restarted, try again
    });
  }

  async pollSteps() {
    const q = this.lastSeq === null ? "steps?n=50" : `steps?n=256&after=${this.lastSeq}`;
    try {
      this.addSteps((await this.getJSON(q)).steps);
      this.showError(null);
    } catch (err) {
      this.showError(err);
    }
  }

  startPolling() {
    this.$("h3ms-feed").textContent = "polling";
    if (!this.pollTimer) this.pollTimer = setInterval(() => this.pollSteps(), 1000);
  }

  // Server-Sent Events where the server has them (standalone); ComfyUI answers 404 there: its websocket instead.
  startEvents(streamSeconds) {
    const q = new URLSearchParams();
    if (this.lastSeq !== null) q.set("after", String(this.lastSeq));
    if (streamSeconds) q.set("timeout", streamSeconds);
    const es = new EventSource(this.base + "events?" + q.toString());
    let opened = false;
    es.addEventListener("open", () => { opened = true; this.$("h3ms-feed").textContent = "live (events)"; });
    es.addEventListener("step", (ev) => this.addSteps([JSON.parse(ev.data)]));
    es.addEventListener("error", () => {
      // before the first open: no event route here; afterwards EventSource reconnects by itself (Last-Event-ID)
      if (!opened) { es.close(); this.startSocket(); }
    });
  }

  // The steps so far and the status now, then the status every 3 s until stopStatus().
  async load() {
    await this.pollSteps();
    await this.refreshStatus();
    clearInterval(this.statusTimer);
    this.statusTimer = setInterval(() => this.refreshStatus(), 3000);
    this.root.setAttribute("data-loaded", "1");
  }

  stopStatus() {
    clearInterval(this.statusTimer);
    this.statusTimer = null;
  }

  // The page: feed "poll" forces polling; streamSeconds: how long one event stream lasts before EventSource
  // reconnects.
  async start(feed, streamSeconds) {
    await this.load();
    if (feed !== "poll" && typeof EventSource !== "undefined") this.startEvents(streamSeconds);
    else this.startPolling();
  }
}

const pageRoot = typeof document !== "undefined" ? document.getElementById("h3ms-panel") : null;
if (pageRoot) {
  const params = new URLSearchParams(location.search);
  // the page is served at <prefix>/h3multistream/panel, so "." is the routes' base under any prefix (/api in ComfyUI)
  const base = new URL(".", location.href).href;
  new Panel(pageRoot, base).start(params.get("feed"), params.get("stream_s"));
}
