// The dashboard's SVG plots: scatter/line charts on linear or log axes, and stacked bars. Hand-written (no
// third-party code is fetched or vendored): each chart is an <svg> of circles (one per data point, class
// "pt"), paths (class "series"; "ref" for y = x; "front" for a Pareto front; "guide" for a reference line
// such as usable memory) and axis text, so a test can count what a person sees.
//
// A chart is drawn at its container's width in CSS pixels (text stays 11-13 px on a phone) and drawn again
// when the window's width changes. Axes span the data (no padding in data units, so trial numbers never
// start at -1); every tick label of one axis uses one format.
"use strict";

const Plot = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const M = {left: 62, right: 14, top: 10, bottom: 44};
  const INSET = 9;          // px between the plot box and the outermost data point, so markers are not cut
  const MAX_MARKERS = 400;  // a series with more points is drawn as a line only
  const CHAR_W = 6.4;       // px per character of 11 px text, to lay out legends before they are measured
  const PALETTE = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777",
                   "#4b5563", "#65a30d", "#7c3aed", "#0d9488", "#b45309", "#be123c", "#1d4ed8", "#57534e"];
  const SI = ["", "k", "M", "G", "T", "P"];

  function el(tag, attrs, parent) {
    const node = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function text(parent, attrs, content) {
    el("text", attrs, parent).textContent = content;
  }

  // ---------- ticks and their labels ----------

  // The nice step (1, 2, 2.5 or 5 × 10^k; whole numbers when `integer`) giving about `count` ticks.
  function niceStep(span, count, integer) {
    const raw = span / Math.max(count, 1), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const mults = integer && mag < 10 ? [1, 2, 5, 10] : [1, 2, 2.5, 5, 10];  // no 2.5 between whole numbers
    const step = mults.map(f => f * mag).find(s => s >= raw * (1 - 1e-9));
    return integer ? Math.max(1, Math.round(step)) : step;
  }

  // Decimals that show a value of `step`'s precision: 0.25 -> 2, 5 -> 0.
  function decimalsOf(step) {
    for (let d = 0; d < 12; d++) if (Math.abs(Math.round(step * 10 ** d) - step * 10 ** d) < 1e-6) return d;
    return 12;
  }

  // One formatter for all the ticks of a linear axis: a shared SI suffix (k, M, ...) from 10^4 up, a shared
  // power of ten below 10^-2, else plain decimals; `step` fixes the decimals.
  function formatter(values, step) {
    const big = Math.max(...values.map(Math.abs));
    let scale = 1, suffix = "";
    if (big >= 1e4) {
      const k = Math.min(Math.floor(Math.log10(big) / 3), SI.length - 1);
      scale = 10 ** (3 * k); suffix = SI[k];
    } else if (big > 0 && big < 1e-2) {
      const e = Math.floor(Math.log10(big));
      scale = 10 ** e; suffix = `e${e}`;
    }
    const d = decimalsOf(+(step / scale).toPrecision(6));
    return v => (v === 0 ? "0" : (v / scale).toFixed(d) + suffix);
  }

  // Tick labels of a log axis, where ticks span decades: each in one notation chosen for the axis, powers of
  // ten ("2e-5", "1e-4") when the smallest is below 10^-2, plain numbers when the largest is below 10^4, else
  // SI prefixes ("500", "1k", "20k").
  function logFormatter(values) {
    const trim = v => String(+v.toPrecision(3));
    if (Math.min(...values.map(Math.abs)) < 1e-2) {
      return v => { const e = Math.floor(Math.log10(v) + 1e-9); return `${trim(v / 10 ** e)}e${e}`; };
    }
    if (Math.max(...values) < 1e4) return trim;
    return v => {
      const k = Math.max(0, Math.min(Math.floor(Math.log10(v) / 3 + 1e-9), SI.length - 1));
      return trim(v / 10 ** (3 * k)) + SI[k];
    };
  }

  // A linear axis over [lo, hi] with about `count` ticks inside it.
  function linearAxis(lo, hi, count, integer) {
    if (!(hi > lo)) { const d = integer ? 0.5 : Math.abs(lo) * 0.1 || 1; lo -= d; hi += d; }
    const inside = step => {
      const out = [];
      for (let t = Math.ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
      return out;
    };
    // a nice step can leave one tick inside [lo, hi]: ask for more ticks until two fit
    let step = niceStep(hi - lo, count, integer), values = inside(step);
    for (let more = count + 1; values.length < 2 && more < 4 * count + 4; more++) {
      step = niceStep(hi - lo, more, integer);
      values = inside(step);
    }
    if (values.length < 2 && !integer) values = [lo, hi];
    const fmt = formatter(values, values.length > 1 ? values[1] - values[0] : step);
    return {lo, hi, values, label: fmt, map: v => v, fmt};
  }

  // A log10 axis over [lo, hi] (positive values): ticks at 1, 2, 5 × 10^k, only 10^k when those are many.
  function logAxis(lo, hi, count) {
    let a = Math.log10(lo), b = Math.log10(hi);
    if (!(b - a > 0.05)) { a -= 0.1; b += 0.1; }
    const pick = mults => {
      const out = [];
      for (let k = Math.floor(a); k <= Math.ceil(b); k++) {
        for (const m of mults) {
          const t = k + Math.log10(m);
          if (t >= a - 1e-9 && t <= b + 1e-9) out.push(+(m * 10 ** k).toPrecision(6));
        }
      }
      return out;
    };
    let values = pick([1, 2, 5]);
    if (values.length > count) values = pick([1]);
    if (values.length < 2) values = pick([1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9]);
    if (values.length < 2) values = [10 ** a, 10 ** b];
    const fmt = logFormatter(values);
    return {lo: a, hi: b, values, label: fmt, map: Math.log10, fmt, log: true};
  }

  // ---------- frame, axes, legend ----------

  // The chart's size from its container: as wide as the container, about 0.6 as high.
  function size(target) {
    const w = Math.max(260, Math.round(target.clientWidth || 560));
    return {W: w, H: Math.round(Math.min(340, Math.max(230, w * 0.58)))};
  }

  // Keeps `draw` to run again when the window's width changes the container's.
  function remember(target, draw) {
    target.classList.add("plot-host");
    target._plotDraw = draw;
    target._plotWidth = target.clientWidth;
  }

  let resizeQueued = false;
  window.addEventListener("resize", () => {
    if (resizeQueued) return;
    resizeQueued = true;
    requestAnimationFrame(() => {
      resizeQueued = false;
      for (const t of document.querySelectorAll(".plot-host")) {
        if (t.clientWidth !== t._plotWidth) t._plotDraw();
      }
    });
  });

  function frame(target, W, H, opts) {
    target.replaceChildren();
    return el("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "plot", role: "img",
                      "aria-label": opts.title || opts.yLabel || ""}, target);
  }

  // Legend entries laid out left to right from x0, wrapping within width w; returns the rows used.
  function legend(svg, entries, x0, y0, w, square) {
    let x = x0, y = y0, rows = entries.length ? 1 : 0;
    const g = el("g", {class: "legend-row"}, svg);
    for (const e of entries) {
      const width = 16 + e.name.length * CHAR_W + 14;
      if (x > x0 && x + width > x0 + w) { x = x0; y += 16; rows++; }
      if (square) el("rect", {x, y: y - 8, width: 9, height: 9, fill: e.color}, g);
      else if (e.dashed) el("line", {x1: x - 2, x2: x + 11, y1: y - 4, y2: y - 4, class: e.cls || "ref"}, g);
      else el("circle", {cx: x + 4, cy: y - 4, r: 4, fill: e.color}, g);
      text(g, {x: x + 14, y, class: "legend"}, e.name);
      x += width;
    }
    return rows;
  }

  function axes(svg, box, xa, ya, opts) {
    const {x0, y0, pw, ph} = box;
    const lin = (a, v, from, len) => from + INSET + (a.map(v) - a.lo) / (a.hi - a.lo) * (len - 2 * INSET);
    const sx = v => lin(xa, v, x0, pw);
    const sy = v => y0 + ph - (lin(ya, v, 0, ph));
    const g = el("g", {class: "axes"}, svg);
    for (const t of ya.values) {
      el("line", {x1: x0, x2: x0 + pw, y1: sy(t), y2: sy(t), class: "grid"}, g);
      text(g, {x: x0 - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick y-tick"}, ya.label(t));
    }
    for (const t of xa.values || []) {
      el("line", {x1: sx(t), x2: sx(t), y1: y0, y2: y0 + ph, class: "grid"}, g);
      text(g, {x: sx(t), y: y0 + ph + 16, "text-anchor": "middle", class: "tick x-tick"}, xa.label(t));
    }
    el("rect", {x: x0, y: y0, width: pw, height: ph, class: "plot-box"}, g);
    text(g, {x: x0 + pw / 2, y: y0 + ph + 36, "text-anchor": "middle", class: "axis-label"}, opts.xLabel || "");
    text(g, {x: 13, y: y0 + ph / 2, "text-anchor": "middle", class: "axis-label",
             transform: `rotate(-90 13 ${y0 + ph / 2})`}, opts.yLabel || "");
    return {sx, sy};
  }

  function pathOf(points, sx, sy) {
    return points.map((p, i) => `${i ? "L" : "M"}${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join("");
  }

  function empty(svg, W, H, message) {
    text(svg, {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, message || "no data yet");
    return svg;
  }

  // ---------- charts ----------

  // series: [{name, color, points: [{x, y, tip, xlo, xhi, ylo, yhi}], line: bool, markers: bool (default true), cls,
  //          radius}]; a point's xlo/xhi and ylo/yhi (optional) are its intervals, drawn as whiskers
  // opts: {xLabel, yLabel, identity: draw y = x, front: [{x, y}] a Pareto front path, zeroY: y from 0,
  //        integerX: whole-number x ticks, logX / logY: log axes (points <= 0 are left out),
  //        guides: [{x} or {y}, label, cls] dashed reference lines (e.g. usable memory) named in the legend,
  //        empty: the text shown without data}
  function xy(target, series, opts) {
    remember(target, () => xy(target, series, opts));
    const {W, H} = size(target);
    const svg = frame(target, W, H, opts);
    const keep = p => isFinite(p.x) && isFinite(p.y) && (!opts.logX || p.x > 0) && (!opts.logY || p.y > 0);
    const shown = series.map((s, i) => ({...s, color: s.color || PALETTE[i % PALETTE.length],
                                         points: s.points.filter(keep)}));
    series.forEach((s, i) => { s.color = shown[i].color; });
    const all = shown.flatMap(s => s.points);
    if (!all.length) return empty(svg, W, H, opts.empty);

    const guides = opts.guides || [];
    const ends = (lo, hi, log) => [lo, hi].filter(v => isFinite(v) && (!log || v > 0));  // a point's interval
    const xsOf = all.flatMap(p => [p.x, ...ends(p.xlo, p.xhi, opts.logX)]).concat(guides.filter(g => "x" in g).map(g => g.x));
    const ysOf = all.flatMap(p => [p.y, ...ends(p.ylo, p.yhi, opts.logY)]).concat(guides.filter(g => "y" in g).map(g => g.y));
    let [xlo, xhi, ylo, yhi] = [Math.min(...xsOf), Math.max(...xsOf), Math.min(...ysOf), Math.max(...ysOf)];
    if (opts.identity) { xlo = ylo = Math.min(xlo, ylo); xhi = yhi = Math.max(xhi, yhi); }
    if (opts.zeroY && !opts.logY) ylo = Math.min(0, ylo);

    const entries = shown.filter(s => s.name && s.points.length).map(s => ({name: s.name, color: s.color}));
    if (opts.identity) entries.push({name: "y = x", dashed: true, cls: "ref"});
    if (opts.front && opts.front.length) entries.push({name: "Pareto front", dashed: true, cls: "front"});
    for (const g of guides) entries.push({name: g.label, dashed: true, cls: "guide " + (g.cls || "")});
    const probe = el("g", {}, svg);
    const rows = legend(probe, entries, M.left, 0, W - M.left - M.right, false);
    probe.remove();
    const top = M.top + rows * 16 + 6;
    const box = {x0: M.left, y0: top, pw: W - M.left - M.right, ph: H - top - M.bottom};
    const xa = opts.logX ? logAxis(xlo, xhi, Math.max(3, box.pw / 50))
                         : linearAxis(xlo, xhi, Math.max(2, Math.round(box.pw / 75)), opts.integerX);
    const ya = opts.identity ? xa : opts.logY ? logAxis(ylo, yhi, Math.max(3, box.ph / 28))
                                              : linearAxis(ylo, yhi, Math.max(3, Math.round(box.ph / 40)));
    legend(svg, entries, M.left, M.top + 10, box.pw, false);
    const {sx, sy} = axes(svg, box, xa, ya, opts);

    if (opts.identity) {
      const raw = v => (xa.log ? 10 ** v : v), lo = raw(xa.lo), hi = raw(xa.hi);
      const ref = el("path", {d: `M${sx(lo)},${sy(lo)}L${sx(hi)},${sy(hi)}`, class: "ref"}, svg);
      el("title", {}, ref).textContent = "y = x (prediction equals measurement)";
    }
    for (const g of guides) {  // named in the legend: a label beside the line would cover points
      const line = "x" in g ? {x1: sx(g.x), x2: sx(g.x), y1: box.y0, y2: box.y0 + box.ph}
                            : {x1: box.x0, x2: box.x0 + box.pw, y1: sy(g.y), y2: sy(g.y)};
      el("title", {}, el("line", {...line, class: "guide " + (g.cls || "")}, svg)).textContent = g.label;
    }
    if (opts.front && opts.front.length) {
      const f = el("path", {d: pathOf(opts.front.filter(keep), sx, sy), class: "front"}, svg);
      el("title", {}, f).textContent = "Pareto front: no other layout is both faster and smaller";
    }
    shown.forEach(s => {
      const g = el("g", {class: "series-group", "data-series": s.name || ""}, svg);
      if (s.line && s.points.length > 1) el("path", {d: pathOf(s.points, sx, sy),
                                                     class: "series", stroke: s.color}, g);
      if (s.markers === false || (s.line && s.points.length > MAX_MARKERS)) return;
      const r = s.radius || (s.points.length > 60 ? 3 : 4);
      for (const p of s.points) {  // intervals first, under the markers
        if (isFinite(p.ylo) && isFinite(p.yhi)) el("line", {x1: sx(p.x), x2: sx(p.x), y1: sy(p.ylo), y2: sy(p.yhi),
                                                          stroke: s.color, class: "interval"}, g);
        if (isFinite(p.xlo) && isFinite(p.xhi)) el("line", {x1: sx(p.xlo), x2: sx(p.xhi), y1: sy(p.y), y2: sy(p.y),
                                                          stroke: s.color, class: "interval"}, g);
      }
      for (const p of s.points) {
        const c = el("circle", {cx: sx(p.x), cy: sy(p.y), r, fill: s.color, class: "pt" + (s.cls ? " " + s.cls : "")}, g);
        if (p.tip) { c.dataset.tip = p.tip; el("title", {}, c).textContent = p.tip; }
      }
    });
    return svg;
  }

  // bars: [{label, parts: {term: value}}]; the same term gets the same colour in every bar (and in every
  // chart drawn with the same `terms` order). opts: {yLabel, fmt: value -> text, terms: order of terms}
  function stacked(target, bars, opts) {
    remember(target, () => stacked(target, bars, opts));
    const {W, H} = size(target);
    const svg = frame(target, W, H, opts);
    if (!bars.length) return empty(svg, W, H, opts.empty);
    const terms = opts.terms || [...new Set(bars.flatMap(b => Object.keys(b.parts)))];
    const color = t => PALETTE[terms.indexOf(t) % PALETTE.length];
    const present = terms.filter(t => bars.some(b => (b.parts[t] || 0) > 0));
    const probe = el("g", {}, svg);
    const rows = legend(probe, present.map(t => ({name: t})), M.left, 0, W - M.left - M.right, true);
    probe.remove();
    const bottom = M.bottom + rows * 16 + 4;
    const box = {x0: M.left, y0: M.top + 6, pw: W - M.left - M.right, ph: H + rows * 16 - M.top - 6 - bottom};
    svg.setAttribute("viewBox", `0 0 ${W} ${H + rows * 16}`);
    svg.setAttribute("height", H + rows * 16);
    const totals = bars.map(b => Object.values(b.parts).reduce((a, v) => a + Math.max(v, 0), 0));
    const ya = linearAxis(0, Math.max(...totals, 0) || 1, Math.max(2, Math.round(box.ph / 45)));
    ya.lo = 0;
    const sy = v => box.y0 + box.ph - (v - ya.lo) / (ya.hi - ya.lo) * (box.ph - INSET);
    const g0 = el("g", {class: "axes"}, svg);
    for (const t of ya.values) {
      el("line", {x1: box.x0, x2: box.x0 + box.pw, y1: sy(t), y2: sy(t), class: "grid"}, g0);
      text(g0, {x: box.x0 - 6, y: sy(t) + 4, "text-anchor": "end", class: "tick y-tick"}, ya.label(t));
    }
    el("rect", {x: box.x0, y: box.y0, width: box.pw, height: box.ph, class: "plot-box"}, g0);
    text(g0, {x: 13, y: box.y0 + box.ph / 2, "text-anchor": "middle", class: "axis-label",
              transform: `rotate(-90 13 ${box.y0 + box.ph / 2})`}, opts.yLabel || "");
    const slot = box.pw / bars.length, bw = Math.min(90, slot * 0.55);
    bars.forEach(b => {
      const x = box.x0 + slot * bars.indexOf(b) + (slot - bw) / 2;
      let acc = 0;
      const g = el("g", {class: "bar", "data-bar": b.label}, svg);
      for (const t of terms) {
        const v = b.parts[t] || 0;
        if (v <= 0) continue;
        const r = el("rect", {x, y: sy(acc + v), width: bw, height: Math.max(sy(acc) - sy(acc + v), 0.5),
                              fill: color(t), class: "seg", "data-term": t}, g);
        const tip = `${b.label}: ${t} ${opts.fmt ? opts.fmt(v) : v}`;
        r.dataset.tip = tip;
        el("title", {}, r).textContent = tip;
        acc += v;
      }
      text(g, {x: x + bw / 2, y: box.y0 + box.ph + 16, "text-anchor": "middle", class: "tick"}, b.label);
    });
    legend(svg, present.map(t => ({name: t, color: color(t)})), M.left, box.y0 + box.ph + 38, box.pw, true);
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

  return {xy, stacked, paretoFront, PALETTE, linearAxis, logAxis};
})();
