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
}

async function start() {
  showError("error"); playing = false; $("play").textContent = "play";
  try {
    const r = await api("/api/live/start", { prompt: $("prompt").value, drafter: $("drafter").value, k: Number($("k").value),
      temperature: Number($("temperature").value), seed: Number($("seed").value), max_new_tokens: Number($("max-new-tokens").value) });
    session = r.session; done = false;
    $("output").replaceChildren(el("span", { class: "prompt" }, r.prompt_text));
    $("steps").replaceChildren(); $("bars").replaceChildren(); $("detail-title").textContent = "click a draft, recovered or bonus token";
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

// p and q bars over the top candidates at one position of one step.
function showDetail(rec, pos, chip) {
  document.querySelectorAll(".chip.selected").forEach(c => c.classList.remove("selected"));
  chip.classList.add("selected");
  const position = rec.positions[pos], isBonus = pos === rec.drafts.length;
  const d = rec.drafts[pos];
  $("detail-title").textContent = `step ${rec.step}, position ${pos + 1}: ` + (isBonus ? "bonus position (all drafts accepted): sampled from p"
    : `draft ${JSON.stringify(d.text)} ${d.verdict}; P(accept here) = sum min(p, q) = ${fmt(position.acceptance_mass)}`);
  const cands = position.candidates, rowH = 30, left = 90, width = 380;
  const scale = width / Math.max(...cands.map(c => Math.max(c.p, c.q)), 1e-9);
  const svg = $("bars"); svg.replaceChildren(); svg.setAttribute("height", cands.length * rowH + 20);
  svg.append(svgEl("text", { x: left, y: 11, fill: "#555" }, isBonus ? "p (target)" : "upper bar p (target), lower bar q (draft); r = residual"));
  cands.forEach((c, i) => {
    const y = 16 + i * rowH, g = svgEl("g", { class: "cand", "data-token": c.token, "data-p": c.p, "data-q": c.q });
    const mark = (!isBonus && c.token === d.token) ? " \u25c0 draft" : (pos === rec.num_accepted && c.token === rec.token ? " \u25c0 " + (rec.bonus ? "bonus" : "recovered") : "");
    g.append(svgEl("text", { x: 0, y: y + 14 }, visible(c.text).slice(0, 12)));
    g.append(svgEl("rect", { x: left, y: y, width: c.overlap * scale, height: 11, fill: "var(--overlap)" }));
    g.append(svgEl("rect", { x: left + c.overlap * scale, y: y, width: (c.p - c.overlap) * scale, height: 11, fill: isBonus ? "var(--p)" : "var(--residual)" }));
    g.append(svgEl("rect", { x: left, y: y, width: c.p * scale, height: 11, fill: "none", stroke: "var(--p)" }));
    if (!isBonus) {
      g.append(svgEl("rect", { x: left, y: y + 12, width: c.overlap * scale, height: 11, fill: "var(--overlap)", opacity: 0.6 }));
      g.append(svgEl("rect", { x: left + c.overlap * scale, y: y + 12, width: c.draft_excess * scale, height: 11, fill: "var(--excess)" }));
      g.append(svgEl("rect", { x: left, y: y + 12, width: c.q * scale, height: 11, fill: "none", stroke: "var(--q)" }));
    }
    const label = isBonus ? `p ${fmt(c.p)}` : `p ${fmt(c.p)}  q ${fmt(c.q)}  r ${fmt(c.residual)}`;
    g.append(svgEl("text", { class: "nums", x: left + width + 6, y: y + 10 }, label));
    g.append(svgEl("text", { x: left + width + 6, y: y + 22, fill: "#333", "font-weight": 700 }, mark));
    svg.append(g);
  });
}

$("start").onclick = start; $("step").onclick = step; $("play").onclick = play;
init().catch(err => showError("error", err));
