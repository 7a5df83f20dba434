// Live decoding view: start a decoding on the server, step or play it, show each step's verification.
"use strict";
let session = null, done = true, playing = false;
const $ = id => document.getElementById(id);

async function init() {
  const info = await api("/api/info");
  $("target").textContent = "target: " + info.target;
  for (const name of info.drafters) $("drafter").append(el("option", { value: name }, name));
  $("k").value = info.defaults.k; $("temperature").value = info.defaults.temperature;
  $("seed").value = info.defaults.seed; $("max-new-tokens").value = info.defaults.max_new_tokens;
  $("tree-top-k").value = info.defaults.tree_top_k;
  for (const name of info.tree.children) $("tree-children").append(el("option", { value: name }, name.replace(/_/g, " ")));
  $("tree-children").value = info.defaults.tree_children;
  $("tree-mode").onchange = treeControls; treeControls();
  $("constraint-kind").onchange = () => {
    const kind = $("constraint-kind").value;
    $("constraint-source").disabled = kind === "" || kind === "json_object";
  };
}

// The request's structured-output constraint: null for none; the server checks it (a bad schema answers 400).
function constraintRequest() {
  const kind = $("constraint-kind").value;
  return kind ? { kind, source: kind === "json_object" ? "" : $("constraint-source").value } : null;
}

// Only the tree inputs of the chosen mode are enabled: a shape, or a budget (depth K) with its top-k.
function treeControls() {
  const mode = $("tree-mode").value;
  $("tree-shape").disabled = mode !== "shape";
  $("tree-budget").disabled = $("tree-top-k").disabled = mode !== "budget";
  $("tree-children").disabled = mode === "none";
}

// The request's tree: null for a chain; the server validates the rest (a bad shape answers 400).
function treeRequest() {
  const mode = $("tree-mode").value;
  if (mode === "none") return null;
  const tree = { children: $("tree-children").value };
  if (mode === "shape") tree.shape = $("tree-shape").value;
  else { tree.budget = Number($("tree-budget").value); tree.top_k = Number($("tree-top-k").value); }
  return tree;
}

async function start() {
  showError("error"); playing = false; $("play").textContent = "play";
  try {
    const r = await api("/api/live/start", { prompt: $("prompt").value, drafter: $("drafter").value, k: Number($("k").value),
      temperature: Number($("temperature").value), seed: Number($("seed").value), max_new_tokens: Number($("max-new-tokens").value),
      tree: treeRequest(), constraint: constraintRequest() });
    session = r.session; done = false;
    $("output").replaceChildren(el("span", { class: "prompt" }, r.prompt_text));
    $("steps").replaceChildren(); $("bars").replaceChildren(); $("detail-title").textContent = "click a draft, tree node, recovered or bonus token";
    setCounters({ target_calls: 0, new_tokens: 0, acceptance_rate: null, tokens_per_target_call: null });
    $("status").textContent = "ready"; $("step").disabled = $("play").disabled = false;
  } catch (err) { showError("error", err); }
}

async function step() {
  if (done || session === null) return;
  try {
    const r = await api("/api/live/step", { session });
    if (r.record) showStep(r.record);
    done = r.done;
  } catch (err) { showError("error", err); done = true; }
  if (done) { $("status").textContent = "finished"; $("step").disabled = $("play").disabled = true; playing = false; $("play").textContent = "play"; }
}

async function play() {
  playing = !playing; $("play").textContent = playing ? "pause" : "play";
  while (playing && !done) { await step(); await new Promise(res => setTimeout(res, 300)); }
}

function setCounters(c) {
  $("target-calls").textContent = c.target_calls; $("new-tokens").textContent = c.new_tokens;
  $("acceptance-rate").textContent = c.acceptance_rate === null ? "-" : (100 * c.acceptance_rate).toFixed(1) + "%";
  $("tokens-per-call").textContent = c.tokens_per_target_call === null ? "-" : fmt(c.tokens_per_target_call, 2);
  // tokens per target call against 1.0 for plain decoding
  const bar = $("tpc-bar"), scale = 160 / Math.max(2, (c.tokens_per_target_call || 0) + 0.5);
  bar.replaceChildren(svgEl("rect", { x: 0, y: 3, width: scale * (c.tokens_per_target_call || 0), height: 12, fill: "#3b6fd4" }),
    svgEl("line", { x1: scale, x2: scale, y1: 0, y2: 18, stroke: "#000", "stroke-width": 2 }),
    svgEl("text", { x: scale + 3, y: 25 }, "1.0 = plain"));
}

function showStep(rec) {
  for (const [text, kind] of rec.pieces) $("output").append(el("span", { class: "k-" + kind }, text));
  setCounters(rec.counters);
  $("status").textContent = rec.finish_reason ? "finished (" + rec.finish_reason + ")" : "running";
  if (rec.tree) { showTreeStep(rec); return; }
  const row = el("div", { class: "step", "data-step": rec.step });
  row.append(el("span", { class: "n" }, "step " + rec.step));
  rec.drafts.forEach((d, i) => {
    const chip = el("div", { class: "chip draft " + d.verdict, "data-verdict": d.verdict, "data-pos": i,
      title: `p=${fmt(d.p, 4)} q=${fmt(d.q, 4)}` });
    chip.append(el("span", { class: "tok" }, visible(d.text)),
      el("small", { class: "accept" }, "min(1,p/q) " + fmt(d.accept_probability)),
      el("small", { class: "uniform" }, "u " + fmt(d.uniform)),
      el("small", { class: "verdict" }, d.verdict));
    chip.onclick = () => showDetail(rec, i, chip);
    row.append(chip);
  });
  const kind = rec.bonus ? "bonus" : "recovered";
  const fin = el("div", { class: "chip final " + kind, "data-kind": kind });
  fin.append(el("span", { class: "tok" }, visible(rec.token_text)), el("small", {}, kind));
  fin.onclick = () => showDetail(rec, rec.num_accepted, fin);
  row.append(fin);
  $("steps").append(row); $("steps").scrollTop = $("steps").scrollHeight;
}

// A tree step: rows by depth; in each row the children of one parent form a group, in the order the
// walk tries them. Nodes are coloured by verdict (accepted path green, rejected red, not tried grey).
function showTreeStep(rec) {
  const tree = rec.tree, nodes = tree.nodes;
  const row = el("div", { class: "step tree-step", "data-step": rec.step });
  const head = el("div", { class: "tree-head" });
  head.append(el("span", { class: "n" }, "step " + rec.step),
    el("span", { class: "muted" }, `tree: ${tree.size} nodes, depth ${tree.depth}, ${tree.siblings.replace(/_/g, " ")} children; path: `));
  const path = el("span", { class: "path" });
  path.textContent = tree.path.map(i => visible(nodes[i].text)).join(" \u2192 ") || "(none accepted)";
  head.append(path);
  row.append(head);
  const box = el("div", { class: "tree" });
  for (let depth = 1; depth <= tree.depth; depth++) {
    const level = el("div", { class: "depth-row", "data-depth": depth });
    const families = el("div", { class: "families" });
    const parents = [...new Set(nodes.filter(n => n.depth === depth).map(n => n.parent))];
    for (const parent of parents) {
      const family = el("div", { class: "family", "data-parent": parent });
      family.append(el("small", { class: "after" }, parent < 0 ? "after the root" : `after #${parent} ${visible(nodes[parent].text)}`));
      for (const n of nodes.filter(m => m.parent === parent)) family.append(nodeChip(rec, n));
      families.append(family);
    }
    level.append(el("span", { class: "n" }, "depth " + depth), families);
    box.append(level);
  }
  row.append(box);
  const kind = rec.bonus ? "bonus" : "recovered";
  const fin = el("div", { class: "chip final " + kind, "data-kind": kind });
  fin.append(el("span", { class: "tok" }, visible(rec.token_text)), el("small", {}, kind));
  fin.onclick = () => showTreeFinal(rec, fin);
  const end = el("div", { class: "tree-end" });
  end.append(el("span", { class: "muted" }, tree.final.node < 0 ? "at the root: " : `after #${tree.final.node}: `), fin);
  row.append(end);
  $("steps").append(row); $("steps").scrollTop = $("steps").scrollHeight;
}

function nodeChip(rec, n) {
  const cls = n.verdict === "not tried" ? "untried" : n.verdict;
  const chip = el("div", { class: "chip node " + cls, "data-node": n.node, "data-verdict": n.verdict,
    title: n.p === null ? "not tried" : `p=${fmt(n.p, 4)} q=${fmt(n.q, 4)}` });
  chip.append(el("span", { class: "tok" }, visible(n.text)), el("small", { class: "id" }, "#" + n.node));
  if (n.verdict !== "not tried")
    chip.append(el("small", { class: "accept" }, "min(1,p/q) " + fmt(n.accept_probability)),
      el("small", { class: "uniform" }, "u " + fmt(n.uniform)));
  chip.append(el("small", { class: "verdict" }, n.verdict));
  chip.onclick = () => showNode(rec, n, chip);
  return chip;
}

function select(chip) {
  document.querySelectorAll(".chip.selected").forEach(c => c.classList.remove("selected"));
  chip.classList.add("selected");
}

// A tree node's p and q: the pair it was checked against (the target at its parent, or the residual
// left by the siblings rejected before it).
function showNode(rec, n, chip) {
  select(chip);
  const nodes = rec.tree.nodes;
  const where = `step ${rec.step}, node #${n.node} ${JSON.stringify(n.text)} at depth ${n.depth}`;
  if (n.verdict === "not tried") {
    $("detail-title").textContent = where + ": not tried (its parent was not accepted, or a sibling before it was)";
    $("bars").replaceChildren(); $("bars").setAttribute("height", 40);
    return;
  }
  const before = nodes.filter(m => m.parent === n.parent && m.try !== null && m.try < n.try).map(m => JSON.stringify(m.text));
  const against = before.length ? `checked against the residual p after rejecting ${before.join(", ")}`
      + (rec.tree.siblings === "without_replacement" ? " (and q without them)" : "")
    : `checked against the target's p ${n.parent < 0 ? "at the root" : "after #" + n.parent}`;
  $("detail-title").textContent = `${where}: ${n.verdict} (check ${n.try + 1} of the walk), ${against}; `
    + `P(accept here) = sum min(p, q) = ${fmt(n.position.acceptance_mass)}`;
  const last = !rec.bonus && n.try === Math.max(...nodes.map(m => m.try === null ? -1 : m.try));
  drawBars(n.position, { draft: n.token, final: last ? rec.token : null, kind: "recovered" });
}

function showTreeFinal(rec, chip) {
  select(chip);
  const f = rec.tree.final;
  $("detail-title").textContent = `step ${rec.step}: ` + (rec.bonus
    ? (rec.tree.size ? "bonus token: the path ends at a leaf, sampled from p there" : "nothing was drafted: sampled from p")
    : `recovered token: every child ${f.node < 0 ? "of the root" : "of #" + f.node} was rejected, sampled from the residual r of the last pair`);
  const tried = rec.tree.nodes.filter(n => n.try !== null).sort((a, b) => a.try - b.try);
  const rejected = rec.bonus ? null : tried[tried.length - 1].token;  // the pair the residual comes from
  drawBars(f.position, { draft: rejected, final: rec.token, kind: rec.bonus ? "bonus" : "recovered" });
}

// p and q bars over the top candidates at one position of one step.
function showDetail(rec, pos, chip) {
  select(chip);
  const position = rec.positions[pos], isBonus = pos === rec.drafts.length;
  const d = rec.drafts[pos];
  $("detail-title").textContent = `step ${rec.step}, position ${pos + 1}: ` + (isBonus ? "bonus position (all drafts accepted): sampled from p"
    : `draft ${JSON.stringify(d.text)} ${d.verdict}; P(accept here) = sum min(p, q) = ${fmt(position.acceptance_mass)}`);
  drawBars(position, { draft: isBonus ? null : d.token, final: pos === rec.num_accepted ? rec.token : null,
    kind: rec.bonus ? "bonus" : "recovered" });
}

// Bars of one position: p over q per candidate (no q where nothing was drafted: acceptance_mass null).
// mark.draft: the token drafted here; mark.final: the recovered / bonus token drawn here (mark.kind).
function drawBars(position, mark) {
  const isBonus = position.acceptance_mass === null;
  const cands = position.candidates, rowH = 30, left = 90, width = 380;
  const scale = width / Math.max(...cands.map(c => Math.max(c.p, c.q)), 1e-9);
  const svg = $("bars"); svg.replaceChildren(); svg.setAttribute("height", cands.length * rowH + 20);
  svg.append(svgEl("text", { x: left, y: 11, fill: "#555" }, isBonus ? "p (target)" : "upper bar p (target), lower bar q (draft); r = residual"));
  cands.forEach((c, i) => {
    const y = 16 + i * rowH, g = svgEl("g", { class: "cand", "data-token": c.token, "data-p": c.p, "data-q": c.q });
    const label = (!isBonus && c.token === mark.draft) ? " \u25c0 draft" : (c.token === mark.final ? " \u25c0 " + mark.kind : "");
    g.append(svgEl("text", { x: 0, y: y + 14 }, visible(c.text).slice(0, 12)));
    g.append(svgEl("rect", { x: left, y: y, width: c.overlap * scale, height: 11, fill: "var(--overlap)" }));
    g.append(svgEl("rect", { x: left + c.overlap * scale, y: y, width: (c.p - c.overlap) * scale, height: 11, fill: isBonus ? "var(--p)" : "var(--residual)" }));
    g.append(svgEl("rect", { x: left, y: y, width: c.p * scale, height: 11, fill: "none", stroke: "var(--p)" }));
    if (!isBonus) {
      g.append(svgEl("rect", { x: left, y: y + 12, width: c.overlap * scale, height: 11, fill: "var(--overlap)", opacity: 0.6 }));
      g.append(svgEl("rect", { x: left + c.overlap * scale, y: y + 12, width: c.draft_excess * scale, height: 11, fill: "var(--excess)" }));
      g.append(svgEl("rect", { x: left, y: y + 12, width: c.q * scale, height: 11, fill: "none", stroke: "var(--q)" }));
    }
    const nums = isBonus ? `p ${fmt(c.p)}` : `p ${fmt(c.p)}  q ${fmt(c.q)}  r ${fmt(c.residual)}`;
    g.append(svgEl("text", { class: "nums", x: left + width + 6, y: y + 10 }, nums));
    g.append(svgEl("text", { x: left + width + 6, y: y + 22, fill: "#333", "font-weight": 700 }, label));
    svg.append(g);
  });
}

$("start").onclick = start; $("step").onclick = step; $("play").onclick = play;
init().catch(err => showError("error", err));
