// Small SVG plots for the dashboard: scatter/line charts on linear axes and stacked bars.
// No library: each chart is an <svg> of circles (one per data point, class "pt"), paths (class "series",
// "ref" for y = x, "front" for a Pareto front) and axis text, so a test can count what a person sees.
"use strict";

const Plot = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 560, H = 320, M = {left: 70, right: 16, top: 30, bottom: 48};
  const PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777",
                   "#4b5563", "#65a30d", "#7c3aed", "#0d9488", "#b45309", "#be123c", "#1d4ed8", "#57534e"];

  function el(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  // About six round ticks covering [lo, hi].
  // integer: steps of whole numbers (trial numbers, steps).
  function ticks(lo, hi, integer) {
    if (!(hi > lo)) { const d = Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
    const raw = (hi - lo) / 6, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = [1, 2, 2.5, 5, 10].map(f => f * mag).find(s => s >= raw);
    if (integer) step = Math.max(1, Math.round(step));
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return {lo: Math.min(lo, out[0]), hi: Math.max(hi, out[out.length - 1]), values: out};
  }

  // Ticks of a log10 axis ([lo, hi] in log10 units) at 1, 2, 5 × 10^k, or only at 10^k when those are many.
  function logTicks(lo, hi) {
    const pick = mults => {
      const out = [];
      for (let k = Math.floor(lo); k <= Math.ceil(hi); k++) {
        for (const m of mults) {
          const t = k + Math.log10(m);
          if (t >= lo - 1e-9 && t <= hi + 1e-9) out.push(t);
        }
      }
      return out;
    };
    let values = pick([1, 2, 5]);
    if (values.length > 8) values = pick([1]);
    if (values.length < 2) values = pick([1, 1.5, 2, 3, 5, 7]);
    return {lo, hi, values, log: true};
  }

  function fmtTick(v) {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e4 || a < 1e-3) return v.toExponential(1);
    return String(+v.toPrecision(4));
  }

  function frame(target, opts) {
    target.innerHTML = "";
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img",
                           "aria-label": opts.title || ""}, target);
    if (opts.title) el("text", {x: M.left, y: 18, class: "plot-title"}, svg).textContent = opts.title;
    return svg;
  }

  function axes(svg, xs, ys, opts, right) {
    const pw = W - M.left - (right || M.right), ph = H - M.top - M.bottom;
    const sx = v => M.left + (v - xs.lo) / (xs.hi - xs.lo) * pw;
    const sy = v => M.top + ph - (v - ys.lo) / (ys.hi - ys.lo) * ph;
    const g = el("g", {class: "axes"}, svg);
    for (const t of ys.values) {
      el("line", {x1: M.left, x2: M.left + pw, y1: sy(t), y2: sy(t), class: "grid"}, g);
      el("text", {x: M.left - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick"}, g)
        .textContent = fmtTick(ys.log ? Math.pow(10, t) : t);
    }
    for (const t of xs.values || []) {
      el("line", {x1: sx(t), x2: sx(t), y1: M.top, y2: M.top + ph, class: "grid"}, g);
      el("text", {x: sx(t), y: M.top + ph + 16, "text-anchor": "middle", class: "tick"}, g)
        .textContent = fmtTick(xs.log ? Math.pow(10, t) : t);
    }
    el("rect", {x: M.left, y: M.top, width: pw, height: ph, class: "plot-box"}, g);
    el("text", {x: M.left + pw / 2, y: H - 8, "text-anchor": "middle", class: "axis-label"}, g)
      .textContent = opts.xLabel || "";
    el("text", {x: 14, y: M.top + ph / 2, "text-anchor": "middle", class: "axis-label",
                transform: `rotate(-90 14 ${M.top + ph / 2})`}, g).textContent = opts.yLabel || "";
    return {sx, sy, pw, ph};
  }

  function legend(svg, series) {
    let x = W - M.right;
    for (const s of [...series].reverse()) {
      if (!s.name) continue;
      const text = el("text", {x, y: 18, "text-anchor": "end", class: "legend"}, svg);
      text.textContent = s.name;
      const w = (text.getComputedTextLength() || s.name.length * 6.6) + 14;
      el("circle", {cx: x - w + 6, cy: 14, r: 4, fill: s.color}, svg);
      x -= w + 10;
    }
  }

  function pathOf(points, sx, sy) {
    return points.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join("");
  }

  // series: [{name, color, points: [{x, y, tip}], line: bool, markers: bool (default true), cls}]
  // opts: {title, xLabel, yLabel, identity: bool (draw y = x), front: [{x, y}] (Pareto front path), zeroY,
  //        integerX: whole-number x ticks, logX / logY: logarithmic axes (points <= 0 are left out)}
  function xy(target, rawSeries, opts) {
    const svg = frame(target, opts);
    // On a log axis the plot works in log10 units; labels show the values again.
    const tx = opts.logX ? Math.log10 : v => v, ty = opts.logY ? Math.log10 : v => v;
    const keep = p => (!opts.logX || p.x > 0) && (!opts.logY || p.y > 0);
    const series = opts.logX || opts.logY ? rawSeries.map(s => ({...s, points: s.points.filter(keep)
      .map(p => ({...p, x: tx(p.x), y: ty(p.y)}))})) : rawSeries;
    if (opts.front) opts = {...opts, front: opts.front.filter(keep).map(p => ({x: tx(p.x), y: ty(p.y)}))};
    const all = series.flatMap(s => s.points).filter(p => isFinite(p.x) && isFinite(p.y));
    if (!all.length) {
      el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, svg).textContent = "no data yet";
      return svg;
    }
    let xlo = Math.min(...all.map(p => p.x)), xhi = Math.max(...all.map(p => p.x));
    let ylo = Math.min(...all.map(p => p.y)), yhi = Math.max(...all.map(p => p.y));
    if (opts.identity) { xlo = ylo = Math.min(xlo, ylo); xhi = yhi = Math.max(xhi, yhi); }
    if (opts.zeroY) ylo = Math.min(0, ylo);
    const pad = (lo, hi) => [lo - (hi - lo) * 0.04, hi + (hi - lo) * 0.04];
    [xlo, xhi] = pad(xlo, xhi); [ylo, yhi] = pad(ylo, yhi);
    if (opts.zeroY && ylo < 0 && Math.min(...all.map(p => p.y)) >= 0) ylo = 0;
    const xs = opts.logX ? logTicks(xlo, xhi) : ticks(xlo, xhi, opts.integerX);
    const ys = opts.identity ? xs : opts.logY ? logTicks(ylo, yhi) : ticks(ylo, yhi);
    const {sx, sy} = axes(svg, xs, ys, opts);
    if (opts.identity) {
      const ref = el("path", {d: `M${sx(xs.lo)},${sy(xs.lo)}L${sx(xs.hi)},${sy(xs.hi)}`, class: "ref"}, svg);
      el("title", {}, ref).textContent = "y = x (prediction equals measurement)";
      el("text", {x: sx(xs.hi) - 4, y: sy(xs.hi) + 14, "text-anchor": "end", class: "ref-label"}, svg)
        .textContent = "y = x";
    }
    if (opts.front && opts.front.length) {
      const f = el("path", {d: pathOf(opts.front, sx, sy), class: "front"}, svg);
      el("title", {}, f).textContent = "Pareto front: no other layout is both faster and smaller";
    }
    series.forEach((s, i) => {
      s.color = s.color || PALETTE[i % PALETTE.length];
      rawSeries[i].color = s.color;
      const pts = s.points.filter(p => isFinite(p.x) && isFinite(p.y));
      const g = el("g", {class: "series-group", "data-series": s.name || ""}, svg);
      if (s.line && pts.length > 1) el("path", {d: pathOf(pts, sx, sy), class: "series", stroke: s.color}, g);
      if (s.markers === false) return;
      for (const p of pts) {
        const c = el("circle", {cx: sx(p.x), cy: sy(p.y), r: s.radius || 4, fill: s.color,
                                class: "pt" + (s.cls ? " " + s.cls : "")}, g);
        if (p.tip) { c.dataset.tip = p.tip; el("title", {}, c).textContent = p.tip; }
      }
    });
    legend(svg, series);
    return svg;
  }

  // bars: [{label, parts: {term: value}}]; the same term gets the same colour in every bar.
  function stacked(target, bars, opts) {
    const svg = frame(target, opts);
    if (!bars.length) {
      el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, svg).textContent = "no data yet";
      return svg;
    }
    const terms = [...new Set(bars.flatMap(b => Object.keys(b.parts)))];
    const totals = bars.map(b => Object.values(b.parts).reduce((a, v) => a + v, 0));
    const ys = ticks(0, Math.max(...totals, 0) * 1.05 || 1);
    const legendW = 130;  // the term legend sits right of the plot box
    const {sy, pw} = axes(svg, {lo: 0, hi: 1, values: []}, ys, opts, M.right + legendW);
    const slot = pw / Math.max(bars.length, 1), bw = Math.min(90, slot * 0.5);
    bars.forEach((b, i) => {
      const x = M.left + slot * i + (slot - bw) / 2;
      let acc = 0;
      const g = el("g", {class: "bar", "data-bar": b.label}, svg);
      terms.forEach((t, k) => {
        const v = b.parts[t] || 0;
        if (v <= 0) return;
        const r = el("rect", {x, y: sy(acc + v), width: bw, height: Math.max(sy(acc) - sy(acc + v), 0.5),
                              fill: PALETTE[k % PALETTE.length], class: "seg", "data-term": t}, g);
        const tip = `${b.label}: ${t} ${opts.fmt ? opts.fmt(v) : v}`;
        r.dataset.tip = tip;
        el("title", {}, r).textContent = tip;
        acc += v;
      });
      el("text", {x: x + bw / 2, y: H - M.bottom + 16, "text-anchor": "middle", class: "tick"}, g)
        .textContent = b.label;
    });
    // Legend on the right, one row per term present.
    const lg = el("g", {class: "stack-legend"}, svg);
    terms.forEach((t, k) => {
      const y = M.top + 4 + k * 14;
      el("rect", {x: W - M.right - legendW + 12, y: y - 8, width: 9, height: 9, fill: PALETTE[k % PALETTE.length]}, lg);
      el("text", {x: W - M.right - legendW + 26, y, class: "legend"}, lg).textContent = t;
    });
    return svg;
  }

  // Points not beaten on both axes (smaller x and smaller y), sorted by x.
  function paretoFront(points) {
    const sorted = [...points].sort((a, b) => a.x - b.x || a.y - b.y);
    const out = [];
    let best = Infinity;
    for (const p of sorted) if (p.y < best) { out.push(p); best = p.y; }
    return out;
  }

  return {xy, stacked, paretoFront, PALETTE};
})();
