"""The speedup calculator against hand-computed values, measured mode from a bench JSON, and the CLI."""

import json

import pytest

from verispec.analyze import AnalyzeConfig, measured_from_bench, speedup_table
from verispec.cli import main
from verispec.errors import VerispecError


def row(table, alpha):
    return next(r for r in table["rows"] if r["alpha"] == alpha)


def test_expected_tokens_and_speedup_match_hand_computed_values():
    table = speedup_table(AnalyzeConfig(alphas=(0.0, 0.5, 0.8, 1.0), k_max=10, c=0.05))
    assert table["ks"] == list(range(1, 11))
    # alpha 0.5, K 1: E = (1 - 0.25) / 0.5 = 1.5; speedup 1.5 / 1.05
    assert row(table, 0.5)["tokens"][0] == pytest.approx(1.5)
    assert row(table, 0.5)["speedup"][0] == pytest.approx(1.5 / 1.05)
    # alpha 0.8: E(K=4) = (1 - 0.32768) / 0.2 = 3.3616 -> 3.3616 / 1.2; the best K is 8 (3.0921 > 3.0823 at 7, 3.0780 at 9)
    r = row(table, 0.8)
    assert r["tokens"][3] == pytest.approx(3.3616)
    assert r["speedup"][3] == pytest.approx(2.801333, abs=1e-6)
    assert [round(s, 4) for s in r["speedup"][6:9]] == [3.0823, 3.0921, 3.0780]
    assert r["best_k"] == 8
    # alpha 0: every draft is rejected, one token per pass, drafting only costs: speculation off
    assert row(table, 0.0)["tokens"] == [1.0] * 10 and row(table, 0.0)["best_k"] == 0
    assert row(table, 0.0)["speedup"][1] == pytest.approx(1 / 1.1)
    # alpha 1: K + 1 tokens per pass
    assert row(table, 1.0)["tokens"][2] == 4.0 and row(table, 1.0)["best_k"] == 10


def test_a_free_drafter_makes_the_largest_k_best():
    assert row(speedup_table(AnalyzeConfig(alphas=(0.6,), k_max=5, c=0.0)), 0.6)["best_k"] == 5


@pytest.mark.parametrize("bad", [dict(alphas=(1.2,)), dict(alphas=()), dict(k_max=0), dict(c=-1.0)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(VerispecError):
        AnalyzeConfig(**bad)


def bench_report():
    def run(system, **stats):
        return {"system": system, "question_id": 0, "category": "x", "stats": stats}
    return {"runs": [
        run("verispec-plain", target_forward_passes=30, target_seconds=3.0, draft_tokens=0),
        run("verispec-plain", target_forward_passes=20, target_seconds=2.0, draft_tokens=0),
        run("verispec-draft", draft_tokens=24, accepted_tokens=18, recovered_tokens=6, draft_seconds=1.2,
            target_seconds=3.0, target_forward_passes=10),
        run("verispec-draft", draft_tokens=16, accepted_tokens=12, recovered_tokens=4, draft_seconds=0.8,
            target_seconds=2.0, target_forward_passes=8),
        run("hf-generate", draft_tokens=0) | {"stats": None},
    ]}


def test_measured_alpha_and_c_from_a_bench_report():
    m = measured_from_bench(bench_report())
    # alpha = 30 accepted / (30 + 10 rejections); c = (2.0 s / 40 drafts) / (5.0 s / 50 plain passes)
    assert m["system"] == "verispec-draft" and m["systems"] == ["verispec-draft"]
    assert m["alpha"] == pytest.approx(0.75) and m["c"] == pytest.approx(0.5)
    with pytest.raises(VerispecError, match="did not draft"):
        measured_from_bench(bench_report(), "verispec-plain")
    with pytest.raises(VerispecError, match="not a verispec bench report"):
        measured_from_bench({"summary": {}})


def test_cli_table_json_and_plot(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_report()))
    png = tmp_path / "speedup.png"
    assert main(["analyze", "--bench", str(bench), "--k-max", "4", "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured"]["alpha"] == pytest.approx(0.75) and out["c"] == pytest.approx(0.5)
    assert out["rows"][0]["speedup"][0] == pytest.approx(1.75 / 1.5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["analyze", "--alpha", "0.8", "--k-max", "10", "-c", "0.05"]) == 0
    text = capsys.readouterr().out
    assert "*3.09" in text and "K=10" in text
    assert main(["analyze", "--alpha", "x"]) == 2
    assert main(["analyze", "--system", "s"]) == 2
