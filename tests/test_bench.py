"""`verispec bench` on tiny models: every system runs, greedy outputs agree, files are written."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from drafting import drafts_accepted
from tiny_hf import char_tokenizer, distilled_copy_of, save_tiny_model_dir, tiny_dir_with_head_from_embedding
from verispec.bench.report import BASELINES
from verispec.bench.results import report_from_json
from verispec.bench.catalog import HEAD_SYSTEMS, LLAMACPP_SYSTEMS, SYSTEMS
from verispec.bench.runner import BenchConfig, by_turns, run_bench
from verispec.api import SpeculativeDecoder
from verispec.cli import main
from verispec.config import SamplingConfig
from verispec.models.distilled import VocabMap, save_distilled, vocab_fingerprint
from verispec.errors import VerispecError
from verispec.models import load_model
from verispec.tuning import KTuner, CostProfile, best_k, expected_speedup, expected_tokens


def speculative_runs(report) -> dict[str, list[dict]]:
    """Each verispec speculative system's runs (those with stats; not plain decoding), by system."""
    runs = {}
    for run in report["runs"]:
        if run["system"] != "verispec-plain" and run.get("stats"):
            runs.setdefault(run["system"], []).append(run)
    return runs


def assert_every_system_drafted(report, expected_systems) -> None:
    """Greedy equality with plain decoding is worth something only for a system that drafted and had drafts
    accepted (an auto-tuned system that switched drafting off is plain decoding)."""
    runs = speculative_runs(report)
    assert set(runs) == set(expected_systems)
    idle = []
    for system, system_runs in sorted(runs.items()):
        try:
            drafts_accepted(system_runs)
        except AssertionError as err:
            idle.append(f"{system} ({err})")
    assert not idle, f"these systems drafted nothing or had nothing accepted: {idle}"


@pytest.fixture()
def fixed_costs(monkeypatch):
    """The -auto systems tune K from a fixed cost profile in which drafting pays (a target pass costs the same
    over 1 to k_max + 1 tokens, a draft token 5% of it), not from this machine's timings: measured on a busy CPU
    the tuner may turn drafting off, and greedy equality would then compare plain decoding with itself."""
    def auto_tuner(self, k_max=8):
        return KTuner(CostProfile({w: 1.0 for w in range(1, k_max + 2)}, draft_token=0.05), learn_costs=False)

    monkeypatch.setattr(SpeculativeDecoder, "auto_tuner", auto_tuner)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = tiny_dir_with_head_from_embedding(root / "target")
    draft = tiny_dir_with_head_from_embedding(root / "draft")
    prompts = root / "prompts.jsonl"
    rows = [{"question_id": i, "category": cat, "turns": [text]}
            for i, (cat, text) in enumerate([("coding", "write a loop"), ("qa", "who are you?"), ("rag", "read this: a b c. a b")])]
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["ngram", "build", "--tokenizer", str(target), "--corpus", str(prompts), "--out", str(root / "t.ngram"),
                 "--min-count", "1"]) == 0
    tok = char_tokenizer()
    vocab = VocabMap.from_target_ids(torch.arange(2, len(tok)), len(tok))
    shape, model = distilled_copy_of(target, vocab)
    distilled = save_distilled(root / "distilled", shape, model, vocab,
                               {"target": "tiny", "target_vocab_sha256": vocab_fingerprint(tok), "target_vocab_size": len(tok)})
    return root, str(target), str(draft), str(prompts), str(distilled)


def test_bench_runs_all_systems_and_writes_report(setup, fixed_costs):
    root, target, draft, prompts, distilled = setup
    config = BenchConfig(prompts=prompts, per_category=1, max_new_tokens=26, out_dir=str(root / "out"),
                         ngram_table=str(root / "t.ngram"), distilled=distilled)
    report = run_bench(config, load_model(target), load_model(draft))
    summary = report["summary"]
    assert set(summary) == set(SYSTEMS) - set(LLAMACPP_SYSTEMS) - {"verispec-self-retune-auto"} - set(HEAD_SYSTEMS)  # torch, no heads
    assert set(summary["verispec-draft"]) == {"mt_bench", "qa", "rag", "all"}
    for system, cats in summary.items():
        assert cats["all"]["greedy_equal_to_plain"] == "3/3", system
    assert_every_system_drafted(report, {s for s in summary if s.startswith("verispec-") and s != "verispec-plain"})
    assert summary["verispec-draft"]["all"]["acceptance_rate"] == 1.0
    tree, chain = summary["verispec-draft-tree"]["all"], summary["verispec-draft"]["all"]
    assert tree["tokens_per_target_pass"] >= chain["tokens_per_target_pass"] > 1  # the draft is the target
    assert tree["mean_accepted_length"] > 0 and "tokens per target pass" in report["markdown"]
    # the baselines that ran, and Hugging Face's faster speculative setting (assisted or prompt lookup)
    assert set(summary["verispec-draft"]["all"]["speedup"]) == set(BASELINES) - set(LLAMACPP_SYSTEMS) | {"hf-best-speculative"}
    assert "speedup vs verispec-plain / hf-generate / hf-assisted / hf-best-speculative)" in report["markdown"]
    assert report["best_speculative"]["hf-best-speculative"] in ("hf-assisted", "hf-prompt-lookup")
    for name in ("bench.json", "bench.md", "speedup_by_category.png", "acceptance_by_position.png"):
        assert (root / "out" / name).stat().st_size > 0
    assert report["bandwidth_limit_tokens_per_second"] > 0
    for run in report["runs"]:  # every system notes its first output, so decoding is timed apart from the prompt
        assert 0 < run["first_output_seconds"] < run["seconds"] and run["first_output_tokens"] >= 1, run
        assert run["decode_tokens_per_second"] > 0, run
    assert summary["verispec-draft"]["all"]["decode_speedup"]["hf-generate"] > 0
    assert "after the first output" in report["markdown"] and report["plain_fraction_of_bandwidth_limit"] > 0
    # the same tables rebuilt from the file: what `verispec bench --report` does with a finished bench
    again = report_from_json(root / "out" / "bench.json", root / "again")
    assert again["summary"] == json.loads(json.dumps(summary)) and again["markdown"] == report["markdown"]


def test_bench_cli_and_errors(setup, capsys):
    root, target, draft, prompts, _ = setup
    assert main(["bench", "--target", target, "--draft", "ngram", "--prompts", prompts, "--per-category", "1",
                 "--max-new-tokens", "6", "--systems", "verispec-plain,verispec-ngram,verispec-ngram-tree",
                 "--tree-shape", "2,2", "--out", str(root / "cli")]) == 0
    assert "verispec-ngram-tree" in capsys.readouterr().out
    assert json.loads((root / "cli" / "bench.json").read_text())["config"]["tree"]["shape"] == [2, 2]
    assert main(["bench", "--target", target, "--prompts", prompts, "--systems", "nope"]) == 2
    assert main(["bench", "--target", target, "--prompts", prompts, "--categories", "poetry"]) == 2
    with pytest.raises(VerispecError):
        BenchConfig(per_category=0)
    with pytest.raises(VerispecError, match="split"):
        BenchConfig(split="test")
    assert main(["bench", "--target", target, "--prompts", prompts, "--systems", "verispec-distilled",
                 "--distilled", str(root)]) == 2  # not a distilled draft directory
    with pytest.raises(VerispecError, match="weight format"):
        BenchConfig(distilled_weights="fp4")


def test_bench_runs_the_eagle_head_alone_and_behind_suffix_decoding(tmp_path, fixed_costs):
    """Given a head made for the target (`eagle:DIR`), the head systems run: verispec-suffix-eagle* put suffix decoding
    and the head behind one composite drafter, both drafting, and every system decodes as plain decoding does."""
    from test_eagle import random_head
    from transformers import AutoModelForCausalLM

    from verispec.bench.runner import build_systems

    folder = save_tiny_model_dir(tmp_path / "target", "qwen2", seed=0, sharpness=3.0)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    layers = model.config.num_hidden_layers
    random_head(model, draft_vocab=model.config.vocab_size - 8, aux=(0, layers - 1, layers - 1), scale=0.3).save(
        tmp_path / "eagle")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) for i, (c, t) in
                                 enumerate([("qa", "a b c a b c a b"), ("rag", "dog cat dog cat dog")])) + "\n")
    names = ("verispec-plain", "verispec-eagle", "verispec-suffix-eagle", "verispec-suffix-eagle-auto")
    config = BenchConfig(prompts=str(prompts), per_category=1, max_new_tokens=24, out_dir=str(tmp_path / "out"),
                         systems=names, eagle=f"eagle:{tmp_path / 'eagle'}", medusa=None)
    target = load_model(str(folder))
    composite = {s.name: s for s in build_systems(config, target, None, None, None)}["verispec-suffix-eagle"]
    assert composite.decoder.draft_name.startswith("suffix+eagle")
    for text in ("a b c a b c a b", "dog cat dog cat dog"):
        composite.run(target.tokenizer.encode(text), SamplingConfig(temperature=0), 24, 0)
    assert all(composite.decoder.drafter.shares().values()), composite.decoder.drafter.shares()  # both drafted rows
    report = run_bench(config, target, None)
    for system in names:
        assert report["summary"][system]["all"]["greedy_equal_to_plain"] == "2/2", system
    assert_every_system_drafted(report, set(names) - {"verispec-plain"})


def test_bench_runs_the_distilled_draft_with_the_draft_weight_format(setup):
    """The distilled draft runs as `generate` runs it (int8 by default); --draft-weights dense keeps float32."""
    root, target, _, prompts, distilled = setup
    for weights in ("int8", "dense"):
        out = root / f"distilled-{weights}"
        assert main(["bench", "--target", target, "--draft", "none", "--prompts", prompts, "--per-category", "1",
                     "--max-new-tokens", "6", "--systems", "verispec-plain,verispec-distilled", "--distilled", distilled,
                     "--draft-weights", weights, "--out", str(out)]) == 0
        report = json.loads((out / "bench.json").read_text())
        assert report["config"]["distilled_weights"] == weights
        assert report["summary"]["verispec-distilled"]["all"]["greedy_equal_to_plain"] == "3/3"
        assert_every_system_drafted(report, {"verispec-distilled"})
    config = BenchConfig(prompts=prompts, distilled=distilled, systems=("verispec-distilled",))
    from verispec.bench.runner import build_systems

    loaded = load_model(target, weights="dense")
    for weights, layer in (("int8", "Int8Linear"), ("dense", "Linear")):
        systems = build_systems(dataclasses.replace(config, distilled_weights=weights), loaded, None, loaded, None)
        model = systems[0].decoder.drafter.runner.model
        assert type(model.lm_head).__name__ == layer


def test_bench_with_online_adaptation(setup, capsys):
    """--adapt: drafters that can adapt learn between prompts; greedy output still equals plain decoding."""
    root, target, draft, prompts, _ = setup
    assert main(["bench", "--target", target, "--draft", str(root / "t.ngram"), "--prompts", prompts,
                 "--per-category", "1", "--max-new-tokens", "12", "--adapt", "--out", str(root / "adapt"),
                 "--systems", "verispec-plain,verispec-ngram-corpus"]) == 0
    report = json.loads((root / "adapt" / "bench.json").read_text())
    assert report["config"]["adapt"] is True and report["config"]["ngram_table"] == str(root / "t.ngram")
    assert report["summary"]["verispec-ngram-corpus"]["all"]["greedy_equal_to_plain"] == "3/3"
    assert_every_system_drafted(report, {"verispec-ngram-corpus"})


def test_bench_records_a_failing_system_and_goes_on(setup, monkeypatch):
    """One system failing on one prompt is reported as a failure; the other runs still count, and the JSON
    written after each prompt holds the runs so far."""
    import verispec.bench.runner as runner

    root, target, draft, prompts, _ = setup
    build = runner.build_systems
    seen_partial = []

    def flaky_systems(*args, **kwargs):
        systems = build(*args, **kwargs)
        flaky = next(s for s in systems if s.name == "verispec-ngram")
        original = flaky.run

        def run(prompt, sampling, max_new_tokens, seed):
            out = Path(root / "flaky" / "bench.json")
            if out.is_file():
                seen_partial.append(json.loads(out.read_text()))
            if seed == 2:  # the rag prompt (question id 2; seeds are config.seed + question id)
                raise ValueError("context too long for this system")
            return original(prompt, sampling, max_new_tokens, seed)

        flaky.run = run
        return systems

    monkeypatch.setattr(runner, "build_systems", flaky_systems)
    config = BenchConfig(prompts=prompts, per_category=1, max_new_tokens=6, out_dir=str(root / "flaky"),
                         systems=("verispec-plain", "verispec-ngram"))
    report = run_bench(config, load_model(target), None)
    assert [f["system"] for f in report["failures"]] == ["verispec-ngram"]
    assert "context too long" in report["failures"][0]["error"] and "failed runs" in report["markdown"]
    assert report["summary"]["verispec-ngram"]["all"]["prompts"] == 2
    assert report["summary"]["verispec-ngram"]["all"]["greedy_equal_to_plain"] == "2/2"
    assert_every_system_drafted(report, {"verispec-ngram"})
    assert report["summary"]["verispec-plain"]["all"]["prompts"] == 3
    assert any(p["partial"] and p["runs"] for p in seen_partial)  # written before the bench ended
    partial = next(p for p in seen_partial if p["partial"] and p["runs"])
    (root / "cut").mkdir(exist_ok=True)
    (root / "cut" / "bench.json").write_text(json.dumps(partial))
    assert main(["bench", "--report", str(root / "cut" / "bench.json")]) == 0  # a bench cut short, reported
    rebuilt = json.loads((root / "cut" / "bench.json").read_text())
    assert rebuilt["partial"] is True and rebuilt["summary"]["verispec-plain"]["all"]["greedy_equal_to_plain"] == "1/1"
    assert (root / "cut" / "bench.md").read_text().startswith("partial results")
    (root / "cut" / "broken.json").write_text("{not json")
    for bad, message in ((root / "cut" / "missing.json", "not found"), (root / "cut" / "broken.json", "is not a")):
        with pytest.raises(VerispecError, match=message):
            report_from_json(bad)
    assert json.loads((root / "flaky" / "bench.json").read_text())["partial"] is False


def test_prompts_take_categories_in_turns():
    from verispec.datasets import Prompt

    prompts = [Prompt(1, "qa", "a"), Prompt(2, "qa", "b"), Prompt(3, "qa", "c"), Prompt(4, "rag", "d"), Prompt(5, "math", "e"),
               Prompt(6, "math", "f")]
    assert [p.question_id for p in by_turns(prompts)] == [1, 4, 5, 2, 6, 3]


def test_greedy_equality_is_only_reported_against_a_plain_run():
    from verispec.bench.report import Record, summarize
    from verispec.bench.systems import Run

    alone = summarize([Record("verispec-draft", 1, "qa", Run([1, 2], 1.0, None, 0.5, 1))], greedy=True)
    assert "greedy_equal_to_plain" not in alone["verispec-draft"]["all"]  # nothing to compare with: no "0/0"
    both = summarize([Record("verispec-plain", 1, "qa", Run([1, 2], 1.0)), Record("verispec-draft", 1, "qa", Run([1, 3], 1.0))],
                     greedy=True)
    assert both["verispec-draft"]["all"]["greedy_equal_to_plain"] == "0/1"


def test_systems_on_llama_cpp_kernels_are_compared_with_llama_cpp_plain_decoding():
    """Greedy equality on llama.cpp's kernels is checked against llama.cpp's own loop (same kernels), the
    torch-route systems against verispec-plain; a llama.cpp bench without verispec-plain still says it."""
    from verispec.bench.report import Record, markdown, summarize
    from verispec.bench.systems import Run

    runs = {"verispec-plain": [1, 2, 3], "llamacpp-generate": [1, 2, 4], "verispec-llamacpp-ngram-auto": [1, 2, 4],
            "verispec-llamacpp-distilled-auto": [1, 2, 5], "verispec-ngram": [1, 2, 3], "verispec-llamacpp-plain": [1, 2, 4]}
    records = [Record(name, 7, "qa", Run(ids, 1.0, None, 0.5, 1)) for name, ids in runs.items()]
    records[-1] = Record("verispec-llamacpp-plain", 7, "qa", Run([1, 2, 4], 2.0, None, 0.5, 1))  # half the rate
    summary = summarize(records, greedy=True)
    same = {name: (cats["all"]["greedy_equal_to_plain"], cats["all"]["greedy_reference"]) for name, cats in summary.items()}
    assert same["verispec-llamacpp-plain"] == ("1/1", "llamacpp-generate")
    # verispec's own plain loop on llama.cpp's kernels is a baseline: speculation there is measured against it
    assert summary["verispec-llamacpp-ngram-auto"]["all"]["speedup"]["verispec-llamacpp-plain"] == pytest.approx(2.0)
    assert same["verispec-llamacpp-ngram-auto"] == ("1/1", "llamacpp-generate")
    assert same["verispec-llamacpp-distilled-auto"] == ("0/1", "llamacpp-generate")
    assert same["verispec-ngram"] == ("1/1", "verispec-plain")
    assert same["llamacpp-generate"] == ("0/1", "verispec-plain")  # llama.cpp's own loop against the torch route
    table = markdown(summary, ["qa"])
    assert "| 0/1 (llamacpp-generate) |" in table
    assert "part from llamacpp-generate (verispec-llamacpp-distilled-auto)" in table  # and says why
    all_equal = summarize([r for r in records if r.system != "verispec-llamacpp-distilled-auto"], greedy=True)
    assert "part from" not in markdown(all_equal, ["qa"])
    without_plain = summarize([r for r in records if r.system != "verispec-plain"], greedy=True)
    assert without_plain["verispec-llamacpp-ngram-auto"]["all"]["greedy_equal_to_plain"] == "1/1"


def test_cost_model_formulas():
    assert expected_tokens(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / 0.5)
    assert expected_tokens(1.0, 3) == 4
    flat = CostProfile({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, draft_token=0.05)
    # E = 1.875 tokens for K = 3 at alpha 0.5; cost 3 * 0.05 + 1 = 1.15.
    assert expected_speedup(0.5, 3, flat) == pytest.approx(1.875 / 1.15)
    assert best_k(0.9, flat) == 4
    steep = CostProfile({1: 1.0, 2: 2.0, 3: 3.0}, draft_token=0.5)
    assert best_k(0.5, steep) == 0  # nothing beats plain decoding: speculation off


def test_adaptive_k_follows_acceptance_and_probes_when_off():
    profile = CostProfile({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}, draft_token=0.2)
    tuner = KTuner(profile)
    for _ in range(50):
        tuner.observe(4, 4)
    assert tuner.k() == 4 and tuner.alpha > 0.9
    for _ in range(400):
        tuner.observe(1, 0)
    assert tuner.first_alpha < 0.1
    ks = [tuner.k() for _ in range(32)]
    assert ks.count(0) == 30 and ks.count(1) == 2


def _probe_steps(tuner: KTuner, steps: int, accept: bool) -> list[int]:
    """Run `steps` steps with speculation off; every probe drafts one token, accepted or not. Returns the probe steps."""
    probes = []
    for step in range(steps):
        if tuner.k():
            probes.append(step)
            tuner.observe(1, int(accept))
    return probes


def test_rejected_probes_back_off_and_accepted_ones_come_back():
    steep = CostProfile({1: 1.0, 2: 1.8, 3: 2.6}, draft_token=0.1)  # K = 0 at any alpha < 0.8
    tuner = KTuner(steep, prior=0.1, probe_every=4, probe_max=32)
    assert tuner.k() == 0
    probes = _probe_steps(tuner, 200, accept=False)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [8, 16, 32, 32]  # doubled after each rejection, then capped at probe_max
    probes = _probe_steps(tuner, 60, accept=True)  # accepted probes (alpha stays below 0.8: K stays 0)
    assert tuner.probe_gap < 32 and [b - a for a, b in zip(probes, probes[1:])][:2] == [16, 8]


def test_a_free_drafter_keeps_its_probe_pending_until_it_drafts():
    steep = CostProfile({1: 1.0, 2: 1.8, 3: 2.6}, draft_token=0.0)
    tuner = KTuner(steep, prior=0.1, probe_every=4)
    assert [tuner.k() for _ in range(6)] == [0, 0, 0, 1, 1, 1]  # nothing drafted yet: still probing
    tuner.observe(1, 0)
    assert tuner.k() == 0 and tuner.probe_gap == 8
    costly = KTuner(CostProfile({1: 1.0, 2: 1.8, 3: 2.6}, draft_token=0.2), prior=0.1, probe_every=4)
    assert [costly.k() for _ in range(9)] == [0, 0, 0, 1, 0, 0, 0, 1, 0]  # a draft model's probe is one step
    with pytest.raises(ValueError, match="probe_every"):
        KTuner(steep, probe_every=64, probe_max=16)


def test_speculation_switched_back_on_resets_the_probe_gap():
    profile = CostProfile({1: 1.0, 2: 1.05, 3: 1.1}, draft_token=0.05)
    tuner = KTuner(profile, prior=0.01, prior_weight=40.0, probe_every=2, probe_max=64)
    _probe_steps(tuner, 40, accept=False)
    assert tuner.probe_gap > 2
    for _ in range(60):
        tuner.observe(2, 2)
    assert tuner.k() > 0 and tuner.probe_gap == 2


def test_the_report_gives_llama_cpp_systems_the_bandwidth_limit_of_their_quantized_weights(setup, tmp_path):
    """llama.cpp reads the GGUF's quantized weights, not the float32 copy: its systems get their own limit."""
    import numpy as np
    from gguf import GGUFWriter

    from verispec.bench.runner import gguf_bytes_per_token

    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((64, 16), dtype=np.float32))  # one row per token: not counted
    writer.add_tensor("output.weight", np.zeros((64, 16), dtype=np.float16))
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((32, 16), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    assert gguf_bytes_per_token(str(path)) == 64 * 16 * 2 + 32 * 16 * 4
    root, target, _, prompts, _ = setup
    assert main(["bench", "--target", target, "--draft", "ngram", "--prompts", prompts, "--per-category", "1",
                 "--max-new-tokens", "6", "--systems", "verispec-plain,verispec-ngram", "--out", str(tmp_path / "b")]) == 0
    data = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert data["gguf_bandwidth_limit_tokens_per_second"] is None  # no llama.cpp system ran
    for run in data["runs"]:  # as if verispec-ngram had been llama.cpp's own decoding
        run["system"] = run["system"].replace("verispec-ngram", "llamacpp-generate")
    data["gguf_bytes_per_token"] = 1e8
    (tmp_path / "b" / "bench.json").write_text(json.dumps(data))
    report = report_from_json(tmp_path / "b" / "bench.json", tmp_path / "again")
    limit = report["gguf_bandwidth_limit_tokens_per_second"]
    assert limit == pytest.approx(report["memory_bandwidth_gbs"] * 10)
    rate = report["summary"]["llamacpp-generate"]["all"]["median_decode_tokens_per_second"]
    assert report["fraction_of_gguf_bandwidth_limit"] == {"llamacpp-generate": pytest.approx(rate / limit)}
    assert "0.10 GB of quantized weights per token" in report["markdown"]


def test_an_mt_bench_category_asked_for_by_name_is_reported_apart(setup, tmp_path):
    """--categories coding keeps MT-Bench's coding questions under their own name (the issue's code and
    extraction-like categories); mt_bench keeps its eight together."""
    from verispec.datasets import load_prompts

    root, target, _, prompts, _ = setup
    assert [(p.category, p.question_id) for p in load_prompts(prompts)] == [("mt_bench", 0), ("qa", 1), ("rag", 2)]
    assert [p.category for p in load_prompts(prompts, ["coding", "rag"])] == ["coding", "rag"]
    assert [p.category for p in load_prompts(prompts, ["mt_bench"])] == ["mt_bench"]
    with pytest.raises(VerispecError, match="coding"):  # the error lists what can be asked for
        load_prompts(prompts, ["poetry"])
    assert main(["bench", "--target", target, "--draft", "ngram", "--prompts", prompts, "--categories", "coding,qa",
                 "--max-new-tokens", "4", "--systems", "verispec-plain,verispec-ngram", "--out", str(tmp_path)]) == 0
    assert set(json.loads((tmp_path / "bench.json").read_text())["summary"]["verispec-ngram"]) == {"coding", "qa", "all"}


def test_the_peers_lookup_k_sweep_names_their_best_speculative_setting(setup):
    """--peer-k runs each K of the peers' prompt lookup as a system of its own; the report takes the one with
    the highest median decoding rate as the peer's best speculative setting, a baseline of its own."""
    root, target, draft, prompts, _ = setup
    out = root / "peers"
    assert main(["bench", "--target", target, "--draft", draft, "--prompts", prompts, "--per-category", "1",
                 "--max-new-tokens", "8", "--peer-k", "1,3", "--out", str(out),
                 "--systems", "verispec-plain,verispec-ngram,hf-assisted,hf-prompt-lookup"]) == 0
    report = json.loads((out / "bench.json").read_text())
    summary = report["summary"]
    peers = ("hf-assisted", "hf-prompt-lookup-k1", "hf-prompt-lookup-k3")
    assert set(summary) == {"verispec-plain", "verispec-ngram", *peers}
    rates = {p: summary[p]["all"]["median_decode_tokens_per_second"] for p in peers}
    best = report["best_speculative"]["hf-best-speculative"]
    assert rates[best] == max(rates.values())
    # speedups against the alias are those against the best setting itself
    rate = {(r["system"], r["question_id"]): r["decode_tokens_per_second"] for r in report["runs"]}
    ratios = [rate[("verispec-ngram", q)] / rate[(best, q)] for q in range(3)]
    assert summary["verispec-ngram"]["all"]["decode_speedup"]["hf-best-speculative"] == pytest.approx(sorted(ratios)[1])
    assert "hf-best-speculative" not in summary[best]["all"]["decode_speedup"]  # not measured against itself
    assert f"hf-best-speculative: {best}" in (out / "bench.md").read_text()
    assert report["config"]["peer_num_draft_tokens"] == [1, 3]
    again = report_from_json(out / "bench.json", root / "peers-again")
    assert again["best_speculative"] == report["best_speculative"]
    assert again["markdown"] + "\n" == (out / "bench.md").read_text()
    with pytest.raises(VerispecError, match="peer_num_draft_tokens"):
        BenchConfig(peer_num_draft_tokens=(0, 2))
    assert main(["bench", "--target", target, "--prompts", prompts, "--peer-k", "one"]) == 2


def test_faults_the_engine_absorbs_are_counted_and_reported(setup, tmp_path):
    """A drafter that fails is restarted and the output stays exact, so only the speed shows it: the bench records
    each absorbed fault with its run and says so under the tables (a draft tree's commit fault, absorbed this way,
    once made a system 0.07x plain decoding with every output equal)."""
    from verispec.bench.report import Record, markdown, summarize
    from verispec.bench.systems import VerispecSystem
    from verispec.drafters.prompt_lookup import PromptLookupDrafter

    class FailsOnce(PromptLookupDrafter):
        failed = False

        def commit(self, sequences, drafts, paths):
            if not self.failed and any(len(d) for d in drafts):
                FailsOnce.failed = True
                raise RuntimeError("a commit fault")
            super().commit(sequences, drafts, paths)

    _, target, _, _, _ = setup
    loaded = load_model(target)
    prompt = SpeculativeDecoder(loaded, "none").encode("a b c a b c a b c a b")
    greedy = SamplingConfig(temperature=0)
    plain = VerispecSystem("verispec-plain", SpeculativeDecoder(loaded, "none"), 3).run(prompt, greedy, 24, 0)
    faulty = VerispecSystem("verispec-ngram", SpeculativeDecoder(loaded, FailsOnce()), 3).run(prompt, greedy, 24, 0)
    assert faulty.token_ids == plain.token_ids and plain.faults == ()
    assert len(faulty.faults) == 1 and "a commit fault" in faulty.faults[0]
    records = [Record("verispec-plain", 1, "qa", plain), Record("verispec-ngram", 1, "qa", faulty)]
    summary = summarize(records, greedy=True)
    assert summary["verispec-ngram"]["all"]["faults"] == 1 and summary["verispec-plain"]["all"]["faults"] == 0
    text = markdown(summary, ["qa"], {}, records)
    assert "verispec-ngram: 1 faults absorbed" in text and text.count("faults absorbed") == 1  # plain: none


def test_the_drafter_options_reach_the_systems_that_use_them(setup, monkeypatch):
    """`--ngram-max/--ngram-min`, `--suffix-capacity` and `--draft-lookup` reach verispec's prompt lookup, suffix
    decoding (alone and in the composite) and draft model systems (the bench read and dropped them)."""
    from verispec.bench import runner
    from verispec.bench.runner import build_systems
    from verispec.config import PromptLookupConfig

    _, target, draft, prompts, _ = setup
    seen = {}
    monkeypatch.setattr("verispec.bench.runner.run_bench", lambda config, **models: seen.update(config=config) or {})
    monkeypatch.setattr("verispec.cli.bench._show_bench_report", lambda report: 0)
    assert main(["bench", "--target", target, "--draft", draft, "--prompts", prompts, "--ngram-max", "5",
                 "--ngram-min", "2", "--suffix-capacity", "4096", "--draft-lookup", "3"]) == 0
    config = seen["config"]
    assert config.prompt_lookup == PromptLookupConfig(max_ngram=5, min_ngram=2)
    assert config.suffix.capacity == 4096 and config.draft_lookup == 3
    names = ("verispec-ngram", "verispec-suffix", "verispec-suffix-draft", "verispec-draft")
    systems = {s.name: s for s in build_systems(dataclasses.replace(config, systems=names, distilled=None),
                                                load_model(target), load_model(draft), None, None)}
    assert systems["verispec-ngram"].decoder.drafter.config == config.prompt_lookup
    assert systems["verispec-suffix"].decoder.drafter.config == config.suffix
    composite = systems["verispec-suffix-draft"].decoder.drafter
    assert composite.members[0].config == config.suffix and composite.members[1].lookup is not None
    assert systems["verispec-draft"].decoder.drafter.lookup is not None
    assert runner.BenchConfig().draft_lookup is None  # unset: each drafter keeps its own setting
    with pytest.raises(VerispecError, match="draft_lookup"):
        BenchConfig(draft_lookup=-1)


def test_the_suffix_systems_start_from_a_store_file_and_leave_it_as_it_was(setup, monkeypatch, tmp_path, capsys):
    """`--draft suffix:FILE` (alone or in a composite) reaches every suffix decoding system: each starts from its own
    copy of the file's outputs and the file is never written (the bench read the option and dropped it)."""
    from verispec.bench.runner import build_systems

    _, target, draft, prompts, _ = setup
    store = tmp_path / "outputs.suffix"
    assert main(["generate", "--target", target, "--draft", f"suffix:{store}", "--prompt", "write a loop",
                 "--temperature", "0", "--max-new-tokens", "12", "--json"]) == 0
    capsys.readouterr()
    kept = store.read_bytes()
    seen = {}
    monkeypatch.setattr("verispec.bench.runner.run_bench", lambda config, **models: seen.update(config=config) or {})
    monkeypatch.setattr("verispec.cli.bench._show_bench_report", lambda report: 0)
    assert main(["bench", "--target", target, "--draft", f"suffix:{store}+{draft}", "--prompts", prompts]) == 0
    config = dataclasses.replace(seen["config"], systems=("verispec-suffix", "verispec-suffix-draft"), distilled=None,
                                 per_category=1, max_new_tokens=8, out_dir=str(tmp_path / "out"))
    assert config.suffix_store == str(store)
    systems = {s.name: s for s in build_systems(config, load_model(target), load_model(draft), None, None)}
    alone = systems["verispec-suffix"].decoder.drafter
    member = systems["verispec-suffix-draft"].decoder.drafter.members[0]
    assert alone.store is not member.store and alone.writer is None and member.writer is None
    assert len(alone.store.documents) == len(member.store.documents) == 1  # generate's output
    prompt = systems["verispec-suffix"].decoder.encode("write a loop")
    systems["verispec-suffix"].run(prompt, SamplingConfig(temperature=0), 8, 0)
    alone.start([])  # the finished row joins this system's own store
    assert len(alone.store.documents) == 2 and len(member.store.documents) == 1
    assert store.read_bytes() == kept
    missing = str(tmp_path / "none.suffix")
    assert main(["bench", "--target", target, "--draft", f"suffix:{missing}", "--prompts", prompts]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1
