// Shared by every page of the dashboard: building DOM nodes, formatting numbers and times, and the /v1 client.
// Text goes in with textContent only (names and reasons come from users and runners).
"use strict";

const KEY = "foldtune.apiKey";

// ---------- DOM ----------

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// A table in a box that scrolls sideways on its own, so a wide table never widens the page.
function table(headers, rows, attrs) {
  return h("div", {class: "table-wrap"}, h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map(x => h("th", {}, x)))),
    h("tbody", {}, rows.map(r => h("tr", {}, r.map(c => h("td", {}, c)))))));
}

function card(title, ...body) {
  return h("section", {class: "card"}, h("h2", {}, title), ...body);
}

// A <dl> of [term, value] pairs; pairs whose value is null are left out.
function summary(pairs) {
  return h("dl", {class: "summary"}, pairs.filter(p => p && p[1] !== null && p[1] !== undefined)
    .flatMap(([k, v, cls]) => [h("dt", {}, k), h("dd", cls ? {class: cls} : {}, v)]));
}

function plotBox(id) {
  return h("div", {id, class: "plot-box-wrap"});
}

// ---------- formatting (one unit per quantity: ms for step times, wall time as h/min/s) ----------

const missing = x => x === null || x === undefined;
const ms = s => (missing(s) ? "—" : (s * 1e3).toPrecision(4) + " ms");
const pct = x => (missing(x) ? "—" : (x * 100).toFixed(1) + " %");
const num = (x, p = 4) => (missing(x) ? "—" : String(+(+x).toPrecision(p)));
const when = t => (t ? new Date(t).toLocaleString() : "—");
const badge = status => h("span", {class: "badge " + status}, status);
const cluster = c => `${c.num_gpus} × ${c.gpu}`;

function bytes(b) {
  if (missing(b)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return b.toPrecision(4) + " " + units[i];
}

// Wall-clock seconds as "42 s", "3 min 05 s", "2 h 07 min", "3 d 04 h".
function wall(seconds) {
  if (missing(seconds) || !isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  const two = n => String(n).padStart(2, "0");
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${two(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${two(Math.floor(s % 3600 / 60))} min`;
  return `${Math.floor(s / 86400)} d ${two(Math.floor(s % 86400 / 3600))} h`;
}

// Seconds from ISO time `a` to `b` (null `b`: now); null when `a` is missing.
function seconds(a, b) {
  if (!a) return null;
  return ((b ? Date.parse(b) : Date.now()) - Date.parse(a)) / 1e3;
}

// How long a job or training (anything with created_at, started_at, finished_at) ran, or has waited so far.
function runTime(x) {
  if (x.started_at) return wall(seconds(x.started_at, x.finished_at)) + (x.finished_at ? "" : " so far");
  if (x.finished_at) return "did not start";
  return `queued ${wall(seconds(x.created_at))}`;
}

// ---------- API ----------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(path, options) {
  const opts = options || {};
  const headers = {"X-API-Key": sessionStorage.getItem(KEY) || "", "Accept": "application/json"};
  if (opts.body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(path, {method: opts.method || "GET", headers,
                               body: opts.body === undefined ? undefined : JSON.stringify(opts.body)});
  const body = r.headers.get("content-type")?.includes("json") ? await r.json() : null;
  if (r.status === 401) { signOut("The API key was not accepted; sign in again."); throw new ApiError(401, body); }
  if (!r.ok) throw new ApiError(r.status, body);
  return body;
}

// Every item of a limit/offset paged list, at most `cap` items; `size` is the route's largest page.
async function allPages(path, cap, size = 200) {
  const items = [];
  for (let offset = 0; ; offset += size) {
    const page = await api(`${path}${path.includes("?") ? "&" : "?"}limit=${size}&offset=${offset}`);
    items.push(...page.items);
    if (page.next_offset === null || items.length >= (cap || 5000)) return items;
  }
}

// Every stored step of training `id`, in step order (the metrics route pages by step, not offset).
async function allMetrics(id) {
  const items = [];
  let after = -1;
  for (;;) {
    const page = await api(`/v1/trainings/${id}/metrics?limit=200&after_step=${after}`);
    items.push(...page.items);
    if (page.next_after_step === null || items.length >= 100000) return items;
    after = page.next_after_step;
  }
}
