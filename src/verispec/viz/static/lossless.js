// Losslessness demo: editable p and q; chunks of speculative samples from the server; histogram and chi-square.
"use strict";
const $ = id => document.getElementById(id);
let state = null, chunkIndex = 0, running = false;
const START_P = [0.4, 0.3, 0.15, 0.1, 0.05], START_Q = [0.1, 0.2, 0.3, 0.2, 0.2];

function buildTable(p, q) {
  const body = $("dists").tBodies[0]; body.replaceChildren();
  const head = el("tr"); head.append(el("th", {}, "token"));
  p.forEach((_, i) => head.append(el("th", {}, "t" + i)));
  body.append(head);
  for (const [name, values] of [["p", p], ["q", q]]) {
    const row = el("tr"); row.append(el("th", {}, name + " (" + (name === "p" ? "target" : "draft") + ")"));
    values.forEach((v, i) => { const td = el("td"); td.append(el("input", { type: "number", min: 0, step: 0.05, value: v, id: `${name}${i}`, class: name })); row.append(td); });
    body.append(row);
  }
  body.querySelectorAll("input").forEach(inp => inp.onchange = reset);
}

function read(name) { return [...document.querySelectorAll("input." + name)].map(i => Number(i.value)); }

function reset() { state = null; chunkIndex = 0; running = false; showError("error"); draw(null); for (const id of ["samples"]) $(id).textContent = "0";
  for (const id of ["acceptance-theory", "acceptance-empirical", "chi-square", "p-value", "tv"]) $(id).textContent = "-"; }

async function sampleChunk() {
  try {
    const seed = Number($("seed").value) + chunkIndex;
    const r = await api("/api/lossless", { p: read("p"), q: read("q"), samples: Number($("chunk").value), seed,
      counts: state ? state.counts : null, accepted: state ? state.accepted : 0 });
    chunkIndex += 1; state = r; show(r);
  } catch (err) { showError("error", err); running = false; }
}

async function runToTotal() {
  running = true;
  while (running && (!state || state.samples < Number($("total").value))) await sampleChunk();
  running = false;
}

function show(r) {
  $("samples").textContent = r.samples;
  $("acceptance-theory").textContent = fmt(r.acceptance_theory, 4);
  $("acceptance-empirical").textContent = fmt(r.acceptance_empirical, 4);
  $("chi-square").textContent = `${fmt(r.chi_square.statistic, 2)} (${r.chi_square.dof})`;
  $("p-value").textContent = fmt(r.chi_square.p_value, 4);
  $("tv").textContent = fmt(r.chi_square.tv_distance, 4);
  draw(r);
}

function draw(r) {
  const svg = $("histogram"); svg.replaceChildren();
  const p = r ? r.p : normalize(read("p")), q = r ? r.q : normalize(read("q"));
  const freq = r ? r.counts.map(c => c / r.samples) : p.map(() => 0);
  const W = 760, H = 300, left = 40, bottom = 30, top = 10, n = p.length, slot = (W - left - 10) / n;
  const ymax = Math.max(...p, ...q, ...freq) * 1.1 || 1, y = v => H - bottom - (H - bottom - top) * v / ymax;
  svg.append(svgEl("line", { x1: left, x2: W, y1: H - bottom, y2: H - bottom, stroke: "#444" }));
  for (let t = 0; t <= 4; t++) { const v = ymax * t / 4;
    svg.append(svgEl("text", { x: 2, y: y(v) + 4 }, v.toFixed(2)), svgEl("line", { x1: left, x2: W, y1: y(v), y2: y(v), stroke: "#eee" })); }
  for (let i = 0; i < n; i++) {
    const x = left + i * slot;
    svg.append(svgEl("rect", { class: "freq", "data-token": i, "data-frequency": freq[i], x: x + slot * 0.15, y: y(freq[i]), width: slot * 0.7, height: H - bottom - y(freq[i]), fill: "#9ab" }));
    svg.append(svgEl("line", { x1: x + slot * 0.1, x2: x + slot * 0.9, y1: y(p[i]), y2: y(p[i]), stroke: "var(--p)", "stroke-width": 3 }));
    svg.append(svgEl("line", { x1: x + slot * 0.1, x2: x + slot * 0.9, y1: y(q[i]), y2: y(q[i]), stroke: "var(--q)", "stroke-width": 2, "stroke-dasharray": "5 3" }));
    svg.append(svgEl("text", { x: x + slot / 2 - 6, y: H - 10 }, "t" + i));
  }
}

function normalize(w) { const s = w.reduce((a, b) => a + b, 0) || 1; return w.map(v => v / s); }

$("add").onclick = () => { const p = read("p"), q = read("q"); if (p.length < 32) { p.push(0.1); q.push(0.1); } buildTable(p, q); reset(); };
$("remove").onclick = () => { const p = read("p"), q = read("q"); if (p.length > 2) { p.pop(); q.pop(); } buildTable(p, q); reset(); };
$("sample").onclick = sampleChunk; $("run").onclick = runToTotal; $("reset").onclick = reset;
buildTable(START_P, START_Q); reset();
