// Tuning jobs: the list (#/jobs), one job (#/jobs/ID) and two of its trials side by side
// (#/jobs/ID/compare/A/B). Reads GET /v1/jobs, /v1/jobs/ID, /v1/jobs/ID/trials and /v1/jobs/ID/megatron-args.
"use strict";

const LIVE = new Set(["queued", "running"]);
const pickedTrials = new Map();  // job id -> the trial numbers ticked for comparison (kept across polls)

async function jobsPage() {
  const jobs = await allPages("/v1/jobs", 1000);
  const rows = jobs.map(j => [
    h("a", {href: `#/jobs/${j.id}`}, `#${j.id}`), badge(j.status), j.model, cluster(j.cluster),
    `${j.trials.total - j.trials.running}/${j.budget.max_trials}` + (j.trials.running ? ` (${j.trials.running} running)` : ""),
    j.best_trial ? ms(j.best_trial.step_time_s) : "—", runTime(j), when(j.created_at)]);
  const node = card("Tuning jobs",
    jobs.length ? table(["job", "status", "model", "cluster", "trials done/total", "best measured step", "took", "created"],
                        rows, {id: "jobs-table"})
                : h("p", {}, "No jobs yet: ", h("code", {}, "foldtune submit …"), " or POST /v1/jobs."));
  return {node, live: jobs.some(j => LIVE.has(j.status))};
}

// The job's calibrated prediction (seconds) of each trial number it has one for.
function calibratedSteps(job) {
  return new Map(((job.calibration || {}).measured_vs_predicted || [])
    .filter(r => !missing(r.calibrated_step_time)).map(r => [r.number, r.calibrated_step_time]));
}

const trialTook = t => (t.finished_at ? wall(seconds(t.started_at, t.finished_at)) : `${wall(seconds(t.started_at))} so far`);
const failureText = t => (t.failure_kind ? `${t.failure_kind}: ${t.failure_reason || ""}` : (t.failure_reason || ""));

async function loadJob(id) {
  const [job, trials] = await Promise.all([api(`/v1/jobs/${id}`), allPages(`/v1/jobs/${id}/trials`, 10000)]);
  return {job, trials, calibrated: calibratedSteps(job)};
}

async function jobPage(id) {
  const {job, trials, calibrated} = await loadJob(id);
  let megatron = null, megatronRefusal = null;
  if (job.best_trial) {
    // 422: a multimodal layout Megatron-LM cannot express; the problem's detail names what it lacks
    try { megatron = await api(`/v1/jobs/${id}/megatron-args`); } catch (e) {
      if (e.status === 422) megatronRefusal = e.message; else if (e.status !== 404) throw e;
    }
  }
  const cal = job.calibration || {};
  const measured = trials.filter(t => t.step_time_s !== null && t.predicted_step_time_s !== null);
  const byTime = [...measured].sort((a, b) => a.step_time_s - b.step_time_s);

  const facts = summary([
    ["status", badge(job.status)], ["model", job.model], ["cluster", cluster(job.cluster)],
    ["training", `seq ${job.training.seq_length}, global batch ${job.training.global_batch_size}, ${job.training.precision}`],
    ["trials", `${job.trials.total - job.trials.running}/${job.budget.max_trials} done: ${job.trials.succeeded} succeeded, ${job.trials.pruned} pruned, ${job.trials.failed} failed`],
    ["images", job.training.images ? imagesText(job.training.images) : null],
    ["best measured", job.best_trial ? `${ms(job.best_trial.step_time_s)} — ${job.best_trial.label}` : "—"],
    ["placement", job.best_trial ? placementText(job.best_trial.config) : null],
    ["took", h("span", {id: "job-took"}, runTime(job))],
    ["started", job.started_at ? `${when(job.started_at)}${job.finished_at ? ", finished " + when(job.finished_at) : ""}` : null],
    ["error", job.error, "error"]]);

  const scatter = plotBox("plot-pred-vs-measured"), bestSoFar = plotBox("plot-best-so-far"), terms = plotBox("plot-terms");
  const factors = cal.time_multipliers
    ? table(["term", "multiplier (measured / predicted)"], [
        ...Object.entries(cal.time_multipliers).map(([k, v]) => [k + " time", num(v)]),
        ["memory", num(cal.memory_multiplier)],
        ["relative RMSE after calibration", pct(cal.relative_rmse)],
        ["observations", String(cal.num_observations ?? "—")]], {id: "calibration-table"})
    : h("p", {}, "Learned when the job finishes.");

  let args = h("p", {}, "No measured layout yet.");
  if (megatronRefusal) args = h("p", {id: "megatron-refusal", class: "error"}, megatronRefusal);
  if (megatron) {
    const pre = h("pre", {id: "megatron-args"}, megatron.text);
    const copied = h("span", {class: "hint"});
    args = h("div", {},
      h("p", {}, `Trial ${megatron.trial_number}, measured ${ms(megatron.step_time_s)}: `, h("code", {}, megatron.layout)),
      pre, h("button", {id: "copy-args", onclick: () => copyText(megatron.text, pre, copied)}, "Copy"), copied);
  }

  const node = h("div", {},
    h("p", {}, h("a", {href: "#/jobs"}, "← jobs")),
    card(`Job #${job.id}`, facts),
    h("div", {class: "grid2"},
      card("Predicted vs measured step time", scatter,
        h("p", {class: "hint"}, "Each succeeded trial twice: the cost model as it was (raw) and after the job's calibration. On the dashed line the prediction is exact.")),
      card("Best measured step time so far", bestSoFar)),
    h("div", {class: "grid2"},
      card("Where the time goes: best vs runner-up (predicted)", terms),
      card("Learned calibration", factors)),
    card("Megatron-LM arguments of the best measured layout", args),
    card(`Trials (${trials.length})`, trialPicker(job.id, trials, byTime), trialTable(trials, calibrated, job.id)));

  const after = () => {
    Plot.xy(scatter, [
      {name: "raw model", points: measured.map(t => ({x: t.step_time_s * 1e3, y: t.predicted_step_time_s * 1e3,
        tip: `trial ${t.number} ${t.label}\nmeasured ${ms(t.step_time_s)}, predicted ${ms(t.predicted_step_time_s)}`})), cls: "raw"},
      {name: "calibrated", points: measured.filter(t => calibrated.has(t.number)).map(t => ({
        x: t.step_time_s * 1e3, y: calibrated.get(t.number) * 1e3,
        tip: `trial ${t.number} ${t.label}\nmeasured ${ms(t.step_time_s)}, calibrated ${ms(calibrated.get(t.number))}`})),
        cls: "calibrated"}],
      {xLabel: "measured step time (ms, log scale)", yLabel: "predicted step time (ms, log)", identity: true,
       logX: true, logY: true, empty: "no trial measured yet"});
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
        tip: `trial ${t.number}: ${ms(t.step_time_s)} (${t.label})`})), cls: "trial", radius: 3}],
      {xLabel: "trial number", yLabel: "measured step time (ms)", zeroY: true, integerX: true,
       empty: "no trial measured yet"});
    const pair = byTime.slice(0, 2).filter(t => t.predicted && t.predicted.terms_s);
    Plot.stacked(terms, pair.map((t, i) => ({label: `${i ? "runner-up" : "best"} (#${t.number})`, parts: msParts(t.predicted.terms_s)})),
      {yLabel: "predicted time per step (ms)", fmt: v => v.toPrecision(3) + " ms", empty: "no trial measured yet"});
  };
  return {node, after, live: LIVE.has(job.status)};
}

// A vision-language job's images per sample.
function imagesText(images) {
  return `${images.images_per_sample} per sample, ${images.image_height}x${images.image_width} px`;
}

// Where a multimodal layout's vision encoder runs and its own sizes (null for a text-only layout, whose stored
// config has no "llm" part).
function placementText(config) {
  if (!config || !config.llm) return null;
  if (config.placement === "homogeneous") return "homogeneous: the encoder in the LLM's layout";
  const sizes = `encoder tp ${config.encoder_tp}, cp ${config.encoder_cp}, pp ${config.encoder_pp}, dp ${config.encoder_dp}`;
  return config.placement === "separate" ? `separate: ${sizes} on GPUs of its own`
                                         : `colocated: ${sizes} over the LLM's GPUs`;
}

// Seconds by term as milliseconds, positive terms only.
function msParts(secondsByTerm) {
  return Object.fromEntries(Object.entries(secondsByTerm || {}).filter(([, v]) => v > 0).map(([k, v]) => [k, v * 1e3]));
}

function trialTable(trials, calibrated, jobId) {
  const picked = pickedTrials.get(jobId) || [];
  return table(["compare", "#", "state", "layout", "predicted", "calibrated", "measured", "took", "failure"], trials.map(t => [
    h("input", {type: "checkbox", class: "pick-trial", "data-number": t.number, "aria-label": `compare trial ${t.number}`,
                checked: picked.includes(t.number), onchange: ev => pickTrial(jobId, t.number, ev.target.checked)}),
    String(t.number), badge(t.status), h("code", {}, t.label || ""), ms(t.predicted_step_time_s),
    calibrated.has(t.number) ? ms(calibrated.get(t.number)) : "—", ms(t.step_time_s), trialTook(t), failureText(t)]),
    {id: "trials-table"});
}

// The "compare" link: the two ticked trials, or the best and the runner-up while fewer are ticked.
function trialPicker(jobId, trials, byTime) {
  const link = h("a", {id: "compare-trials", class: "button"});
  const say = h("span", {class: "hint", id: "compare-hint"});
  const update = () => {
    const picked = pickedTrials.get(jobId) || [];
    const pair = picked.length === 2 ? picked : byTime.slice(0, 2).map(t => t.number);
    link.hidden = pair.length < 2;
    if (pair.length === 2) {
      link.href = `#/jobs/${jobId}/compare/${pair[0]}/${pair[1]}`;
      link.textContent = `Compare trials ${pair[0]} and ${pair[1]}`;
    }
    say.textContent = picked.length === 2 ? "" : trials.length < 2 ? "" : " Tick two trials to compare others.";
  };
  update();
  link._update = update;  // pickTrial calls it when a box is ticked
  return h("p", {}, link, say);
}

function pickTrial(jobId, number, on) {
  const picked = (pickedTrials.get(jobId) || []).filter(n => n !== number);
  if (on) picked.push(number);
  while (picked.length > 2) picked.shift();  // the newest two ticks count
  pickedTrials.set(jobId, picked);
  for (const box of document.querySelectorAll("input.pick-trial")) box.checked = picked.includes(+box.dataset.number);
  const link = document.getElementById("compare-trials");
  if (link && link._update) link._update();
}

// A table of [what, value A, value B] rows; rows whose two values differ are marked (class "differs").
function sideBySide(id, headA, headB, rows) {
  const text = v => (v instanceof Node ? v.textContent : String(v ?? "—"));
  return h("div", {class: "table-wrap"}, h("table", {id, class: "compare"},
    h("thead", {}, h("tr", {}, h("th", {}, ""), h("th", {}, headA), h("th", {}, headB))),
    h("tbody", {}, rows.map(([what, a, b]) => h("tr", text(a) !== text(b) ? {class: "differs"} : {},
      h("th", {scope: "row"}, what), h("td", {}, a ?? "—"), h("td", {}, b ?? "—"))))));
}

async function trialComparePage(id, a, b) {
  const {job, trials, calibrated} = await loadJob(id);
  const [A, B] = [a, b].map(n => {
    const t = trials.find(x => x.number === n);
    if (!t) throw new ApiError(404, {detail: `job ${id} has no trial ${n}`});
    return t;
  });
  const error = t => (t.step_time_s && t.predicted_step_time_s
    ? pct((t.predicted_step_time_s - t.step_time_s) / t.step_time_s) : "—");
  const m = t => t.measurement || {}, p = t => t.predicted || {};
  const configKeys = [...new Set([...Object.keys(A.config || {}), ...Object.keys(B.config || {})])].sort();
  const fmtConf = v => (v === undefined ? "—" : typeof v === "object" ? JSON.stringify(v) : String(v));
  const differing = configKeys.filter(k => fmtConf(A.config[k]) !== fmtConf(B.config[k]));
  const rows = [
    ["state", badge(A.status), badge(B.status)],
    ["layout", h("code", {}, A.label || ""), h("code", {}, B.label || "")],
    ["precision", A.precision || job.training.precision, B.precision || job.training.precision],
    ["predicted step", ms(A.predicted_step_time_s), ms(B.predicted_step_time_s)],
    ["calibrated step", ms(calibrated.get(A.number)), ms(calibrated.get(B.number))],
    ["measured step", ms(A.step_time_s), ms(B.step_time_s)],
    ["prediction error (raw)", error(A), error(B)],
    ["tokens/s per GPU (measured)", num(m(A).tokens_per_s_per_gpu), num(m(B).tokens_per_s_per_gpu)],
    ["predicted memory per GPU", bytes(p(A).memory_bytes), bytes(p(B).memory_bytes)],
    ["peak memory (measured)", bytes(m(A).peak_allocated_bytes), bytes(m(B).peak_allocated_bytes)],
    ["predicted bottleneck", p(A).bottleneck || "—", p(B).bottleneck || "—"],
    ["took", trialTook(A), trialTook(B)],
    ["failure", failureText(A) || "—", failureText(B) || "—"],
    ...differing.map(k => [k, fmtConf(A.config[k]), fmtConf(B.config[k])])];
  const predicted = plotBox("plot-compare-predicted"), phases = plotBox("plot-compare-measured");
  const node = h("div", {},
    h("p", {}, h("a", {href: `#/jobs/${id}`}, `← job #${id}`)),
    card(`Trial ${a} vs trial ${b} of job #${id}`, sideBySide("trial-compare", `trial ${a}`, `trial ${b}`, rows),
      h("p", {class: "hint"}, `Highlighted: where they differ. ${configKeys.length - differing.length} other layout settings are equal.`)),
    h("div", {class: "grid2"},
      card("Predicted time per step by term", predicted),
      card("Measured time per step by phase (rank 0)", phases)));
  const after = () => {
    const terms = [...new Set([A, B].flatMap(t => Object.keys((t.predicted || {}).terms_s || {})))];
    Plot.stacked(predicted, [A, B].filter(t => t.predicted && t.predicted.terms_s)
      .map(t => ({label: `trial ${t.number}`, parts: msParts(t.predicted.terms_s)})),
      {yLabel: "predicted exposed time (ms)", fmt: v => v.toPrecision(3) + " ms", terms, empty: "no prediction stored"});
    Plot.stacked(phases, [A, B].filter(t => t.measurement && t.measurement.phases && Object.keys(t.measurement.phases).length)
      .map(t => ({label: `trial ${t.number}`, parts: msParts(t.measurement.phases)})),
      {yLabel: "measured time (ms)", fmt: v => v.toPrecision(3) + " ms", empty: "no phases measured"});
  };
  return {node, after, live: LIVE.has(A.status) || LIVE.has(B.status)};
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
