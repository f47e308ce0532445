// The foldtune dashboard: a single page over the /v1 API. The API key is kept in sessionStorage (gone when
// the tab closes) and sent as X-API-Key, so the page sees exactly what the key's owner sees through the API.
// Pages by URL hash: #/jobs, #/jobs/ID, #/plan, #/trainings, #/trainings/ID. Text goes in with textContent
// only (names and reasons come from users and runners).
"use strict";

const KEY = "foldtune.apiKey";
const POLL_MS = 2000;
let pollTimer = null;
let renderSeq = 0;  // a page render started later wins over one still waiting for the API

// ---------- DOM and formatting helpers ----------

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

const ms = s => (s === null || s === undefined ? "—" : (s * 1e3).toPrecision(4) + " ms");
const pct = x => (x === null || x === undefined ? "—" : (x * 100).toFixed(1) + " %");
function bytes(b) {
  if (b === null || b === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return b.toPrecision(4) + " " + units[i];
}
const num = (x, p = 4) => (x === null || x === undefined ? "—" : (+x).toPrecision(p));
const when = t => (t ? new Date(t).toLocaleString() : "—");
const badge = status => h("span", {class: "badge " + status}, status);
const cluster = c => `${c.num_gpus} × ${c.gpu}`;

function table(headers, rows, attrs) {
  return h("table", attrs || {},
    h("thead", {}, h("tr", {}, headers.map(x => h("th", {}, x)))),
    h("tbody", {}, rows.map(r => h("tr", {}, r.map(c => h("td", {}, c))))));
}

function card(title, ...body) {
  return h("section", {class: "card"}, h("h2", {}, title), ...body);
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

// Every item of a paged list (limit/offset pages of 200), at most `cap` items.
async function allPages(path, cap) {
  const items = [];
  for (let offset = 0; ; offset += 200) {
    const page = await api(`${path}${path.includes("?") ? "&" : "?"}limit=200&offset=${offset}`);
    items.push(...page.items);
    if (page.next_offset === null || items.length >= (cap || 5000)) return items;
  }
}

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

// ---------- shell: sign-in, navigation, polling ----------

function signOut(message) {
  sessionStorage.removeItem(KEY);
  stopPolling();
  showSignIn(message);
}

function showSignIn(message) {
  document.getElementById("nav").hidden = true;
  const main = document.getElementById("main");
  main.replaceChildren(h("form", {id: "signin", class: "card signin", onsubmit: async ev => {
      ev.preventDefault();
      const key = document.getElementById("api-key").value.trim();
      sessionStorage.setItem(KEY, key);
      try {
        await api("/v1/jobs?limit=1");
        route();
      } catch (e) {
        if (!(e instanceof ApiError && e.status === 401)) showSignIn(String(e.message || e));
      }
    }},
    h("h2", {}, "Sign in"),
    h("p", {}, "Paste an API key from ", h("code", {}, "foldtune keys create NAME"),
      ". It stays in this tab's session storage and is sent with each API call."),
    h("input", {id: "api-key", type: "password", placeholder: "ft_…", autocomplete: "off", required: true}),
    h("button", {type: "submit"}, "Sign in"),
    message ? h("p", {class: "error", id: "signin-error"}, message) : null));
}

function stopPolling() {
  if (pollTimer) clearTimeout(pollTimer);
  pollTimer = null;
}

function pollWhile(active) {
  stopPolling();
  if (active) pollTimer = setTimeout(() => route(true), POLL_MS);
}

async function route(refresh) {
  stopPolling();
  if (!sessionStorage.getItem(KEY)) return showSignIn();
  document.getElementById("nav").hidden = false;
  const hash = location.hash || "#/jobs";
  const parts = hash.slice(2).split("/");
  for (const a of document.querySelectorAll("#nav a[data-page]")) {
    a.classList.toggle("active", a.dataset.page === parts[0]);
  }
  const seq = ++renderSeq;
  const main = document.getElementById("main");
  try {
    let page;
    if (parts[0] === "jobs" && parts[1]) page = await jobPage(+parts[1]);
    else if (parts[0] === "plan") page = refresh ? null : planPage();
    else if (parts[0] === "trainings" && parts[1]) page = await trainingPage(+parts[1]);
    else if (parts[0] === "trainings") page = await trainingsPage();
    else page = await jobsPage();
    if (seq !== renderSeq || !page) return;
    main.replaceChildren(page.node);
    if (page.after) page.after();
    main.dataset.loaded = hash;
    pollWhile(page.live);
  } catch (e) {
    if (seq !== renderSeq || (e instanceof ApiError && e.status === 401)) return;
    main.replaceChildren(h("section", {class: "card"}, h("p", {class: "error", id: "page-error"},
      e instanceof ApiError && e.status === 404 ? `Not found: ${e.message}` : String(e.message || e))));
    main.dataset.loaded = hash;
  }
}

const LIVE = new Set(["queued", "running"]);

// ---------- Jobs ----------

async function jobsPage() {
  const jobs = await allPages("/v1/jobs", 1000);
  const rows = jobs.map(j => [
    h("a", {href: `#/jobs/${j.id}`}, `#${j.id}`), badge(j.status), j.model, cluster(j.cluster),
    `${j.trials.total - j.trials.running}/${j.budget.max_trials}` + (j.trials.running ? ` (${j.trials.running} running)` : ""),
    j.best_trial ? ms(j.best_trial.step_time_s) : "—", when(j.created_at)]);
  const node = card("Tuning jobs",
    jobs.length ? table(["job", "status", "model", "cluster", "trials done/total", "best measured step", "created"],
                        rows, {id: "jobs-table"})
                : h("p", {}, "No jobs yet: ", h("code", {}, "foldtune submit …"), " or POST /v1/jobs."));
  return {node, live: jobs.some(j => LIVE.has(j.status))};
}

// ---------- Job ----------

function trialRows(trials, calibrated) {
  return trials.map(t => [
    String(t.number), badge(t.status), h("code", {}, t.label || ""), ms(t.predicted_step_time_s),
    calibrated.has(t.number) ? ms(calibrated.get(t.number)) : "—", ms(t.step_time_s),
    t.failure_kind ? `${t.failure_kind}: ${t.failure_reason || ""}` : (t.failure_reason || "")]);
}

async function jobPage(id) {
  const [job, trials] = await Promise.all([api(`/v1/jobs/${id}`), allPages(`/v1/jobs/${id}/trials`, 10000)]);
  let megatron = null;
  if (job.best_trial) {
    try { megatron = await api(`/v1/jobs/${id}/megatron-args`); } catch (e) { if (e.status !== 404) throw e; }
  }
  const cal = job.calibration || {};
  const calibrated = new Map((cal.measured_vs_predicted || [])
    .filter(r => r.calibrated_step_time !== null && r.calibrated_step_time !== undefined)
    .map(r => [r.number, r.calibrated_step_time]));
  const measured = trials.filter(t => t.step_time_s !== null && t.predicted_step_time_s !== null);
  const byTime = [...measured].sort((a, b) => a.step_time_s - b.step_time_s);

  const summary = h("dl", {class: "summary"},
    h("dt", {}, "status"), h("dd", {}, badge(job.status)),
    h("dt", {}, "model"), h("dd", {}, job.model),
    h("dt", {}, "cluster"), h("dd", {}, cluster(job.cluster)),
    h("dt", {}, "training"), h("dd", {}, `seq ${job.training.seq_length}, global batch ${job.training.global_batch_size}, ${job.training.precision}`),
    h("dt", {}, "trials"), h("dd", {}, `${job.trials.total - job.trials.running}/${job.budget.max_trials} done: ${job.trials.succeeded} succeeded, ${job.trials.pruned} pruned, ${job.trials.failed} failed`),
    h("dt", {}, "best measured"), h("dd", {}, job.best_trial ? `${ms(job.best_trial.step_time_s)} — ${job.best_trial.label}` : "—"),
    job.error ? h("dt", {}, "error") : null, job.error ? h("dd", {class: "error"}, job.error) : null);

  const scatter = h("div", {id: "plot-pred-vs-measured", class: "plot-box-wrap"});
  const bestSoFar = h("div", {id: "plot-best-so-far", class: "plot-box-wrap"});
  const terms = h("div", {id: "plot-terms", class: "plot-box-wrap"});

  const factors = cal.time_multipliers
    ? table(["term", "multiplier (measured / predicted)"], [
        ...Object.entries(cal.time_multipliers).map(([k, v]) => [k + " time", num(v)]),
        ["memory", num(cal.memory_multiplier)],
        ["relative RMSE after calibration", pct(cal.relative_rmse)],
        ["observations", String(cal.num_observations ?? "—")]], {id: "calibration-table"})
    : h("p", {}, "Learned when the job finishes.");

  let args = h("p", {}, "No measured layout yet.");
  if (megatron) {
    const pre = h("pre", {id: "megatron-args"}, megatron.text);
    const copied = h("span", {class: "hint"});
    args = h("div", {},
      h("p", {}, `Trial ${megatron.trial_number}, measured ${ms(megatron.step_time_s)}: `, h("code", {}, megatron.layout)),
      pre, h("button", {id: "copy-args", onclick: () => copyText(megatron.text, pre, copied)}, "Copy"), copied);
  }

  const node = h("div", {},
    h("p", {}, h("a", {href: "#/jobs"}, "← jobs")),
    card(`Job #${job.id}`, summary),
    h("div", {class: "grid2"},
      card("Predicted vs measured step time", scatter,
        h("p", {class: "hint"}, "Each succeeded trial twice: the cost model as it was (raw) and after the job's calibration. On the dashed line the prediction is exact.")),
      card("Best measured step time so far", bestSoFar)),
    h("div", {class: "grid2"},
      card("Where the time goes: best vs runner-up (predicted)", terms),
      card("Learned calibration", factors)),
    card("Megatron-LM arguments of the best measured layout", args),
    card(`Trials (${trials.length})`,
      table(["#", "state", "layout", "predicted", "calibrated", "measured", "failure"], trialRows(trials, calibrated),
            {id: "trials-table"})));

  const after = () => {
    Plot.xy(scatter, [
      {name: "raw model", points: measured.map(t => ({x: t.step_time_s * 1e3, y: t.predicted_step_time_s * 1e3,
        tip: `trial ${t.number} ${t.label}\nmeasured ${ms(t.step_time_s)}, predicted ${ms(t.predicted_step_time_s)}`})), cls: "raw"},
      {name: "calibrated", points: measured.filter(t => calibrated.has(t.number)).map(t => ({
        x: t.step_time_s * 1e3, y: calibrated.get(t.number) * 1e3,
        tip: `trial ${t.number} ${t.label}\nmeasured ${ms(t.step_time_s)}, calibrated ${ms(calibrated.get(t.number))}`})),
        cls: "calibrated"}],
      {xLabel: "measured step time (ms, log scale)", yLabel: "predicted step time (ms, log scale)", identity: true,
       logX: true, logY: true});
    let best = Infinity;
    const steps = [];
    for (const t of [...trials].sort((a, b) => a.number - b.number)) {
      if (t.status !== "succeeded" || t.step_time_s === null) continue;
      best = Math.min(best, t.step_time_s);
      steps.push({x: t.number, y: best * 1e3, tip: `after trial ${t.number}: best ${ms(best)}`});
    }
    Plot.xy(bestSoFar, [
      {name: "best so far", points: steps, line: true, cls: "best"},
      {name: "each trial", points: measured.map(t => ({x: t.number, y: t.step_time_s * 1e3,
        tip: `trial ${t.number}: ${ms(t.step_time_s)} (${t.label})`})), cls: "trial", radius: 2.5}],
      {xLabel: "trial number", yLabel: "measured step time (ms)", zeroY: true, integerX: true});
    const pair = byTime.slice(0, 2).filter(t => t.predicted && t.predicted.terms_s);
    Plot.stacked(terms, pair.map((t, i) => ({
      label: `${i ? "runner-up" : "best"} (#${t.number})`,
      parts: Object.fromEntries(Object.entries(t.predicted.terms_s).filter(([, v]) => v > 0).map(([k, v]) => [k, v * 1e3]))})),
      {yLabel: "predicted exposed time per step (ms)", fmt: v => v.toPrecision(3) + " ms"});
  };
  return {node, after, live: LIVE.has(job.status)};
}

function copyText(text, pre, status) {
  const done = () => { status.textContent = " copied"; };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, () => selectPre(pre, status));
  } else selectPre(pre, status);
}

function selectPre(pre, status) {
  const range = document.createRange();
  range.selectNodeContents(pre);
  const sel = window.getSelection();
  sel.removeAllRanges();
  sel.addRange(range);
  status.textContent = document.execCommand("copy") ? " copied" : " selected: press Ctrl+C";
}

// ---------- Plan explorer ----------

function planPage() {
  const form = h("form", {id: "plan-form", class: "inline-form"},
    h("label", {}, "model ", h("select", {id: "plan-model", name: "model"})),
    h("label", {}, "GPU ", h("select", {id: "plan-gpu", name: "gpu"})),
    h("label", {}, "GPUs ", h("input", {id: "plan-gpus", name: "num_gpus", type: "number", min: 1, max: 65536, value: 64})),
    h("label", {}, "seq ", h("input", {id: "plan-seq", name: "seq_length", type: "number", min: 1, value: 4096})),
    h("label", {}, "global batch ", h("input", {id: "plan-gbs", name: "global_batch_size", type: "number", min: 1, value: 256})),
    h("label", {}, "precision ", h("select", {id: "plan-precision", name: "precision"},
      ["bf16", "fp16", "fp8", "fp32"].map(p => h("option", {value: p}, p)))),
    h("label", {}, "top ", h("input", {id: "plan-top", name: "top", type: "number", min: 1, max: 100, value: 100})),
    h("button", {type: "submit"}, "Plan"));
  const out = h("div", {id: "plan-out"});
  form.addEventListener("submit", ev => { ev.preventDefault(); runPlan(form, out); });
  const after = async () => {
    const [models, gpus] = await Promise.all([api("/v1/models"), api("/v1/hardware-profiles")]);
    const m = document.getElementById("plan-model"), g = document.getElementById("plan-gpu");
    m.replaceChildren(...models.items.map(x => h("option", {value: x.name}, x.name)));
    g.replaceChildren(...gpus.items.map(x => h("option", {value: x.name}, x.name)));
    if (models.items.some(x => x.name === "mixtral-8x7b")) m.value = "mixtral-8x7b";
    const h100 = gpus.items.find(x => x.name.startsWith("h100"));
    if (h100) g.value = h100.name;
    form.dataset.ready = "1";
  };
  const node = h("div", {}, card("Plan explorer",
    h("p", {class: "hint"}, "The cost model's instant answer (POST /v1/plans): every valid layout predicted to fit, fastest first. Nothing runs."),
    form, out));
  return {node, after: () => after().catch(e => out.replaceChildren(h("p", {class: "error"}, e.message))), live: false};
}

async function runPlan(form, out) {
  const v = name => form.elements[name].value;
  out.replaceChildren(h("p", {}, "planning…"));
  let plan;
  try {
    plan = await api("/v1/plans", {method: "POST", body: {
      model: v("model"), cluster: {gpu: v("gpu"), num_gpus: +v("num_gpus")},
      training: {seq_length: +v("seq_length"), global_batch_size: +v("global_batch_size"), precision: v("precision")},
      top: +v("top")}});
  } catch (e) {
    const errs = (e.problem && e.problem.errors) || [];
    out.replaceChildren(h("p", {class: "error", id: "plan-error"}, e.message),
      errs.length ? h("ul", {}, errs.map(x => h("li", {}, `${(x.loc || []).join(".")}: ${x.message} [${x.rule}]`))) : null);
    return;
  }
  const shown = plan.ranked.length ? plan.ranked : (plan.closest ? [plan.closest] : []);
  const pts = shown.map(e => ({x: e.memory_bytes.total / 2 ** 30, y: e.step_time_s * 1e3, e,
    tip: `${e.layout}\nstep ${ms(e.step_time_s)}, memory ${bytes(e.memory_bytes.total)} (headroom ${bytes(e.memory_headroom_bytes)})\n` +
         `MFU ${pct(e.mfu)}, ${num(e.tokens_per_s_per_gpu)} tokens/s/GPU, limiter ${e.limiter}\n${e.explanation}`}));
  const front = Plot.paretoFront(pts);
  const onFront = new Set(front);
  const plotDiv = h("div", {id: "plot-plan", class: "plot-box-wrap"});
  const detail = h("pre", {id: "plan-detail", class: "detail"}, "Hover a point for its layout and prediction.");
  const rejected = Object.entries(plan.rejected).sort((a, b) => b[1].count - a[1].count);
  out.replaceChildren(
    h("p", {id: "plan-counts"}, `${plan.considered} layouts considered, ${plan.valid} valid, ${plan.pruned_by_memory} predicted not to fit, ${plan.fitting} fit; ` +
      (plan.ranked.length ? `showing the ${plan.ranked.length} fastest` : plan.closest ? "none fits: showing the least over memory" : "none is valid") +
      ` (${num(plan.seconds, 3)} s).`),
    h("div", {class: "grid2"},
      h("div", {}, plotDiv, detail),
      h("div", {}, h("h3", {}, "Rejected by rule"),
        rejected.length ? table(["rule", "layouts", "example"], rejected.map(([rule, r]) => [h("code", {}, rule), String(r.count), r.example]),
                                {id: "rejected-table"}) : h("p", {}, "No layout was rejected."))));
  Plot.xy(plotDiv, [
    {name: "layout", points: pts.filter(p => !onFront.has(p)), cls: "layout"},
    {name: "Pareto front", points: front, cls: "pareto", color: "#dc2626", radius: 5}],
    {xLabel: "predicted peak memory per GPU (GiB)", yLabel: "predicted step time (ms)", front});
  plotDiv.addEventListener("mouseover", ev => {
    const tip = ev.target.dataset && ev.target.dataset.tip;
    if (tip) detail.textContent = tip;
  });
}

// ---------- Trainings ----------

async function trainingsPage() {
  const rows = await allPages("/v1/trainings", 1000);
  const node = card("Trainings", rows.length
    ? table(["training", "status", "model", "layout", "cluster", "steps", "latest loss", "created"], rows.map(t => [
        h("a", {href: `#/trainings/${t.id}`}, `#${t.id}`), badge(t.status), t.model, h("code", {}, t.label), cluster(t.cluster),
        `${t.latest_metrics ? t.latest_metrics.step : 0}/${t.steps}`, t.latest_metrics ? num(t.latest_metrics.loss) : "—",
        when(t.created_at)]), {id: "trainings-table"})
    : h("p", {}, "No trainings yet: POST /v1/trainings, or ", h("code", {}, "foldtune train"), "."));
  return {node, live: rows.some(t => LIVE.has(t.status))};
}

async function trainingPage(id) {
  const [t, metrics, ckpts] = await Promise.all([api(`/v1/trainings/${id}`), allMetrics(id),
                                                 api(`/v1/trainings/${id}/checkpoints`)]);
  const summary = h("dl", {class: "summary"},
    h("dt", {}, "status"), h("dd", {}, badge(t.status)),
    h("dt", {}, "model"), h("dd", {}, t.model),
    h("dt", {}, "layout"), h("dd", {}, h("code", {}, t.label)),
    h("dt", {}, "cluster"), h("dd", {}, cluster(t.cluster)),
    h("dt", {}, "steps"), h("dd", {}, `${metrics.length ? metrics[metrics.length - 1].step : 0}/${t.steps}`),
    h("dt", {}, "step time"), h("dd", {}, `predicted ${ms(t.predicted_step_time_s)}, measured ${ms(t.measured_step_time_s)} (median), error ${pct(t.step_time_error)}`),
    t.job_id ? h("dt", {}, "from job") : null, t.job_id ? h("dd", {}, h("a", {href: `#/jobs/${t.job_id}`}, `#${t.job_id}`)) : null,
    t.error ? h("dt", {}, "error") : null, t.error ? h("dd", {class: "error"}, t.error) : null);
  const loss = h("div", {id: "plot-loss", class: "plot-box-wrap"});
  const tps = h("div", {id: "plot-tokens", class: "plot-box-wrap"});
  const stepTime = h("div", {id: "plot-step-time", class: "plot-box-wrap"});
  const node = h("div", {},
    h("p", {}, h("a", {href: "#/trainings"}, "← trainings")),
    card(`Training #${t.id}`, summary),
    h("div", {class: "grid2"}, card("Loss", loss), card("Throughput", tps)),
    h("div", {class: "grid2"}, card("Step time: predicted vs measured", stepTime),
      card(`Checkpoints (${ckpts.items.length})`, ckpts.items.length
        ? table(["step", "directory", "size", "state"], ckpts.items.map(c => [String(c.step), h("code", {}, c.name), bytes(c.bytes),
            (c.complete ? "complete" : "incomplete") + (c.latest ? ", latest" : "")]), {id: "checkpoints-table"})
        : h("p", {}, `None under ${ckpts.checkpoint_dir} (as this server sees it).`))));
  const after = () => {
    const series = key => metrics.filter(m => m[key] !== null && m[key] !== undefined);
    Plot.xy(loss, [
      {name: "train loss", points: series("loss").map(m => ({x: m.step, y: m.loss, tip: `step ${m.step}: loss ${num(m.loss)}`})),
       line: true, cls: "train-loss", radius: 2.5},
      {name: "eval loss", points: series("eval_loss").map(m => ({x: m.step, y: m.eval_loss, tip: `step ${m.step}: eval loss ${num(m.eval_loss)}`})),
       line: true, cls: "eval-loss"}],
      {xLabel: "step", yLabel: "loss (nats/token)", integerX: true});
    Plot.xy(tps, [{name: "tokens/s", points: series("tokens_per_s").map(m => ({x: m.step, y: m.tokens_per_s,
      tip: `step ${m.step}: ${num(m.tokens_per_s)} tokens/s`})), line: true, cls: "tokens", radius: 2.5}],
      {xLabel: "step", yLabel: "tokens/s (all GPUs)", zeroY: true, integerX: true});
    const measured = series("step_time_s");
    const predicted = t.predicted_step_time_s;
    // The first steps (compilation, allocator warm-up) can be 100x the rest: a log axis keeps both readable.
    const times = measured.map(m => m.step_time_s).concat(predicted ? [predicted] : []);
    const logY = times.length > 1 && Math.max(...times) > 10 * Math.min(...times);
    Plot.xy(stepTime, [
      {name: "measured", points: measured.map(m => ({x: m.step, y: m.step_time_s * 1e3,
        tip: `step ${m.step}: ${ms(m.step_time_s)} (error ${pct(m.step_time_error)})`})), line: true, cls: "measured", radius: 2.5},
      {name: "predicted", points: predicted && measured.length ? [measured[0], measured[measured.length - 1]].map(m => ({x: m.step, y: predicted * 1e3}))
        : [], line: true, markers: false, cls: "predicted"}],
      {xLabel: "step", yLabel: logY ? "step time (ms, log scale)" : "step time (ms)", logY, zeroY: !logY, integerX: true});
  };
  return {node, after, live: LIVE.has(t.status)};
}

// ---------- start ----------

window.addEventListener("hashchange", () => route());
window.addEventListener("DOMContentLoaded", () => {
  document.getElementById("sign-out").addEventListener("click", () => signOut("Signed out."));
  route();
});
