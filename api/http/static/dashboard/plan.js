// The plan explorer (#/plan): a form posted to POST /v1/plans (the model and GPU lists from GET /v1/models and
// /v1/hardware-profiles), the layouts as predicted memory against predicted step time with their intervals
// (whiskers) and the usable memory per GPU (those only Megatron-Core runs apart from those foldtune's executor
// runs), the ranked layouts as a table of values and intervals, and the rules that rejected the rest. By default
// the plan ranks the executor's layouts first; "rank as Megatron-Core" ranks them all alike (the request's
// megatron field).
"use strict";

const GIB = 2 ** 30;

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
    h("label", {}, "rank by ", h("select", {id: "plan-rank-by", name: "rank_by"},
      h("option", {value: "robust"}, "interval's high end"), h("option", {value: "point"}, "point estimate"))),
    h("label", {}, h("input", {id: "plan-megatron", name: "megatron", type: "checkbox"}), " rank as Megatron-Core"),
    h("button", {type: "submit"}, "Plan"));
  const out = h("div", {id: "plan-out"});
  form.addEventListener("submit", ev => { ev.preventDefault(); runPlan(form, out); });
  const after = async () => {
    // hardware profiles come in pages of at most 50
    const [models, gpus] = await Promise.all([api("/v1/models"), allPages("/v1/hardware-profiles", 1000, 50)]);
    const m = document.getElementById("plan-model"), g = document.getElementById("plan-gpu");
    m.replaceChildren(...models.items.map(x => h("option", {value: x.name}, x.name)));
    g.replaceChildren(...gpus.map(x => h("option", {value: x.name}, x.name)));
    if (models.items.some(x => x.name === "mixtral-8x7b")) m.value = "mixtral-8x7b";
    const h100 = gpus.find(x => x.name.startsWith("h100"));
    if (h100) g.value = h100.name;
    form.dataset.ready = "1";
  };
  const node = h("div", {}, card("Plan explorer",
    h("p", {class: "hint"}, "The cost model's instant answer (POST /v1/plans): every valid layout predicted to fit, " +
      "best first by the high end of its step-time interval (or by the point estimate), those foldtune's executor " +
      "runs before those only Megatron-Core runs (or all alike: rank as Megatron-Core). Each estimate carries an " +
      "interval from where its terms' constants come from (measured, extrapolated, datasheet, never-measured network). Nothing runs."),
    form, out));
  return {node, after: () => after().catch(e => out.replaceChildren(h("p", {class: "error"}, e.message))), live: false};
}

// "1.23 s (0.98–2.10 s)": a value with its interval, when the estimate has one
function withInterval(value, interval, fmt) {
  return interval ? `${fmt(value)} (${fmt(interval.low)}–${fmt(interval.high)})` : fmt(value);
}

function estimateTip(e) {
  const runs = e.executable ? "runs on foldtune's executor" : `Megatron-Core only; foldtune's executor: ${e.executable_reason}`;
  const rate = e.interval_rate ? ` [${pct(e.interval_rate)} intervals]` : "";
  return `${e.layout}\nstep ${withInterval(e.step_time_s, e.step_time_interval_s, ms)}, memory ` +
         `${withInterval(e.memory_bytes.total, e.memory_interval_bytes, bytes)}${rate} (headroom ${bytes(e.memory_headroom_bytes)})\n` +
         `MFU ${pct(e.mfu)}, ${num(e.tokens_per_s_per_gpu)} tokens/s/GPU, limiter ${e.limiter}\n${e.explanation}\n${runs}`;
}

// The ranked layouts in order, each step time and memory with its interval.
function rankedTable(plan) {
  return table(["#", "layout", "step", "step interval", "memory", "memory interval", "limiter", "runs"],
    plan.ranked.map((e, i) => [String(i + 1), h("code", {}, e.layout), ms(e.step_time_s),
      e.step_time_interval_s ? `${ms(e.step_time_interval_s.low)}–${ms(e.step_time_interval_s.high)}` : "—",
      bytes(e.memory_bytes.total),
      e.memory_interval_bytes ? `${bytes(e.memory_interval_bytes.low)}–${bytes(e.memory_interval_bytes.high)}` : "—",
      e.limiter, e.executable === false ? "Megatron-Core only" : "yes"]), {id: "ranked-table"});
}

// One sentence on what the plan found; says plainly when nothing fits or nothing is valid.
function planVerdict(plan) {
  const usable = bytes(plan.cluster.usable_hbm_bytes);
  const counts = `${plan.considered} layouts considered, ${plan.valid} valid, ${plan.pruned_by_memory} predicted not to fit, ${plan.fitting} fit`;
  const order = (plan.rank_by === "point" ? "by point estimate" : "by the high end of the step-time interval" +
    (plan.robust_exact === false ? `, among the ${plan.robust_shortlist} fastest by point estimate` : "")) +
    (plan.ranking === "megatron" ? ", as Megatron-Core runs them" : ", those foldtune's executor runs first");
  if (plan.ranked.length) {
    const only = plan.ranked.filter(e => !e.executable).length;
    return `${counts}; showing the best ${plan.ranked.length} ${order}` +
           (only ? `; ${only} only Megatron-Core runs` : "") + ` (${num(plan.seconds, 3)} s).`;
  }
  if (plan.closest) {
    const over = plan.closest.memory_bytes.total - plan.cluster.usable_hbm_bytes;
    return `${counts}. None fits: every valid layout needs more than the ${usable} usable per GPU; the least over ` +
           `(shown) needs ${bytes(plan.closest.memory_bytes.total)}, ${bytes(over)} too much (${num(plan.seconds, 3)} s).`;
  }
  return `${counts}. No layout is valid for this model on this cluster: see the rules that rejected them (${num(plan.seconds, 3)} s).`;
}

async function runPlan(form, out) {
  const v = name => form.elements[name].value;
  out.replaceChildren(h("p", {}, "planning…"));
  let plan;
  try {
    plan = await api("/v1/plans", {method: "POST", body: {
      model: v("model"), cluster: {gpu: v("gpu"), num_gpus: +v("num_gpus")},
      training: {seq_length: +v("seq_length"), global_batch_size: +v("global_batch_size"), precision: v("precision")},
      top: +v("top"), rank_by: v("rank_by"), megatron: form.elements.megatron.checked}});
  } catch (e) {
    const errs = (e.problem && e.problem.errors) || [];
    out.replaceChildren(h("p", {class: "error", id: "plan-error"}, e.message),
      errs.length ? h("ul", {}, errs.map(x => h("li", {}, `${(x.loc || []).join(".")}: ${x.message} [${x.rule}]`))) : null);
    return;
  }
  // the hover label names the layout and its two numbers; the box below the plot shows the whole estimate
  const point = e => ({x: e.memory_bytes.total / GIB, y: e.step_time_s * 1e3, detail: estimateTip(e),
    tip: estimateTip(e).split("\n").slice(0, 2).join("\n"), executable: e.executable,
    ...(e.step_time_interval_s ? {ylo: e.step_time_interval_s.low * 1e3, yhi: e.step_time_interval_s.high * 1e3} : {}),
    ...(e.memory_interval_bytes ? {xlo: e.memory_interval_bytes.low / GIB, xhi: e.memory_interval_bytes.high / GIB} : {})});
  const pts = plan.ranked.map(point);
  const front = Plot.paretoFront(pts);  // only among layouts that fit: with none, there is no front
  const onFront = new Set(front);
  const plotDiv = plotBox("plot-plan");
  const detail = h("pre", {id: "plan-detail", class: "detail"}, "Point at (or tap) a layout for its prediction.");
  const rejected = Object.entries(plan.rejected).sort((a, b) => b[1].count - a[1].count);
  const verdict = h("p", {id: "plan-counts", class: plan.ranked.length ? "" : "warn"}, planVerdict(plan));
  const shown = plan.ranked.length || plan.closest;
  out.replaceChildren(verdict,
    h("div", {class: "grid2"},
      shown ? h("div", {}, plotDiv, detail) : h("div", {}),
      h("div", {}, h("h3", {}, "Rejected by rule"),
        rejected.length ? table(["rule", "layouts", "example"], rejected.map(([rule, r]) => [h("code", {}, rule), String(r.count), r.example]),
                                {id: "rejected-table"}) : h("p", {}, "No layout was rejected."))),
    plan.ranked.length ? h("div", {}, h("h3", {}, "Ranked layouts"), rankedTable(plan)) : h("div", {}));
  if (!shown) return;
  const usable = plan.cluster.usable_hbm_bytes / GIB;
  const series = plan.ranked.length
    ? [{name: "layout", points: pts.filter(p => !onFront.has(p) && p.executable !== false), cls: "layout"},
       {name: "Megatron-Core only", points: pts.filter(p => !onFront.has(p) && p.executable === false), cls: "megatron",
        color: "#7c3aed"},
       {name: "on the Pareto front", points: front, cls: "pareto", color: "#dc2626", radius: 5}]
    : [{name: "least over memory (does not fit)", points: [point(plan.closest)], cls: "closest", color: "#b45309", radius: 6}];
  Plot.xy(plotDiv, series, {xLabel: "predicted peak memory per GPU (GiB), with its interval",
    yLabel: "predicted step time (ms), with its interval",
    front: plan.ranked.length ? front : null,
    guides: [{x: usable, label: `usable ${num(usable, 3)} GiB`, cls: "capacity"}],
    onPoint: tip => { detail.textContent = tip; }});  // hover, or a tap on a touch screen
}
