// H3 MultiStream live panel.
//
// An ES module with two uses:
//  - on web/panel.html (standalone server, or /api/h3multistream/panel inside ComfyUI) it finds #h3ms-panel and runs
//    the full page: step history, per-rank bars, workers, plans/caches/hooks;
//  - ComfyUI loads every .js of the pack's web/ as an extension module, so on ComfyUI's page this file is imported
//    too: it then only exports the renderers (the docked panel of h3ms_async.js uses them) and starts nothing.
// All data goes into the DOM through textContent, never innerHTML: worker states and paths are not trusted markup.

export const COLORS = { compute: "#4e9af1", exchange: "#f0a53a", wait: "#8a8f99" };
const SVG_NS = "http://www.w3.org/2000/svg";

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

function el(tag, text, attrs) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (attrs) for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

// One stacked bar (compute | exchange | wait) for a rank, scaled so that `scale` seconds fill the width.
export function rankBar(rank, scale) {
  const bar = el("div", null, { class: "h3ms-bar", title:
    `rank ${rank.rank}: compute ${fmtSec(rank.compute_s)}s, exchange ${fmtSec(rank.exchange_s)}s, wait ${fmtSec(rank.wait_s)}s` });
  bar.style.cssText = "display:flex;height:12px;width:100%;background:rgba(128,128,128,.15);border-radius:3px;overflow:hidden";
  for (const part of ["compute", "exchange", "wait"]) {
    const seg = el("div", null, { class: `h3ms-seg ${part}` });
    const pct = scale > 0 ? (100 * rank[`${part}_s`]) / scale : 0;
    seg.style.cssText = `width:${Math.max(0, Math.min(100, pct)).toFixed(2)}%;background:${COLORS[part]}`;
    bar.appendChild(seg);
  }
  return bar;
}

// The time that fills a bar: the slowest rank's total, or the step's wall time if that is longer.
export function barScale(rec) {
  return Math.max(rec.wall_s || 0, ...rec.ranks.map((r) => r.compute_s + r.exchange_s + r.wait_s));
}

// An SVG sparkline of step wall times (oldest left).
export function sparkline(walls, width = 300, height = 48) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "h3ms-sparkline");
  if (walls.length === 0) return svg;
  // min..max, not 0..max: step-to-step variation is what the sparkline is for
  const max = Math.max(...walls), min = Math.min(...walls);
  const span = max - min || 1;
  const dx = walls.length > 1 ? width / (walls.length - 1) : 0;
  const y = (w) => (max === min ? height / 2 : height - 4 - ((w - min) / span) * (height - 8));
  const pts = walls.map((w, i) => `${(i * dx).toFixed(1)},${y(w).toFixed(1)}`);
  const line = document.createElementNS(SVG_NS, "polyline");
  line.setAttribute("points", pts.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", COLORS.compute);
  line.setAttribute("stroke-width", "2");
  line.setAttribute("vector-effect", "non-scaling-stroke");
  svg.appendChild(line);
  const title = document.createElementNS(SVG_NS, "title");
  title.textContent = `last ${walls.length} steps, ${min.toFixed(3)}–${max.toFixed(3)} s, latest ${walls[walls.length - 1].toFixed(3)} s`;
  svg.appendChild(title);
  return svg;
}

export function stepSummary(rec) {
  const sigma = rec.sigma === null ? "" : `sigma ${Number(rec.sigma).toFixed(4)} · `;
  const chunks = rec.chunks > 1 ? ` ×${rec.chunks}` : "";
  return `step ${rec.seq} · ${sigma}${rec.tokens} tokens × ${rec.blocks} blocks on ${rec.devices.join("+")} · ` +
    `${fmtSec(rec.wall_s)} s · exchange ${rec.exchange}${chunks} · ${fmtBytes(rec.moved_bytes)} moved · ` +
    `weight store ${rec.weight_store}`;
}

// Compact view for the docked panel inside ComfyUI: one bar per rank + the sparkline.
export function renderCompact(container, rec, walls) {
  container.replaceChildren();
  if (!rec) {
    container.appendChild(el("div", "no split step yet"));
    return;
  }
  container.appendChild(el("div", stepSummary(rec), { class: "h3ms-compact-summary" }));
  const scale = barScale(rec);
  for (const r of rec.ranks) {
    const row = el("div", null, { class: "h3ms-compact-rank", "data-rank": String(r.rank) });
    row.style.cssText = "display:grid;grid-template-columns:8.5em 1fr;gap:6px;align-items:center;margin:3px 0";
    row.appendChild(el("span", `r${r.rank} ${r.device}`));
    row.appendChild(rankBar(r, scale));
    container.appendChild(row);
  }
  container.appendChild(sparkline(walls, 300, 36));
}

// ---------------------------------------------------------------------------------------------------------------
// the full page

class Panel {
  constructor(root, base) {
    this.root = root;
    this.base = base; // ends with "/", e.g. http://127.0.0.1:8189/h3multistream/
    this.steps = [];
    this.lastSeq = null;
    this.pollTimer = null;
    this.$ = (id) => root.querySelector("#" + id);
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
      tbody.appendChild(tr);
    }
    const spark = this.$("h3ms-spark");
    spark.replaceChildren(sparkline(this.steps.map((s) => s.wall_s), 600, 60));
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
    this.$("h3ms-ram").textContent = st.ram.text + (st.log_dir ? ` · logs in ${st.log_dir}` : "");
    const tbody = this.$("h3ms-workers").tBodies[0];
    tbody.replaceChildren();
    if (!Array.isArray(st.workers)) {
      const tr = el("tr");
      tr.appendChild(el("td", `workers unavailable: ${st.workers.error}`, { colspan: "9", class: "error" }));
      tbody.appendChild(tr);
    } else if (st.workers.length === 0) {
      const tr = el("tr");
      tr.appendChild(el("td", "no workers running", { colspan: "9", class: "dim" }));
      tbody.appendChild(tr);
    }
    for (const w of Array.isArray(st.workers) ? st.workers : []) {
      const tr = el("tr", null, { id: `h3ms-worker-${w.rank}` });
      tr.appendChild(el("td", w.rank));
      tr.appendChild(el("td", w.device));
      tr.appendChild(el("td", w.pid ?? ""));
      tr.appendChild(el("td", w.state + (w.busy ? " (busy)" : "")));
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
    this.renderAttention(st.attention);
    const show = (id, v) => { this.$(id).textContent = JSON.stringify(v, null, 1); };
    show("h3ms-plans", st.plans);
    show("h3ms-weight-store", st.weight_store);
    show("h3ms-caches", st.caches);
    show("h3ms-hooks", st.hooks);
    show("h3ms-vae-workers", st.vae_workers);
    show("h3ms-vae-split", st.vae_split);
    show("h3ms-te-outputs", st.text_encoder_outputs);
    if (st.last_step && st.last_step.seq !== undefined) this.addSteps([st.last_step]);
  }

  // H3 Attention Parallel: one row per device of each engine (rank 0 = the model's device, in ComfyUI's process),
  // with the heads and seconds of the engine's last call.
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
          helper ? helper.state : "ComfyUI", rank ? `${rank.heads[0]}–${rank.heads[1]}` : ""]) tr.appendChild(el("td", text));
        for (const k of ["compute_s", "h2d_s", "d2h_s"]) tr.appendChild(el("td", rank ? fmtSec(rank[k]) : "", { class: "num" }));
        tr.appendChild(el("td", r === 0 ? eng.calls : helper ? helper.jobs_done ?? "" : "", { class: "num" }));
        tbody.appendChild(tr);
      });
      if (last) lines.push(`last call: ${last.tokens} tokens × ${last.heads} heads in ${fmtSec(last.wall_s)} s, ` +
        `${fmtBytes(last.moved_bytes)} moved (${last.transport}${last.gb_per_s ? `, ${last.gb_per_s.toFixed(1)} GB/s` : ""})`);
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
      out.textContent = (body.busy ? "busy: " : "") + (body.message || JSON.stringify(body));
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

  // Server-Sent Events where the server has them (standalone); ComfyUI answers 404 there, so fall back to polling.
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
      if (!opened) { es.close(); this.startPolling(); }
    });
  }

  // feed: "poll" forces polling; streamSeconds: how long one event stream lasts before EventSource reconnects
  async start(feed, streamSeconds) {
    for (const b of this.root.querySelectorAll("button[data-action]")) {
      b.addEventListener("click", () => this.runAction(b.dataset.action));
    }
    await this.pollSteps();
    await this.refreshStatus();
    setInterval(() => this.refreshStatus(), 3000);
    if (feed !== "poll" && typeof EventSource !== "undefined") this.startEvents(streamSeconds);
    else this.startPolling();
    this.root.setAttribute("data-loaded", "1");
  }
}

const pageRoot = typeof document !== "undefined" ? document.getElementById("h3ms-panel") : null;
if (pageRoot) {
  const params = new URLSearchParams(location.search);
  // the page is served at <prefix>/h3multistream/panel, so "." is the routes' base under any prefix (/api in ComfyUI)
  const base = new URL(".", location.href).href;
  new Panel(pageRoot, base).start(params.get("feed"), params.get("stream_s"));
}
