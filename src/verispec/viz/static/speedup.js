// Speedup calculator: the table and plot from verispec.analyze on the server; measured mode from a bench JSON.
"use strict";
const $ = id => document.getElementById(id);
const COLORS = ["#3b6fd4", "#e07b24", "#1a9850", "#d73027", "#7b3fb8", "#0aa2b5", "#8c564b", "#e377c2"];
let benchReport = null;

async function init() {
  const info = await api("/api/info");
  $("alphas").value = info.analyze.alphas.join(", "); $("k-max").value = info.analyze.k_max; $("c").value = info.analyze.c;
  await compute();
}

async function compute() {
  showError("error");
  try {
    const query = new URLSearchParams({ alphas: $("alphas").value, k_max: $("k-max").value, c: $("c").value });
    const table = await api("/api/speedup?" + query);
    drawTable(table); drawPlot(table);
  } catch (err) { showError("error", err); }
}

function drawTable(t) {
  const table = $("table"); table.replaceChildren();
  const head = el("tr"); head.append(el("th", {}, "\u03b1"));
  t.ks.forEach(k => head.append(el("th", {}, "K=" + k))); head.append(el("th", {}, "best K"));
  table.append(head);
  t.rows.forEach(r => {
    const tr = el("tr", { "data-alpha": r.alpha }); tr.append(el("th", {}, String(r.alpha)));
    t.ks.forEach((k, i) => {
      const td = el("td", { class: k === r.best_k ? "best" : "", "data-k": k });
      td.append(el("span", { class: "speedup" }, fmt(r.speedup[i], 3)), el("br"), el("small", { class: "tokens muted" }, fmt(r.tokens[i], 3)));
      tr.append(td);
    });
    tr.append(el("td", { class: "best-k" }, r.best_k ? String(r.best_k) : "0 (off)"));
    table.append(tr);
  });
}

function drawPlot(t) {
  const svg = $("plot"); svg.replaceChildren();
  const W = 760, H = 340, left = 50, right = 130, top = 15, bottom = 40;
  const ymax = Math.max(1.2, ...t.rows.flatMap(r => r.speedup)) * 1.05, ymin = 0;
  const x = k => left + (W - left - right) * (t.ks.length === 1 ? 0.5 : (k - 1) / (t.ks.length - 1));
  const y = v => H - bottom - (H - bottom - top) * (v - ymin) / (ymax - ymin);
  for (let i = 0; i <= 5; i++) { const v = ymin + (ymax - ymin) * i / 5;
    svg.append(svgEl("line", { x1: left, x2: W - right, y1: y(v), y2: y(v), stroke: "#eee" }), svgEl("text", { x: 8, y: y(v) + 4 }, v.toFixed(2))); }
  svg.append(svgEl("line", { x1: left, x2: W - right, y1: y(1), y2: y(1), stroke: "#000", "stroke-dasharray": "4 3" }),
    svgEl("text", { x: left + 4, y: y(1) - 4 }, "plain decoding = 1"));
  t.ks.forEach(k => svg.append(svgEl("text", { x: x(k) - 4, y: H - bottom + 16 }, String(k))));
  svg.append(svgEl("text", { x: (W - right) / 2, y: H - 6 }, "K (draft tokens per step)"));
  t.rows.forEach((r, j) => {
    const color = COLORS[j % COLORS.length];
    svg.append(svgEl("polyline", { points: t.ks.map((k, i) => `${x(k)},${y(r.speedup[i])}`).join(" "), fill: "none", stroke: color, "stroke-width": 2 }));
    if (r.best_k > 0) svg.append(svgEl("text", { class: "best-mark", "data-alpha": r.alpha, "data-k": r.best_k, x: x(r.best_k) - 8, y: y(r.speedup[r.best_k - 1]) + 7, fill: color, style: "font-size: 22px" }, "\u2605"));
    svg.append(svgEl("text", { x: W - right + 10, y: top + 14 + 16 * j, fill: color }, `\u03b1 = ${r.alpha}` + (r.best_k ? `, best K ${r.best_k}` : ", off")));
  });
}

async function measure() {
  showError("error");
  try {
    const system = $("system").value;
    const m = await api("/api/speedup/bench" + (system ? "?system=" + encodeURIComponent(system) : ""), benchReport);
    const select = $("system"), keep = select.value; select.replaceChildren(el("option", { value: "" }, "(default)"));
    m.systems.forEach(s => select.append(el("option", { value: s }, s))); select.value = keep;
    $("alphas").value = String(Number(m.alpha.toPrecision(12))); $("c").value = String(Number(m.c.toPrecision(12)));
    $("measured").textContent = `measured (${m.system}): alpha = ${m.alpha.toFixed(4)}, c = ${m.c.toFixed(4)}`;
    await compute();
  } catch (err) { showError("error", err); }
}

$("bench").onchange = async () => {
  const file = $("bench").files[0]; if (!file) return;
  try { benchReport = JSON.parse(await file.text()); } catch (err) { showError("error", "not JSON: " + err.message); return; }
  await measure();
};
$("system").onchange = () => { if (benchReport) measure(); };
$("compute").onclick = compute;
init().catch(err => showError("error", err));
