// shuttle's live dashboard: reads GET /v1/stats/stream (Server-Sent Events, one JSON frame a tick) with fetch, so
// that the API key travels in an Authorization header (EventSource cannot send one), and draws with plain canvas.
// Key sources: the key field, or the address fragment #key=... (never sent to the server; removed from the address
// bar at once and kept in sessionStorage for this tab only). ?window=S sets the sliding window in seconds.
"use strict";

const params = new URLSearchParams(location.search);
const WINDOW_S = Number(params.get("window")) > 0 ? Number(params.get("window")) : 30;
const HISTORY_S = 120;  // the queue chart's time span
const MAX_BARS = 120;   // the step chart's last N steps (those within the window)
const STALE_S = 3;      // no frame for this long: the connection pill says so

const $ = (id) => document.getElementById(id);
const COLORS = {};  // the stylesheet's colours, read once
const css = (name) => COLORS[name] ??= getComputedStyle(document.documentElement).getPropertyValue(name).trim();

// Writes only what changed: an unchanged text or width set again still makes the browser redo layout.
function setText(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}
function setWidth(id, width) {
  const el = $(id);
  if (el.style.width !== width) el.style.width = width;
}

let key = sessionStorage.getItem("shuttle-api-key") || "";
if (location.hash.startsWith("#key=")) {
  key = decodeURIComponent(location.hash.slice(5));
  sessionStorage.setItem("shuttle-api-key", key);
  history.replaceState(null, "", location.pathname + location.search);
}

let config = null;
let history_ = [];  // {t, running, waiting}
let steps = [];     // {t, prefill, decode}
let lastFrameAt = 0;
let frames = 0;
let controller = null;

function setConnection(state) {
  const pill = $("connection");
  pill.dataset.state = state;
  pill.textContent = state;
}

function fmt(x, digits = 0) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  return Number(x).toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}

function pct(x) { return x === null || x === undefined ? "–" : fmt(100 * x, 1) + "%"; }

async function connect() {
  if (controller) controller.abort();
  const mine = controller = new AbortController();
  setConnection("connecting");
  try {
    const headers = key ? {Authorization: "Bearer " + key} : {};
    // relative to the page, so that a page served under --root-path reads the feed under it too
    const response = await fetch("./v1/stats/stream?window=" + encodeURIComponent(WINDOW_S),
                                 {headers, signal: mine.signal, cache: "no-store"});
    if (response.status === 401) {
      setConnection("unauthorized");
      $("key").focus();
      return;  // until a key is given
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    setConnection("live");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data: ")) onFrame(JSON.parse(line.slice(6)));
        }
      }
    }
  } catch (error) {
    if (mine.signal.aborted) return;
  }
  if (mine === controller) {
    setConnection("reconnecting");
    setTimeout(connect, 1000);
  }
}

function onFrame(f) {
  frames += 1;
  document.body.dataset.frames = frames;
  lastFrameAt = performance.now();
  if ($("connection").dataset.state !== "live") setConnection("live");
  if (f.config) showConfig(f.config);
  setText("status", f.status);
  if ($("status").dataset.status !== f.status) $("status").dataset.status = f.status;

  history_.push({t: f.time, running: f.running, waiting: f.waiting});
  while (history_.length && history_[0].t < f.time - HISTORY_S) history_.shift();
  for (const [, age, prefill, decode] of f.steps) steps.push({t: f.time + age, prefill, decode});
  steps = steps.filter((s) => s.t >= f.time - WINDOW_S).slice(-MAX_BARS);

  setValue("running", f.running);
  setValue("waiting", f.waiting);
  setText("in-flight", fmt(f.in_flight));
  const tp = f.throughput;
  setText("gen-rate", fmt(tp.generation_tokens_s, 1));
  setText("prompt-rate", fmt(tp.prompt_tokens_s, 1));
  setText("req-rate", fmt(tp.requests_s, 2) + " · " + fmt(tp.steps_s, 1));
  setText("hit-rate", pct(f.prefix_cache.hit_rate));
  setText("hit-rate-total", "since start " + pct(f.prefix_cache.hit_rate_total) +
    ` · ${fmt(f.prefix_cache.hits)} of ${fmt(f.prefix_cache.queries)} tokens in the window`);
  setText("preemptions", fmt(f.preemptions.total));
  setText("preemptions-window", fmt(f.preemptions.window) + " in the window");
  showKv(f.kv);
  showLatency(f);
  drawQueue(f.time);
  drawSteps();
}

function setValue(id, value) {
  setText(id, fmt(value));
  $(id).dataset.value = value;
}

function showConfig(c) {
  config = c;
  $("model").textContent = c.model;
  const rows = [
    ["max_num_batched_tokens", c.max_num_batched_tokens], ["max_num_seqs", c.max_num_seqs],
    ["scheduling_policy", c.scheduling_policy + (c.scheduling_policy === "priority" ?
      ` (aging ${c.priority_aging_seconds} s)` : "")],
    ["long_prefill_token_threshold", c.long_prefill_token_threshold ?? "auto (budget / 4)"],
    ["max_waiting_requests", c.max_waiting_requests], ["async_scheduling", c.async_scheduling],
    ["enable_prefix_caching", c.enable_prefix_caching], ["block_size", c.block_size],
    ["num_kv_blocks", c.num_kv_blocks], ["max_model_len", c.max_model_len], ["dtype", c.dtype],
    ["ttft_slo_ms", c.ttft_slo_ms || "off"], ["request_timeout", c.request_timeout || "off"],
  ];
  const table = $("flags");
  table.replaceChildren();
  for (const [name, value] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = String(value);
  }
}

function showKv(kv) {
  const gauge = $("kv-gauge");
  gauge.dataset.inUse = kv.in_use;
  gauge.dataset.cached = kv.cached;
  gauge.dataset.free = kv.free;
  gauge.dataset.total = kv.total;
  const total = Math.max(kv.total, 1);
  setWidth("kv-in-use", (100 * kv.in_use / total) + "%");
  setWidth("kv-free", (100 * kv.free / total) + "%");
  setWidth("kv-cached", (100 * kv.cached / total) + "%");
  setText("kv-in-use-n", `${fmt(kv.in_use)} (${pct(kv.in_use / total)})`);
  setText("kv-cached-n", `${fmt(kv.cached)} (${pct(kv.cached / total)})`);
  setText("kv-free-n", `${fmt(kv.free)} (${pct(kv.free / total)})`);
  setText("kv-total-n", fmt(kv.total));
}

function showLatency(f) {
  setText("latency-window", `last ${fmt(f.window_s, 0)} s`);
  for (const [row, figures] of [["ttft-row", f.ttft_ms], ["itl-row", f.itl_ms]]) {
    const cells = $(row).cells;
    const texts = [fmt(figures.p50, 1), fmt(figures.p90, 1), fmt(figures.p99, 1), fmt(figures.count)];
    texts.forEach((text, i) => { if (cells[i + 1].textContent !== text) cells[i + 1].textContent = text; });
  }
}

function canvas2d(id) {
  const canvas = $(id);
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px system-ui, sans-serif";
  return {canvas, ctx, width, height};
}

function niceCeil(x) {
  if (x <= 1) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x) return m * p;
  return 10 * p;
}

const PAD = {left: 40, right: 8, top: 8, bottom: 18};

function axes(ctx, width, height, top, label) {
  ctx.strokeStyle = css("--line");
  ctx.fillStyle = css("--muted");
  ctx.lineWidth = 1;
  for (const frac of [0, 0.5, 1]) {
    const y = PAD.top + (height - PAD.top - PAD.bottom) * (1 - frac);
    ctx.beginPath();
    ctx.moveTo(PAD.left, y);
    ctx.lineTo(width - PAD.right, y);
    ctx.stroke();
    ctx.fillText(fmt(top * frac), 4, y + 4);
  }
  ctx.fillText(label, PAD.left, height - 4);
}

function drawQueue(now) {
  const {canvas, ctx, width, height} = canvas2d("queue-chart");
  canvas.dataset.points = history_.length;
  const top = niceCeil(Math.max(1, ...history_.map((p) => Math.max(p.running, p.waiting))));
  axes(ctx, width, height, top, `last ${HISTORY_S} s`);
  const x = (t) => PAD.left + (width - PAD.left - PAD.right) * (1 - (now - t) / HISTORY_S);
  const y = (v) => PAD.top + (height - PAD.top - PAD.bottom) * (1 - v / top);
  for (const [field, color] of [["waiting", css("--waiting")], ["running", css("--running")]]) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    history_.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p[field])) : ctx.moveTo(x(p.t), y(p[field]))));
    ctx.stroke();
  }
}

let drawnSteps = "";  // what the step chart shows now: redrawn only when that changes

function drawSteps(force = false) {
  const shown = `${steps.length}:${steps.length ? steps[0].t + "/" + steps[steps.length - 1].t : ""}:${!!config}`;
  if (shown === drawnSteps && !force) return;
  drawnSteps = shown;
  const {canvas, ctx, width, height} = canvas2d("step-chart");
  const budget = config ? config.max_num_batched_tokens : 0;
  const most = Math.max(0, ...steps.map((s) => s.prefill + s.decode));
  canvas.dataset.bars = steps.length;
  canvas.dataset.tokens = steps.reduce((sum, s) => sum + s.prefill + s.decode, 0);
  canvas.dataset.decodeTokens = steps.reduce((sum, s) => sum + s.decode, 0);
  canvas.dataset.prefillTokens = steps.reduce((sum, s) => sum + s.prefill, 0);
  const top = niceCeil(Math.max(most, budget, 1));
  axes(ctx, width, height, top, `last ${steps.length} steps (of the last ${WINDOW_S} s), newest right`);
  const plotW = width - PAD.left - PAD.right, plotH = height - PAD.top - PAD.bottom;
  const slot = plotW / MAX_BARS;
  const y = (v) => PAD.top + plotH * (1 - v / top);
  steps.forEach((s, i) => {
    const x0 = PAD.left + plotW - (steps.length - i) * slot;
    const w = Math.max(1, slot - 1);
    ctx.fillStyle = css("--decode");
    ctx.fillRect(x0, y(s.decode), w, y(0) - y(s.decode));
    ctx.fillStyle = css("--prefill");
    ctx.fillRect(x0, y(s.decode + s.prefill), w, y(s.decode) - y(s.decode + s.prefill));
  });
  if (budget) {
    ctx.strokeStyle = css("--budget");
    ctx.setLineDash([5, 4]);
    ctx.beginPath();
    ctx.moveTo(PAD.left, y(budget));
    ctx.lineTo(width - PAD.right, y(budget));
    ctx.stroke();
    ctx.setLineDash([]);
  }
  const last = steps[steps.length - 1];
  setText("step-caption", last ?
    `latest step: ${fmt(last.decode)} decode + ${fmt(last.prefill)} prefill tokens of ${fmt(budget)}` :
    "no steps in the window (idle)");
}

setInterval(() => {
  if ($("connection").dataset.state === "live" && performance.now() - lastFrameAt > STALE_S * 1000) {
    setConnection("stale");
  }
}, 1000);

$("key").value = key;
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  key = $("key").value;
  if (key) sessionStorage.setItem("shuttle-api-key", key); else sessionStorage.removeItem("shuttle-api-key");
  connect();
});
window.addEventListener("resize", () => { drawSteps(true); });
connect();
