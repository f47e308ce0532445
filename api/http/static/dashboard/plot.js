// The dashboard's plots, drawn by plotly.js (MIT), which this server serves from the installed `plotly` Python
// package at /vendor/plotly.min.js: no plotting code of its own, nothing from a CDN. This file only turns the
// pages' series into plotly traces and layouts: points and lines on linear or log axes with reference lines
// (y = x, a Pareto front, dashed guides such as usable memory), stacked bars, and heatmaps.
//
// Each trace's uid names what it shows (a series' `cls`, e.g. "raw", "train-loss run-3"); plotly writes it
// into the class of the trace's <g> ("trace" + uid), so a test or a style finds a series' points
// (`g.trace.tracetrain-loss path.point`). Hover (or a tap) on a point shows its tip.
//
// A chart is drawn at its container's width in CSS pixels and drawn again when that width changes.
// Below NARROW px the plots neither zoom nor pan: a finger on a plot scrolls the page.
"use strict";

const Plot = (() => {
  const MAX_MARKERS = 400;  // a line series with more points is drawn without markers
  const NARROW = 520;
  const PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777",
                   "#4b5563", "#65a30d", "#7c3aed", "#0d9488", "#b45309", "#be123c", "#1d4ed8", "#57534e"];
  const GUIDE_COLORS = {capacity: "#b45309", clip: "#b45309"};
  const FONT = {family: 'system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif', size: 11,
                color: "#374151"};
  // Nothing is fetched from elsewhere: MathJax is never typeset (plotly would only use one already on the
  // page), maps' topojson would come from this server (no geo plot is drawn), no "send to cloud" button.
  // No mode bar: it would sit over the legend; a drag zooms and a double click resets (not below NARROW px).
  const CONFIG = {displaylogo: false, typesetMath: false, topojsonURL: "/vendor/topojson/", showSendToCloud: false,
                  showEditInChartStudio: false, plotlyServerURL: "", responsive: false, displayModeBar: false,
                  doubleClick: "reset"};

  // The chart's size from its container: as wide as the container, about 0.6 as high.
  function size(target) {
    const width = Math.max(260, Math.round(target.clientWidth || 560));
    return {width, height: Math.round(Math.min(380, Math.max(280, width * 0.62))), narrow: width < NARROW};
  }

  // Redraws a plot when its container's width changes: a window resized or turned, or a scroll bar that
  // appeared beside the page once it grew (no window event for that one).
  let resizeQueued = false;
  const resized = new ResizeObserver(() => {
    if (resizeQueued) return;
    resizeQueued = true;
    requestAnimationFrame(() => {
      resizeQueued = false;
      for (const t of document.querySelectorAll(".plot-host")) {
        if (t.clientWidth && t.clientWidth !== t._plotWidth) t._plotDraw();
      }
    });
  });

  // Keeps `draw` to run again when the container's width changes.
  function remember(target, draw) {
    if (!target.classList.contains("plot-host")) resized.observe(target);
    target.classList.add("plot-host");
    target._plotDraw = draw;
    target._plotWidth = target.clientWidth;
  }

  // One axis: plotly's ticks, in one notation per axis (every log tick labelled in full, SI prefixes from
  // 10^4 up), whole numbers only on an `integer` axis.
  function axis(title, values, o) {
    const a = {title: {text: title || "", font: {size: 12, color: "#111827"}, standoff: 8}, type: o.log ? "log" : "linear",
               automargin: true, showline: true, mirror: true, linecolor: "#9ca3af", gridcolor: "#eef0f3",
               zeroline: false, ticks: "outside", tickcolor: "#9ca3af", ticklen: 4, exponentformat: "SI",
               minorloglabels: "complete", fixedrange: !!o.fixed};
    const finite = values.filter(v => isFinite(v) && (!o.log || v > 0));
    const big = finite.length ? Math.max(...finite.map(Math.abs)) : 0;
    if (o.log && finite.length) {  // labelled 1-2-5 ticks over one to three decades, not every 1..9 crowded
      const decades = Math.log10(big) - Math.log10(Math.min(...finite));
      if (decades > 0.8 && decades <= 3) a.dtick = "D2";
    }
    // plotly prefixes once the range reaches 10^3.99 (9,772): data under 10^4 would read 0, 2k, ... 8k with no
    // tick at 10k. Such an axis keeps plain numbers; SI prefixes start where the data reach 10^4.
    if (big >= 1 && big < 1e4) a.exponentformat = "none";
    if (o.zero && !o.log) a.rangemode = "tozero";
    if (o.integer) {
      a.tickformat = "d";
      const span = finite.length ? Math.max(...finite) - Math.min(...finite) : 0;
      if (span <= 8) a.dtick = 1;  // else plotly's steps are 2, 5, 10, ... and stay whole
    }
    if (o.range) a.range = o.range;
    return a;
  }

  function baseLayout(width, height, narrow) {
    return {width, height, font: FONT, paper_bgcolor: "#fff", plot_bgcolor: "#fff", margin: {l: 8, r: 10, t: 8, b: 8},
            hovermode: "closest", dragmode: narrow ? false : "zoom", hoverlabel: {font: {size: 12}, align: "left"},
            showlegend: true, legend: {orientation: "h", x: 0, xanchor: "left", y: 1.02, yanchor: "bottom",
                                       font: {size: 11}, itemclick: "toggle"}};
  }

  function draw(target, traces, layout) {
    if (typeof Plotly === "undefined") {  // the server could not serve it: say so where the plot would be
      target.replaceChildren(h("p", {class: "error"}, "No plot: /vendor/plotly.min.js did not load (the server's " +
                                                       "plotly package is missing; GET it for the reason)."));
      return;
    }
    Plotly.react(target, traces, layout, CONFIG);
    target._plotWidth = target.clientWidth;
  }

  function emptyLayout(layout, message) {
    return {...layout, showlegend: false, xaxis: {visible: false}, yaxis: {visible: false},
            annotations: [{text: message || "no data yet", xref: "paper", yref: "paper", x: 0.5, y: 0.5,
                           showarrow: false, font: {size: 13, color: "#6b7280"}}]};
  }

  // Trace uids are unique within a chart: a repeated one gets its index appended.
  function uniqueUids(traces) {
    const seen = new Set();
    traces.forEach((t, i) => {
      if (seen.has(t.uid)) t.uid = `${t.uid} n${i}`;
      seen.add(t.uid);
    });
    return traces;
  }

  const tipText = tip => String(tip || "").replaceAll("\n", "<br>");

  // series: [{name, color, points: [{x, y, tip, detail, xlo, xhi, ylo, yhi}], line: bool, markers: bool (default
  //          true), cls, radius}]; a point's xlo/xhi and ylo/yhi (optional) are its intervals, drawn as whiskers
  // opts: {xLabel, yLabel, identity: draw y = x, front: [{x, y}] a Pareto front, zeroY: y from 0,
  //        integerX: whole-number x ticks, logX / logY: log axes (points <= 0 are left out),
  //        guides: [{x} or {y}, label, cls] dashed reference lines (e.g. usable memory) named in the legend,
  //        empty: the text shown without data, onPoint: called with a point's detail (else its tip) when it is
  //        hovered or tapped}
  // plotly's asymmetric error bars of a series whose points carry intervals (xlo/xhi, ylo/yhi): none otherwise
  function whiskers(s) {
    const bar = (lo, hi, at) => {
      if (!s.points.some(p => isFinite(p[lo]) && isFinite(p[hi]))) return null;
      const has = p => isFinite(p[lo]) && isFinite(p[hi]);
      return {type: "data", symmetric: false, visible: true, color: s.color, thickness: 1, width: 0,
              array: s.points.map(p => has(p) ? p[hi] - p[at] : 0),
              arrayminus: s.points.map(p => has(p) ? p[at] - p[lo] : 0)};
    };
    const out = {}, ex = bar("xlo", "xhi", "x"), ey = bar("ylo", "yhi", "y");
    if (ex) out.error_x = ex;
    if (ey) out.error_y = ey;
    return out;
  }

  function xy(target, series, opts) {
    remember(target, () => xy(target, series, opts));
    const {width, height, narrow} = size(target);
    const layout = baseLayout(width, height, narrow);
    const keep = p => isFinite(p.x) && isFinite(p.y) && (!opts.logX || p.x > 0) && (!opts.logY || p.y > 0);
    let shown = series.map((s, i) => ({...s, color: s.color || PALETTE[i % PALETTE.length],
                                       points: s.points.filter(keep)}));
    let all = shown.flatMap(s => s.points);
    if (!all.length) return draw(target, [], emptyLayout(layout, opts.empty));
    let guides = opts.guides || [], yLabel = opts.yLabel;
    // Values all below 0.01 (learning rates) are drawn in units of their power of ten, named in the axis
    // title ("learning rate (×10⁻³)"): plotly would label them 200µ, or 0e+0 at zero. Tips keep the values.
    const top = Math.max(...all.map(p => Math.abs(p.y)), ...guides.filter(g => "y" in g).map(g => Math.abs(g.y)));
    if (!opts.logY && !opts.identity && top > 0 && top < 1e-2) {
      const e = Math.floor(Math.log10(top)), unit = 10 ** e;
      shown = shown.map(s => ({...s, points: s.points.map(p => ({...p, y: p.y / unit,
        ...(isFinite(p.ylo) && isFinite(p.yhi) ? {ylo: p.ylo / unit, yhi: p.yhi / unit} : {})}))}));
      guides = guides.map(g => ("y" in g ? {...g, y: g.y / unit} : g));
      all = shown.flatMap(s => s.points);
      yLabel = `${yLabel || ""} (×10<sup>${String(e).replace("-", "\u2212")}</sup>)`;
    }

    const traces = [];
    let rank = 1;
    for (const s of shown) {
      if (!s.points.length) continue;
      const markers = s.markers !== false && !(s.line && s.points.length > MAX_MARKERS);
      const r = s.radius || (s.points.length > 60 ? 3 : 4);
      traces.push({type: "scatter", uid: s.cls || s.name, name: s.name, showlegend: !!s.name, legendrank: rank++,
                   mode: [s.line && s.points.length > 1 ? "lines" : "", markers ? "markers" : ""].filter(Boolean).join("+") || "markers",
                   x: s.points.map(p => p.x), y: s.points.map(p => p.y), text: s.points.map(p => tipText(p.tip)),
                   customdata: s.points.map(p => p.detail || p.tip || ""),
                   hovertemplate: "%{text}<extra></extra>", line: {color: s.color, width: 1.8},
                   marker: {color: s.color, size: 2 * r, opacity: 0.9, line: {color: "#fff", width: 1}},
                   ...whiskers(s)});
    }
    // the axes span every interval too (a log axis only its positive ends)
    const ends = (lo, hi, log) => [lo, hi].filter(v => isFinite(v) && (!log || v > 0));
    const xs = all.flatMap(p => [p.x, ...ends(p.xlo, p.xhi, opts.logX)]).concat(guides.filter(g => "x" in g).map(g => g.x));
    const ys = all.flatMap(p => [p.y, ...ends(p.ylo, p.yhi, opts.logY)]).concat(guides.filter(g => "y" in g).map(g => g.y));
    let xRange = null, both = null;
    if (opts.identity) {  // y = x across both axes, which then span the same values
      both = xs.concat(ys).filter(v => !opts.logX || v > 0);
      const lo = Math.min(...both), hi = Math.max(...both);
      traces.unshift({type: "scatter", uid: "identity", name: "y = x", mode: "lines", x: [lo, hi], y: [lo, hi],
                      hoverinfo: "skip", legendrank: 1000, line: {color: "#6b7280", width: 1.2, dash: "dash"}});
      if (opts.logX) {
        const a = Math.log10(lo), b = Math.log10(hi), pad = Math.max((b - a) * 0.06, 0.02);
        xRange = [a - pad, b + pad];
      } else {
        const pad = Math.max((hi - lo) * 0.06, Math.abs(hi) * 0.02 || 1);
        xRange = [lo - pad, hi + pad];
      }
    }
    if (opts.front && opts.front.length) {
      const f = opts.front.filter(keep);
      traces.unshift({type: "scatter", uid: "front", name: "Pareto front", mode: "lines", x: f.map(p => p.x),
                      y: f.map(p => p.y), hoverinfo: "skip", legendrank: 1001,
                      line: {color: "#dc2626", width: 1.5}});
    }
    // guides are shapes (they count in the axes' ranges), named in the legend: a label beside the line would
    // cover points
    layout.shapes = guides.map((g, i) => ({
      type: "line", name: g.label, showlegend: true, legendrank: 1002 + i,
      ...("x" in g ? {xref: "x", yref: "paper", x0: g.x, x1: g.x, y0: 0, y1: 1}
                   : {xref: "paper", yref: "y", x0: 0, x1: 1, y0: g.y, y1: g.y}),
      line: {color: GUIDE_COLORS[g.cls] || "#b45309", width: 1.5, dash: "dash"}}));
    const fixed = narrow;
    layout.xaxis = axis(opts.xLabel, both || xs, {log: opts.logX, integer: opts.integerX, range: xRange, fixed});
    layout.yaxis = axis(yLabel, both || ys, {log: opts.logY, zero: opts.zeroY, range: xRange, fixed});
    draw(target, uniqueUids(traces), layout);
    if (opts.onPoint && target.on) {
      const show = ev => { const p = ev.points && ev.points[0]; if (p && p.customdata) opts.onPoint(p.customdata); };
      target.removeAllListeners("plotly_hover");
      target.removeAllListeners("plotly_click");
      target.on("plotly_hover", show);
      target.on("plotly_click", show);  // touch screens have no hover
    }
  }

  // bars: [{label, parts: {term: value}}]; the same term gets the same colour in every bar (and in every
  // chart drawn with the same `terms` order), one trace per term (uid "term <name>"), stacked.
  // opts: {yLabel, fmt: value -> text, terms: order of terms, empty}
  function stacked(target, bars, opts) {
    remember(target, () => stacked(target, bars, opts));
    const {width, height, narrow} = size(target);
    const layout = baseLayout(width, height, narrow);
    if (!bars.length) return draw(target, [], emptyLayout(layout, opts.empty));
    const terms = opts.terms || [...new Set(bars.flatMap(b => Object.keys(b.parts)))];
    const present = terms.filter(t => bars.some(b => (b.parts[t] || 0) > 0));
    const labels = bars.map(b => b.label);
    const traces = present.map(t => ({
      type: "bar", uid: `term ${t}`, name: t, x: labels,
      y: bars.map(b => ((b.parts[t] || 0) > 0 ? b.parts[t] : null)),
      text: bars.map(b => ((b.parts[t] || 0) > 0 ? `${b.label}: ${t} ${opts.fmt ? opts.fmt(b.parts[t]) : b.parts[t]}` : "")),
      textposition: "none", hovertemplate: "%{text}<extra></extra>",
      marker: {color: PALETTE[terms.indexOf(t) % PALETTE.length], line: {color: "#fff", width: 0.5}}}));
    Object.assign(layout, {barmode: "stack", bargap: 0.45, height: height + 16 * Math.ceil(present.length / 3),
                           legend: {...layout.legend, y: -0.12, yanchor: "top"}});
    const totals = bars.map(b => Object.values(b.parts).reduce((a, v) => a + Math.max(v, 0), 0));
    layout.xaxis = {...axis("", [], {fixed: narrow}), type: "category"};
    layout.yaxis = axis(opts.yLabel, totals.concat([0]), {zero: true, fixed: narrow});
    draw(target, traces, layout);
  }

  // A matrix as coloured cells: z[row][column], rows named by `rows`, columns by `columns`.
  // opts: {xLabel, yLabel, zLabel (the colour bar's title), tips: [row][column] texts, zmin, zmax, empty}
  function heatmap(target, z, opts) {
    remember(target, () => heatmap(target, z, opts));
    const {width, height, narrow} = size(target);
    const layout = baseLayout(width, height, narrow);
    if (!z.length) return draw(target, [], emptyLayout(layout, opts.empty));
    const trace = {type: "heatmap", uid: opts.uid || "heatmap", z, x: opts.columns, y: opts.rows,
                   colorscale: "YlOrRd", reversescale: true,  // plotly's YlOrRd runs red to yellow zmin: opts.zmin, zmax: opts.zmax, xgap: 1, ygap: 1,
                   text: opts.tips, hovertemplate: "%{text}<extra></extra>",
                   colorbar: {title: {text: opts.zLabel || "", side: "right"}, thickness: 10, outlinewidth: 0}};
    layout.showlegend = false;
    layout.height = Math.round(Math.min(520, Math.max(220, 60 + 22 * z.length)));
    layout.xaxis = {...axis(opts.xLabel, [], {fixed: narrow}), type: "category", showgrid: false, ticks: ""};
    layout.yaxis = {...axis(opts.yLabel, [], {fixed: narrow}), type: "category", showgrid: false, ticks: "",
                    autorange: "reversed"};  // the first layer on top, as the model reads
    draw(target, [trace], layout);
  }

  // Frees the plots inside `root` (their listeners and plotly's state) before the page replaces them.
  function purge(root) {
    for (const node of root.querySelectorAll(".plot-host")) {
      resized.unobserve(node);
      if (typeof Plotly !== "undefined") Plotly.purge(node);
    }
  }

  // Points not beaten on both axes (smaller x and smaller y), sorted by x.
  function paretoFront(points) {
    const sorted = [...points].sort((a, b) => a.x - b.x || a.y - b.y);
    const out = [];
    let best = Infinity;
    for (const p of sorted) if (p.y < best) { out.push(p); best = p.y; }
    return out;
  }

  return {xy, stacked, heatmap, purge, paretoFront, PALETTE};
})();
