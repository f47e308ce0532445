// Trainings: the list (#/trainings), one training (#/trainings/ID) and two side by side
// (#/trainings/compare/A/B). Reads GET /v1/trainings, /v1/trainings/ID, /metrics, /checkpoints and the
// per-layer expert load (/expert-load, /expert-load/imbalance).
"use strict";

const pickedTrainings = [];  // ids ticked for comparison on the list (kept across polls)

async function trainingsPage() {
  const rows = await allPages("/v1/trainings", 1000);
  const link = h("a", {id: "compare-trainings", class: "button"});
  const update = () => {
    link.hidden = pickedTrainings.length !== 2;
    link.href = `#/trainings/compare/${pickedTrainings[0]}/${pickedTrainings[1]}`;
    link.textContent = `Compare #${pickedTrainings[0]} and #${pickedTrainings[1]}`;
  };
  const pick = (id, on) => {
    const at = pickedTrainings.indexOf(id);
    if (at >= 0) pickedTrainings.splice(at, 1);
    if (on) pickedTrainings.push(id);
    while (pickedTrainings.length > 2) pickedTrainings.shift();  // the newest two ticks count
    for (const box of document.querySelectorAll("input.pick-training")) box.checked = pickedTrainings.includes(+box.dataset.id);
    update();
  };
  update();
  const node = card("Trainings", rows.length
    ? h("div", {},
        rows.length > 1 ? h("p", {}, link, h("span", {class: "hint"}, " Tick two trainings to compare them.")) : null,
        table(["compare", "training", "status", "model", "layout", "cluster", "steps", "latest loss", "took", "created"], rows.map(t => [
          h("input", {type: "checkbox", class: "pick-training", "data-id": t.id, "aria-label": `compare training ${t.id}`,
                      checked: pickedTrainings.includes(t.id), onchange: ev => pick(t.id, ev.target.checked)}),
          h("a", {href: `#/trainings/${t.id}`}, `#${t.id}`), badge(t.status), t.model, h("code", {}, t.label), cluster(t.cluster),
          `${t.latest_metrics ? t.latest_metrics.step : 0}/${t.steps}`, t.latest_metrics ? num(t.latest_metrics.loss) : "—",
          runTime(t), when(t.created_at)]), {id: "trainings-table"}))
    : h("p", {}, "No trainings yet: POST /v1/trainings, or ", h("code", {}, "foldtune train"), "."));
  return {node, live: rows.some(t => LIVE.has(t.status))};
}

const present = (metrics, key) => metrics.filter(m => !missing(m[key]));

// The plots of a training page, or of two trainings overlaid: [{id, t, metrics}] -> draw into `boxes`.
const CURVES = [
  {box: "plot-loss", title: "Loss", yLabel: "loss (nats/token)",
   series: (run, tag) => [
     {name: `train loss${tag}`, key: "loss", cls: "train-loss", fmt: num},
     {name: `eval loss${tag}`, key: "eval_loss", cls: "eval-loss", fmt: num}]},
  {box: "plot-tokens", title: "Throughput", yLabel: "tokens/s (all GPUs)", zeroY: true,
   series: (run, tag) => [{name: `tokens/s${tag}`, key: "tokens_per_s", cls: "tokens", fmt: num}]},
  {box: "plot-step-time", title: "Step time: predicted vs measured", stepTime: true,
   series: (run, tag) => [{name: `measured${tag}`, key: "step_time_s", cls: "measured", scale: 1e3, fmt: ms}]},
  {box: "plot-lr", title: "Learning rate", yLabel: "learning rate", zeroY: true,
   series: (run, tag) => [{name: `lr${tag}`, key: "lr", cls: "lr", fmt: num}]},
  {box: "plot-grad-norm", title: "Gradient norm (before clipping)", yLabel: "global gradient L2 norm",
   series: (run, tag) => [{name: `grad norm${tag}`, key: "grad_norm", cls: "grad-norm", fmt: num}],
   // the clipping threshold, when the norms come near it (else it would only squash their curve)
   guide: run => {
     const clip = run.t.recipe.max_grad_norm, top = Math.max(...present(run.metrics, "grad_norm").map(m => m.grad_norm));
     return clip && top >= clip / 2 ? {y: clip, label: `clipped above ${num(clip, 3)}`, cls: "clip"} : null;
   }},
  {box: "plot-expert-load", title: "Expert load balance (all layers)",
   yLabel: "busiest expert / mean", hint: "Routed tokens of the busiest expert over the mean expert, summed over the MoE layers of each step (1 = balanced); each layer's on a training's own page.",
   series: (run, tag) => [{name: `max / mean${tag}`, key: "expert_load_max", cls: "expert-load",
                           value: m => (m.expert_load_mean ? m.expert_load_max / m.expert_load_mean : null),
                           tip: m => `busiest ${num(m.expert_load_max)} tokens, mean ${num(m.expert_load_mean)}`}]},
];

function drawCurves(runs) {
  const tagged = runs.length > 1;
  for (const c of CURVES) {
    const box = document.getElementById(c.box);
    if (!box) continue;
    const series = [];
    let logY = false;
    for (const run of runs) {
      const tag = tagged ? ` #${run.id}` : "";
      for (const s of c.series(run, tag)) {
        const value = s.value || (m => (missing(m[s.key]) ? null : m[s.key] * (s.scale || 1)));
        const rows = present(run.metrics, s.key).filter(m => value(m) !== null);
        series.push({name: s.name, line: true, cls: s.cls + (tagged ? ` run-${run.id}` : ""), points: rows.map(m => ({
          x: m.step, y: value(m), tip: `${tagged ? `#${run.id} ` : ""}step ${m.step}: ${s.name.split(" #")[0]} ` +
            (s.tip ? s.tip(m) : `${s.fmt(m[s.key])}`) + (s.key === "step_time_s" ? ` (error ${pct(m.step_time_error)})` : "")}))});
      }
      if (c.stepTime && run.t.predicted_step_time_s) {
        const measured = present(run.metrics, "step_time_s");
        series.push({name: `predicted${tag}`, line: true, markers: false, cls: "predicted" + (tagged ? ` run-${run.id}` : ""),
                     points: measured.length ? [measured[0], measured[measured.length - 1]].map(m => ({x: m.step, y: run.t.predicted_step_time_s * 1e3})) : []});
      }
    }
    if (c.stepTime) {
      // The first steps (compilation, allocator warm-up) can be 100x the rest: a log axis keeps both readable.
      const times = series.flatMap(s => s.points.map(p => p.y));
      logY = times.length > 1 && Math.max(...times) > 10 * Math.min(...times);
    }
    const guides = c.guide && runs.length === 1 ? [c.guide(runs[0])].filter(Boolean) : [];
    Plot.xy(box, series, {xLabel: "step", yLabel: c.stepTime ? (logY ? "step time (ms, log)" : "step time (ms)") : c.yLabel,
                          logY, zeroY: c.zeroY || (c.stepTime && !logY), integerX: true, guides});
  }
}

function curveCards() {
  const cards = CURVES.map(c => card(c.title, plotBox(c.box), c.hint ? h("p", {class: "hint"}, c.hint) : null));
  const grids = [];
  for (let i = 0; i < cards.length; i += 2) grids.push(h("div", {class: "grid2"}, cards.slice(i, i + 2)));
  return grids;
}

// The MoE layer a stored row belongs to: decoder layers by their 0-based number, head blocks (MTP) after them.
function layerName(number, t) {
  const decoder = t.model_spec.num_layers;
  return decoder && number >= decoder ? `MTP ${number - decoder + 1}` : `layer ${number}`;
}

// The latest step's routed tokens per layer and expert (null when the training stored none: a dense model,
// or a training from before the service kept them), and every stored step's busiest / mean expert per layer.
async function loadExpertLoad(id) {
  let latest;
  try {
    latest = await api(`/v1/trainings/${id}/expert-load`);
  } catch (e) {
    if (e.status === 404) return null;
    throw e;
  }
  const steps = [];
  for (let after = -1; ;) {
    const page = await api(`/v1/trainings/${id}/expert-load/imbalance?limit=200&after_step=${after}`);
    steps.push(...page.items);
    if (page.next_after_step === null || steps.length >= 100000) break;
    after = page.next_after_step;
  }
  return {latest, steps};
}

const MAX_LAYER_LEGEND = 12;  // more layers: their lines stay unnamed in the legend (each tip names its layer)

function expertLoadCards(load) {
  if (!load) {
    return [card("Expert load by layer", h("p", {id: "expert-load-none"},
      "No per-layer expert load stored for this training (a model without MoE layers, or trained before the " +
      "service kept them)."))];
  }
  const {latest} = load;
  const thinned = latest.layers.length < latest.moe_layers
    ? ` Showing ${latest.layers.length} of the ${latest.moe_layers} MoE layers, evenly spaced: a step stores at most ${latest.max_cells} counts.`
    : "";
  return [h("div", {class: "grid2"},
    card(`Expert load by layer at step ${latest.step}`, plotBox("plot-expert-heatmap"),
      h("p", {class: "hint"}, `Routed tokens of each expert in each MoE layer over an even share (the ` +
        `${num(latest.tokens_per_layer)} token-to-expert assignments of a layer, tokens × top-k, over ` +
        `${latest.num_experts} experts): 1 = balanced.` + thinned)),
    card("Expert load imbalance by layer", plotBox("plot-expert-imbalance"),
      h("p", {class: "hint"}, "Each MoE layer's busiest expert over its mean expert, step by step (1 = balanced).")))];
}

function drawExpertLoad(run, load) {
  const heat = document.getElementById("plot-expert-heatmap");
  if (!load || !heat) return;
  const {latest, steps} = load;
  const share = latest.tokens_per_layer / latest.num_experts;
  const rows = latest.layers.map(n => layerName(n, run.t));
  const experts = latest.tokens[0].map((_, e) => String(e));
  Plot.heatmap(heat, latest.tokens.map(row => row.map(c => c / share)), {
    uid: "expert-load", rows, columns: experts, xLabel: "expert", yLabel: "", zLabel: "load / even share", zmin: 0,
    tips: latest.tokens.map((row, i) => row.map((c, e) =>
      `${rows[i]}, expert ${e}: ${c} tokens (${num(c / share, 3)} × an even share)`))});
  const named = latest.layers.length <= MAX_LAYER_LEGEND;
  const series = latest.layers.map((n, i) => ({
    name: named ? layerName(n, run.t) : "", line: true, cls: `imbalance layer-${n}`,
    points: steps.filter(s => s.layers[i] === n && !missing(s.max_over_mean[i])).map(s => ({
      x: s.step, y: s.max_over_mean[i], tip: `step ${s.step}: ${layerName(n, run.t)} busiest / mean ${num(s.max_over_mean[i])}`}))}));
  Plot.xy(document.getElementById("plot-expert-imbalance"), series,
          {xLabel: "step", yLabel: "busiest expert / mean", integerX: true, empty: "no step stored yet"});
}

function medianOf(values) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b), mid = s.length >> 1;
  return s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

async function loadTraining(id) {
  const [t, metrics] = await Promise.all([api(`/v1/trainings/${id}`), allMetrics(id)]);
  return {id, t, metrics};
}

async function trainingPage(id) {
  const [run, ckpts, load] = await Promise.all([loadTraining(id), api(`/v1/trainings/${id}/checkpoints`),
                                               loadExpertLoad(id)]);
  const {t, metrics} = run;
  const facts = summary([
    ["status", badge(t.status)], ["model", t.model], ["layout", h("code", {}, t.label)],
    ["placement", placementText(t.config)], ["images", t.training.images ? imagesText(t.training.images) : null],
    ["cluster", cluster(t.cluster)],
    ["steps", `${metrics.length ? metrics[metrics.length - 1].step : 0}/${t.steps}`],
    ["step time", `predicted ${ms(t.predicted_step_time_s)}, measured ${ms(t.measured_step_time_s)} (median), error ${pct(t.step_time_error)}`],
    ["took", h("span", {id: "training-took"}, runTime(t))],
    ["started", t.started_at ? `${when(t.started_at)}${t.finished_at ? ", finished " + when(t.finished_at) : ""}` : null],
    ["from job", t.job_id ? h("a", {href: `#/jobs/${t.job_id}`}, `#${t.job_id}`) : null],
    ["error", t.error, "error"]]);
  const node = h("div", {},
    h("p", {}, h("a", {href: "#/trainings"}, "← trainings")),
    card(`Training #${t.id}`, facts),
    ...curveCards(),
    ...expertLoadCards(load),
    card(`Checkpoints (${ckpts.items.length})`, ckpts.items.length
      ? table(["step", "directory", "size", "state"], ckpts.items.map(c => [String(c.step), h("code", {}, c.name), bytes(c.bytes),
          (c.complete ? "complete" : "incomplete") + (c.latest ? ", latest" : "")]), {id: "checkpoints-table"})
      : h("p", {}, `None under ${ckpts.checkpoint_dir} (as this server sees it).`)));
  return {node, after: () => { drawCurves([run]); drawExpertLoad(run, load); }, live: LIVE.has(t.status)};
}

async function trainingComparePage(a, b) {
  const runs = await Promise.all([loadTraining(a), loadTraining(b)]);
  const last = (run, key) => { const rows = present(run.metrics, key); return rows.length ? rows[rows.length - 1][key] : null; };
  const median = (run, key) => medianOf(present(run.metrics, key).map(m => m[key]));
  const [A, B] = runs;
  const row = (what, f) => [what, f(A), f(B)];
  const rows = [
    row("status", r => badge(r.t.status)), row("model", r => r.t.model), row("layout", r => h("code", {}, r.t.label)),
    row("cluster", r => cluster(r.t.cluster)),
    row("sequence × global batch", r => `${r.t.training.seq_length} × ${r.t.training.global_batch_size}`),
    row("precision", r => r.t.training.precision),
    row("steps done", r => `${r.metrics.length ? r.metrics[r.metrics.length - 1].step : 0}/${r.t.steps}`),
    row("lr (peak → end), warm-up", r => `${num(r.t.recipe.lr, 3)} → ${num(r.t.recipe.min_lr, 3)}, ${r.t.recipe.warmup_steps} steps`),
    row("last train loss", r => num(last(r, "loss"))), row("last eval loss", r => num(last(r, "eval_loss"))),
    row("predicted step", r => ms(r.t.predicted_step_time_s)), row("measured step (median)", r => ms(r.t.measured_step_time_s)),
    row("prediction error", r => pct(r.t.step_time_error)),
    row("tokens/s (median)", r => num(median(r, "tokens_per_s"))),
    row("peak memory", r => bytes(median(r, "peak_memory_bytes"))),
    row("took", r => runTime(r.t))];
  const node = h("div", {},
    h("p", {}, h("a", {href: "#/trainings"}, "← trainings")),
    card(`Training #${a} vs #${b}`, sideBySide("training-compare", `#${a}`, `#${b}`, rows),
      h("p", {class: "hint"}, "Highlighted: where they differ. Below, both runs on the same axes.")),
    ...curveCards());
  return {node, after: () => drawCurves(runs), live: runs.some(r => LIVE.has(r.t.status))};
}
