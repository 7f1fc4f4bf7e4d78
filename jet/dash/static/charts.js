// Hand-drawn SVG charts for the Jet dashboard: line charts (with optional bands) and interval plots.
// No library: the pages work offline and ship nothing but this package's own files.
"use strict";

const JetChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 600, H = 190, L = 52, R = 10, T = 10, B = 24;
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

  function el(tag, attrs, parent) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function fmt(v) {
    if (!isFinite(v)) return "";
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(1);
    return (+v.toPrecision(3)).toString();
  }

  // Keep the shape of long series: per bucket of indices, its first, min and max points.
  function thin(points, max) {
    if (points.length <= max) return points;
    const out = [], per = Math.ceil(points.length / (max / 3));
    for (let i = 0; i < points.length; i += per) {
      const chunk = points.slice(i, i + per);
      let lo = chunk[0], hi = chunk[0];
      for (const p of chunk) { if (p[1] < lo[1]) lo = p; if (p[1] > hi[1]) hi = p; }
      out.push(chunk[0], ...(lo[0] <= hi[0] ? [lo, hi] : [hi, lo]));
    }
    out.push(points[points.length - 1]);
    return out;
  }

  function extent(values) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; } }
    if (lo === Infinity) return [0, 1];
    if (lo === hi) { const d = Math.abs(lo) * 0.1 || 1; return [lo - d, hi + d]; }
    const pad = (hi - lo) * 0.05;
    return [lo - pad, hi + pad];
  }

  function axes(svg, xr, yr) {
    el("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#cbd2db"}, svg);
    el("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#cbd2db"}, svg);
    for (let i = 0; i <= 4; i++) {
      const y = T + (H - T - B) * i / 4, v = yr[1] - (yr[1] - yr[0]) * i / 4;
      el("line", {x1: L, y1: y, x2: W - R, y2: y, stroke: "#eef0f3"}, svg);
      el("text", {x: L - 4, y: y + 3, "text-anchor": "end", class: "axis"}, svg).textContent = fmt(v);
    }
    for (let i = 0; i <= 4; i++) {
      const x = L + (W - L - R) * i / 4, v = xr[0] + (xr[1] - xr[0]) * i / 4;
      el("text", {x: x, y: H - 8, "text-anchor": "middle", class: "axis"}, svg).textContent = fmt(v);
    }
  }

  // opts: {title, series: [{name, points: [[x, y], ...]}], bands: [{name, points: [[x, lo, hi], ...]}]}
  function line(opts) {
    const box = document.createElement("div");
    box.className = "chart";
    const series = (opts.series || []).filter(s => s.points && s.points.length);
    const bands = (opts.bands || []).filter(b => b.points && b.points.length);
    const total = series.reduce((n, s) => n + s.points.length, 0);
    box.dataset.points = String(total);
    box.dataset.title = opts.title;
    const title = document.createElement("div");
    title.className = "title";
    title.textContent = opts.title;
    box.appendChild(title);
    const svg = el("svg", {viewBox: `0 0 ${W} ${H}`}, box);
    if (!series.length) {
      el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "axis"}, svg).textContent = "no data yet";
      return box;
    }
    const xs = [], ys = [];
    for (const s of series) for (const p of s.points) { xs.push(p[0]); ys.push(p[1]); }
    for (const b of bands) for (const p of b.points) { xs.push(p[0]); ys.push(p[1], p[2]); }
    const xr = [Math.min(...xs), Math.max(...xs)], yr = extent(ys);
    if (xr[0] === xr[1]) xr[1] = xr[0] + 1;
    const sx = x => L + (x - xr[0]) / (xr[1] - xr[0]) * (W - L - R);
    const sy = y => H - B - (y - yr[0]) / (yr[1] - yr[0]) * (H - T - B);
    axes(svg, xr, yr);
    bands.forEach((b, i) => {
      const c = COLORS[(b.color ?? i) % COLORS.length];
      const up = b.points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[2]).toFixed(1)}`);
      const down = b.points.slice().reverse().map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`);
      el("polygon", {points: up.concat(down).join(" "), fill: c, "fill-opacity": 0.15, stroke: "none"}, svg);
    });
    const legend = document.createElement("div");
    legend.className = "legend";
    series.forEach((s, i) => {
      const c = COLORS[(s.color ?? i) % COLORS.length];
      const pts = thin(s.points, 1500).map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      el("polyline", {points: pts, fill: "none", stroke: c, "stroke-width": 1.6, "data-name": s.name}, svg);
      if (s.points.length === 1) el("circle", {cx: sx(s.points[0][0]), cy: sy(s.points[0][1]), r: 2.5, fill: c}, svg);
      const last = s.points[s.points.length - 1];
      const key = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = c;
      key.appendChild(swatch);
      key.appendChild(document.createTextNode(`${s.name} ${fmt(last[1])}`));
      legend.appendChild(key);
    });
    box.appendChild(legend);
    return box;
  }

  // opts: {title, items: [{label, mean, lo, hi, n}]}: one point with a 95% interval per item.
  function intervals(opts) {
    const box = document.createElement("div");
    box.className = "chart";
    const title = document.createElement("div");
    title.className = "title";
    title.textContent = opts.title;
    box.appendChild(title);
    const items = opts.items || [];
    const h = Math.max(60, 26 * items.length + 30);
    const svg = el("svg", {viewBox: `0 0 ${W} ${h}`, preserveAspectRatio: "xMinYMin meet",
                           style: `height:${h}px; max-width:${W * 1.6}px`}, box);
    const xr = extent(items.flatMap(it => [it.lo, it.hi, it.mean]));
    const left = 150, sx = x => left + (x - xr[0]) / (xr[1] - xr[0]) * (W - left - R);
    items.forEach((it, i) => {
      const y = 18 + i * 26, c = COLORS[i % COLORS.length];
      el("text", {x: left - 6, y: y + 4, "text-anchor": "end", class: "axis"}, svg).textContent =
        `${it.label} (n=${it.n})`;
      el("line", {x1: sx(it.lo), y1: y, x2: sx(it.hi), y2: y, stroke: c, "stroke-width": 2}, svg);
      el("circle", {cx: sx(it.mean), cy: y, r: 4, fill: c}, svg);
    });
    for (let i = 0; i <= 4; i++) {
      const v = xr[0] + (xr[1] - xr[0]) * i / 4;
      el("text", {x: sx(v), y: h - 4, "text-anchor": "middle", class: "axis"}, svg).textContent = fmt(v);
    }
    return box;
  }

  return {line, intervals, fmt, COLORS};
})();
