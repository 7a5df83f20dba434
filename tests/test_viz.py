"""`verispec viz` in headless Chromium (Playwright driving /usr/bin/chromium): each page is loaded,
its controls driven, and what it shows compared with the library's own numbers. Screenshots go to
artifacts/screenshots/. No request may leave the local server (the pages work offline)."""

import json
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from tiny_hf import save_tiny_model_dir
from viz_reference import reference_steps, visible
from verispec.analyze import AnalyzeConfig, measured_from_bench, speedup_table
from verispec.api import SpeculativeDecoder
from verispec.config import TreeConfig
from verispec.viz.lossless import demo_chunk

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]

# Outside CI a missing browser skips these tests; in CI (which runs scripts/test.sh, the installer of
# both) it is a failure, so the browser tests can never silently not run there.
if os.environ.get("CI"):
    import playwright.sync_api as sync_api

    assert Path(CHROMIUM).exists(), f"CI needs chromium at {CHROMIUM} (scripts/test.sh installs it)"
else:
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser tests need playwright (scripts/setup.sh --test)")
    if not Path(CHROMIUM).exists():
        pytest.skip("browser tests need chromium (scripts/test.sh installs the Debian package)", allow_module_level=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("viz-models")
    return (str(save_tiny_model_dir(root / "target", seed=0, sharpness=3.0)),
            str(save_tiny_model_dir(root / "draft", seed=1, sharpness=3.0)))


@pytest.fixture(scope="module")
def server(model_dirs):
    import uvicorn

    from verispec.viz.server import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(SpeculativeDecoder.load(*model_dirs))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a bound only
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "the viz server did not start"
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    requests, errors = [], []
    pg.on("request", lambda r: requests.append(r.url))
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert requests and all(url.startswith(server) for url in requests), [u for u in requests if not u.startswith(server)]
    assert not errors


def test_index_links_every_page(page, server, model_dirs):
    page.goto(server + "/")
    page.wait_for_function("document.getElementById('target').textContent.includes('target')")
    assert page.text_content("#target") == model_dirs[0]
    for path in ("/live", "/lossless", "/speedup"):
        assert page.locator(f"main a[href='{path}']").count() == 1
    page.screenshot(path=str(SHOTS / "index.png"), full_page=True)


def test_live_view_shows_the_librarys_verification(page, server, model_dirs):
    settings = dict(prompt="the cat sat", k=3, temperature=1.0, seed=7, max_new_tokens=20)
    page.goto(server + "/live")
    page.wait_for_selector(f"#drafter option[value='{model_dirs[1]}']", state="attached")
    page.fill("#prompt", settings["prompt"])
    page.select_option("#drafter", model_dirs[1])
    page.fill("#k", "3")
    page.fill("#temperature", "1")
    page.fill("#seed", "7")
    page.fill("#max-new-tokens", "20")
    page.click("#start")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    for n in (1, 2):
        page.click("#step")
        page.wait_for_selector(f".step[data-step='{n}']")
    page.click("#play")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('finished')", timeout=60000)
    steps, text, prompt_text, stats = reference_steps(model_dirs, **settings)
    rows = page.locator(".step")
    assert rows.count() == len(steps) == stats.target_forward_passes
    for i, ref in enumerate(steps):
        chips = rows.nth(i).locator(".chip.draft")
        assert chips.count() == len(ref["drafts"])
        for j, d in enumerate(ref["drafts"]):
            chip = chips.nth(j)
            assert chip.get_attribute("data-verdict") == d["verdict"]
            assert chip.locator(".tok").text_content() == visible(d["text"])
            assert chip.locator(".accept").text_content() == f"min(1,p/q) {d['accept_probability']:.3f}"
            assert chip.locator(".uniform").text_content() == f"u {d['uniform']:.3f}"
        final = rows.nth(i).locator(".chip.final")
        assert final.get_attribute("data-kind") == ("bonus" if ref["bonus"] else "recovered")
        assert final.locator(".tok").text_content() == visible(ref["token_text"])
    assert page.text_content("#output") == prompt_text + text
    assert page.text_content("#target-calls") == str(stats.target_forward_passes)
    assert page.text_content("#new-tokens") == str(stats.new_tokens)
    assert page.text_content("#acceptance-rate") == f"{100 * stats.acceptance_rate:.1f}%"
    assert page.text_content("#tokens-per-call") == f"{stats.tokens_per_target_pass:.2f}"
    # Click the first rejected draft: its p and q bars are the library's candidates at that position.
    rejected = [(i, j) for i, s in enumerate(steps) for j, d in enumerate(s["drafts"]) if d["verdict"] == "rejected"]
    assert rejected, "the seed should give at least one rejection"
    i, j = rejected[0]
    rows.nth(i).locator(".chip.draft").nth(j).click()
    bars = page.locator("#bars g.cand")
    candidates = steps[i]["positions"][j]["candidates"]
    assert bars.count() == len(candidates)
    for b, c in enumerate(candidates):
        g = bars.nth(b)
        assert int(g.get_attribute("data-token")) == c["token"]
        assert g.locator("text.nums").text_content() == f"p {c['p']:.3f}  q {c['q']:.3f}  r {c['residual']:.3f}"
    assert f"{steps[i]['positions'][j]['acceptance_mass']:.3f}" in page.text_content("#detail-title")
    rows.nth(i).scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "live.png"), full_page=True)


def test_live_view_shows_a_tree_step_by_step(page, server, model_dirs):
    settings = dict(prompt="the cat sat", k=3, temperature=1.0, seed=7, max_new_tokens=16)
    page.goto(server + "/live")
    page.wait_for_selector(f"#drafter option[value='{model_dirs[1]}']", state="attached")
    page.fill("#prompt", settings["prompt"])
    page.select_option("#drafter", model_dirs[1])
    page.select_option("#tree-mode", "shape")
    assert page.is_disabled("#tree-budget") and page.is_disabled("#tree-top-k") and page.is_enabled("#tree-shape")
    page.fill("#tree-shape", "3,x")  # refused by the server, shown on the page
    page.click("#start")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "branching factors per depth like 3,2,1, got '3,x'" in page.text_content("#error")
    page.fill("#tree-shape", "2,2,1")
    for name in ("k", "temperature", "seed", "max-new-tokens"):
        page.fill(f"#{name}", str(settings[name.replace("-", "_")]))
    page.click("#start")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    assert page.text_content("#error") == ""
    for n in (1, 2):
        page.click("#step")
        page.wait_for_selector(f".step[data-step='{n}']")
    page.click("#play")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('finished')", timeout=60000)
    steps, text, prompt_text, stats = reference_steps(model_dirs, **settings, tree=TreeConfig(shape=(2, 2, 1)))
    rows = page.locator(".step.tree-step")
    assert rows.count() == len(steps) == stats.target_forward_passes
    for i, ref in enumerate(steps):
        nodes = ref["tree"]["nodes"]
        chips = rows.nth(i).locator(".chip.node")
        assert chips.count() == len(nodes)
        for n in nodes:
            chip = rows.nth(i).locator(f".chip.node[data-node='{n['node']}']")
            assert chip.get_attribute("data-verdict") == n["verdict"]
            assert chip.locator(".tok").text_content() == visible(n["text"])
            family = chip.locator("xpath=..")
            assert int(family.get_attribute("data-parent")) == n["parent"]
            assert int(family.locator("xpath=ancestor::div[@data-depth]").get_attribute("data-depth")) == n["depth"]
            if n["verdict"] == "not tried":
                assert chip.locator(".accept").count() == 0
            else:
                assert chip.locator(".accept").text_content() == f"min(1,p/q) {n['accept_probability']:.3f}"
                assert chip.locator(".uniform").text_content() == f"u {n['uniform']:.3f}"
        path = " \u2192 ".join(visible(nodes[j]["text"]) for j in ref["tree"]["path"]) or "(none accepted)"
        assert rows.nth(i).locator(".path").text_content() == path
        final = rows.nth(i).locator(".chip.final")
        assert final.get_attribute("data-kind") == ("bonus" if ref["bonus"] else "recovered")
        assert final.locator(".tok").text_content() == visible(ref["token_text"])
    assert page.text_content("#output") == prompt_text + text
    assert page.text_content("#target-calls") == str(stats.target_forward_passes)
    assert page.text_content("#new-tokens") == str(stats.new_tokens)
    assert page.text_content("#acceptance-rate") == f"{100 * stats.acceptance_rate:.1f}%"
    assert page.text_content("#tokens-per-call") == f"{stats.tokens_per_target_pass:.2f}"
    # Click a rejected node that was not the first try: its bars are the residual pair it was checked against.
    picks = [(i, n) for i, s in enumerate(steps) for n in s["tree"]["nodes"] if n["verdict"] == "rejected"]
    assert picks, "the seed should give a rejected node"
    i, n = max(picks, key=lambda pick: pick[1]["try"])
    rows.nth(i).locator(f".chip.node[data-node='{n['node']}']").click()
    bars = page.locator("#bars g.cand")
    candidates = n["position"]["candidates"]
    assert bars.count() == len(candidates)
    for b, c in enumerate(candidates):
        g = bars.nth(b)
        assert int(g.get_attribute("data-token")) == c["token"]
        assert g.locator("text.nums").text_content() == f"p {c['p']:.3f}  q {c['q']:.3f}  r {c['residual']:.3f}"
    title = page.text_content("#detail-title")
    assert f"node #{n['node']}" in title and f"{n['position']['acceptance_mass']:.3f}" in title
    assert rows.nth(i).locator(".chip.selected").get_attribute("data-node") == str(n["node"])
    rows.nth(i).scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / "live_tree.png"), full_page=True)
    # The final token of a step: drawn from p at a leaf (bonus) or from the last pair's residual.
    rows.nth(i).locator(".chip.final").click()
    candidates = steps[i]["tree"]["final"]["position"]["candidates"]
    assert page.locator("#bars g.cand").count() == len(candidates)
    assert [int(t) for t in page.locator("#bars g.cand").evaluate_all("gs => gs.map(g => g.dataset.token)")] == \
        [c["token"] for c in candidates]


def test_losslessness_demo_matches_the_library(page, server):
    p, q = [5, 3, 1, 1], [1, 1, 3, 5]
    page.goto(server + "/lossless")
    page.click("#remove")  # five tokens at the start, four here
    for name, values in (("p", p), ("q", q)):
        for i, v in enumerate(values):
            page.fill(f"#{name}{i}", str(v))
            page.dispatch_event(f"#{name}{i}", "change")
    page.fill("#chunk", "1000")
    page.fill("#total", "3000")
    page.fill("#seed", "11")
    page.click("#run")
    page.wait_for_function("document.getElementById('samples').textContent === '3000'", timeout=60000)
    ref = None
    for chunk in range(3):
        ref = demo_chunk(p, q, 1000, 11 + chunk, ref["counts"] if ref else None, ref["accepted"] if ref else 0)
    assert page.text_content("#acceptance-theory") == f"{ref['acceptance_theory']:.4f}" == "0.4000"
    assert page.text_content("#acceptance-empirical") == f"{ref['acceptance_empirical']:.4f}"
    assert page.text_content("#p-value") == f"{ref['chi_square']['p_value']:.4f}"
    assert page.text_content("#chi-square") == f"{ref['chi_square']['statistic']:.2f} ({ref['chi_square']['dof']})"
    freqs = [float(page.locator(f"#histogram rect.freq[data-token='{t}']").get_attribute("data-frequency")) for t in range(4)]
    assert freqs == pytest.approx([c / 3000 for c in ref["counts"]])
    assert ref["chi_square"]["p_value"] > 0.001  # the speculative rule keeps p
    page.screenshot(path=str(SHOTS / "lossless.png"), full_page=True)
    page.fill("#p0", "-1")
    page.dispatch_event("#p0", "change")
    page.click("#sample")
    page.wait_for_function("document.getElementById('error').textContent.length > 0")
    assert "p entries must be finite and >= 0" in page.text_content("#error")


def cells(page, alpha):
    row = page.locator(f"#table tr[data-alpha='{alpha}']")
    return ([float(t) for t in row.locator("span.speedup").all_text_contents()],
            [float(t) for t in row.locator("small.tokens").all_text_contents()], row)


def test_speedup_calculator_matches_analyze_and_reads_a_bench(page, server, tmp_path):
    page.goto(server + "/speedup")
    page.wait_for_selector("#table tr[data-alpha]")
    page.fill("#alphas", "0.6, 0.8")
    page.fill("#k-max", "10")
    page.fill("#c", "0.05")
    page.click("#compute")
    page.wait_for_selector("#table tr[data-alpha='0.6'] td[data-k='10']")
    table = speedup_table(AnalyzeConfig(alphas=(0.6, 0.8), k_max=10, c=0.05))
    for ref in table["rows"]:
        speedups, tokens, row = cells(page, ref["alpha"])
        assert speedups == [round(s, 3) for s in ref["speedup"]]
        assert tokens == [round(e, 3) for e in ref["tokens"]]
        assert row.locator("td.best").get_attribute("data-k") == str(ref["best_k"])
        assert page.locator(f"#plot .best-mark[data-alpha='{ref['alpha']}']").get_attribute("data-k") == str(ref["best_k"])
    assert [r["best_k"] for r in table["rows"]] == [4, 8]
    page.screenshot(path=str(SHOTS / "speedup.png"), full_page=True)
    # Measured mode: alpha and c from an uploaded bench JSON.
    stats = lambda **kw: {"draft_tokens": 0, "accepted_tokens": 0, "recovered_tokens": 0, "draft_seconds": 0.0, **kw}  # noqa: E731
    report = {"runs": [{"system": "verispec-plain", "stats": stats(target_forward_passes=40, target_seconds=4.0)},
                       {"system": "verispec-draft", "stats": stats(draft_tokens=40, accepted_tokens=28, recovered_tokens=7,
                                                                   draft_seconds=0.8, target_forward_passes=12, target_seconds=2.0)}]}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(report))
    page.set_input_files("#bench", str(bench))
    page.wait_for_function("document.getElementById('measured').textContent.includes('measured')")
    m = measured_from_bench(report)
    assert (m["alpha"], m["c"]) == (pytest.approx(0.8), pytest.approx(0.2))
    assert re.search(r"alpha = 0\.8000, c = 0\.2000", page.text_content("#measured"))
    ref = speedup_table(AnalyzeConfig(alphas=(m["alpha"],), k_max=10, c=m["c"]))["rows"][0]
    # the table from before the upload has a 0.8 row too: wait until it is redrawn with the measured c (a bounded wait)
    page.wait_for_function("expected => { const s = document.querySelector(\"#table tr[data-alpha='0.8'] span.speedup\");"
                           " return s !== null && Number(s.textContent) === expected; }", arg=round(ref["speedup"][0], 3),
                           timeout=30_000)
    speedups, _, row = cells(page, "0.8")
    assert speedups == [round(s, 3) for s in ref["speedup"]]
    assert row.locator("td.best").get_attribute("data-k") == str(ref["best_k"])
    page.screenshot(path=str(SHOTS / "speedup_measured.png"), full_page=True)
