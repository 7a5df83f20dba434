"""Self-speculation (`--draft self`): skip sets, the draft's view of the target's cache, the reuse of its
full-layer prefix in verification, the on-the-fly choice of the skip set, the search, and exactness
(greedy equality for every mode and backend, chi-square under temperature / top-k / top-p)."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_model
from drafting import drafts_accepted
from tiny_gguf import T, gguf_from_hf
from verispec.chisquare import chi_square_test
from verispec.config import SamplingConfig, SelfDraftConfig, SpecConfig, TreeConfig
from verispec.drafters.self_retune import SkipChooser, SublayerCosts
from verispec.drafters.self_draft import SelfDrafter
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner
from verispec.models.runners.hf import ModelRunner
from verispec.models.skip import SkipFile, SkipSet, default_skip, fingerprint, resolve_skip
from verispec.models.runners.skipping import skipping_module
from verispec.selfspec.search import SelfTuneConfig, SkipSearch
from verispec.tuning import KTuner, measure_costs

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]
SETS = ["a1", "m2", "3-", "a1,m2", "2-", "h32", "m1,h48"]  # sublayers, early exits, small heads


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=64, seed=0, layers=4, sharpness=30.0)


@pytest.fixture(scope="module")
def native(model, tmp_path_factory):
    path = gguf_from_hf(model, tmp_path_factory.mktemp("self") / "t.gguf", T.Q8_0)
    return NativeRunner(load_gguf(path, show_progress=False))


def plain(runner, prompts=PROMPTS, tokens=30):
    return [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, GREEDY, SpecConfig(max_new_tokens=tokens))]


# ---------------------------------------------------------------- skip sets


def test_skip_sets_parse_print_and_read_back():
    skip = SkipSet.parse("a4-9,m12,20-,h32768", 28)
    assert skip.attention == frozenset(range(4, 10)) | frozenset(range(20, 28))
    assert skip.mlp == frozenset({12}) | frozenset(range(20, 28))
    assert skip.head == 32768 and skip.first == 4 and skip.size == 6 + 1 + 16
    assert SkipSet.parse(skip.text, 28) == skip
    assert SkipSet.early_exit(20, 28) == SkipSet.parse("20-", 28)
    assert list(SkipSet.parse("a1,m2,3", 4).bits()) == [0, 1, 2, 3]


@pytest.mark.parametrize("spec, fragment", [
    ("30", "names layer 30, but the model has 28 layers"),
    ("0-", "skips every layer"),
    ("x3", "is not a layer"),
    ("9-4", "empty range"),
    ("", "is not a skip set"),
    ("3,,4", "is not a skip set"),
    ("h100", "multiple of 16"),
])
def test_bad_skip_sets_are_one_clear_line(spec, fragment):
    with pytest.raises(VerispecError, match=fragment):
        SkipSet.parse(spec, 28)


def test_a_skip_file_round_trips_and_refuses_another_model(native, model, tmp_path):
    skip = SkipSet.parse("a1,m2,h32", 4)
    path = tmp_path / "skip.json"
    SkipFile(skip, "tiny", fingerprint(native), {"speedup": 1.0}).save(path)
    assert not list(tmp_path.glob("*.tmp"))
    assert resolve_skip(f"self:{path}", native, "tiny") == (skip, str(path))
    # The same weights on torch have the same fingerprint (it survives the format change).
    from verispec.models.skip import same_model

    assert same_model(fingerprint(ModelRunner(model)), fingerprint(native))
    other = NativeRunner(load_gguf(gguf_from_hf(tiny_model("llama", vocab=64, seed=5, layers=4), tmp_path / "o.gguf",
                                                T.Q8_0), show_progress=False))
    with pytest.raises(VerispecError, match="was made for another model"):
        resolve_skip(f"self:{path}", other, "other")
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(VerispecError, match="is not a skip file"):
        resolve_skip(f"self:{tmp_path / 'bad.json'}", native, "tiny")
    with pytest.raises(VerispecError, match="does not exist"):
        resolve_skip(f"self:{tmp_path / 'missing.json'}", native, "tiny")
    assert resolve_skip("self", native, "tiny")[1] == "default"
    assert default_skip(28).size > 0


# ---------------------------------------------------------------- the native runner's skipping and reuse


def test_a_skipped_pass_is_the_same_bits_fused_or_per_op_alone_or_batched(native):
    bits = SkipSet.parse("a1,m2,3-", 4).bits()
    per_op = NativeRunner(native.gguf, fused=False)
    outs = []
    for runner in (native, per_op):
        state = runner.new_state(2)
        outs.append(runner.forward(state, [PROMPTS[0], PROMPTS[1]], [3, 2], skip=bits))
    assert torch.equal(outs[0], outs[1])
    alone = native.forward(native.new_state(1), [PROMPTS[1]], [2], skip=bits)
    assert torch.equal(alone[0], outs[0][1, :2])
    full = native.forward(native.new_state(1), [PROMPTS[1]], [2])
    assert not torch.equal(alone[0], full[0])


def test_a_small_draft_head_gives_the_first_ids_logits_and_minus_infinity_above(native):
    full = native.forward(native.new_state(1), [PROMPTS[0]], [2])
    small = native.forward(native.new_state(1), [PROMPTS[0]], [2], head_rows=32)
    assert torch.equal(small[..., :32], full[..., :32]) and bool(torch.isinf(small[..., 32:]).all())


def test_verification_that_starts_at_the_drafts_first_skipped_layer_gives_the_same_bits(native):
    """A draft pass keeps its tokens' hidden states at the first skipped layer; the next full pass over the
    same queries starts there. Its logits must equal a pass that computes everything."""
    prompt, chain = PROMPTS[1], [5, 6, 7, 8]
    expected = native.forward(native.new_state(1), [prompt + chain], [len(chain) + 1])
    for spec in ("a2", "m1,3-", "h32"):
        state = native.new_state(1)
        native.forward(state, [prompt], [1])
        draft = SkipState_view(native, state, SkipSet.parse(spec, 4))
        native.forward(draft, [chain[:-1]], [1], skip=SkipSet.parse(spec, 4).bits())
        before = native.resumed_tokens
        out = native.forward(state, [chain], [len(chain)])
        assert native.resumed_tokens - before == len(chain) - 1
        assert torch.equal(out[0], expected[0, 1:])


def SkipState_view(runner, state, skip):
    from verispec.models.runners.skipping import SkipRunner

    return SkipRunner(runner, skip).view(state, [skip])


def test_a_rejected_draft_leaves_the_targets_cache_as_it_was(native):
    """The draft writes only past the target's committed length; the committed columns and lengths stay."""
    drafter = SelfDrafter(native, SkipSet.parse("a1,m2", 4))
    engine = SpeculativeEngine(native, drafter, set())
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, SamplingConfig(temperature=1.0), SpecConfig(num_draft_tokens=4), 3))
    for _ in range(3):
        engine.step(batch)
    rows = batch.state.rows
    lengths = [r.length for r in rows]
    committed = [(r.keys[:, :, : r.length].copy(), r.values[:, :, : r.length].copy()) for r in rows]
    drafts = drafter.propose(batch.sequences, [4] * len(rows))
    assert any(len(d) for d in drafts)
    drafter.commit(batch.sequences, drafts, [()] * len(rows))  # every draft rejected
    assert [r.length for r in rows] == lengths
    for r, (keys, values) in zip(rows, committed):
        assert np.array_equal(r.keys[:, :, : r.length], keys) and np.array_equal(r.values[:, :, : r.length], values)


# ---------------------------------------------------------------- greedy equality, every mode


@pytest.mark.parametrize("spec", SETS)
def test_greedy_self_speculation_equals_plain_decoding_native(native, spec):
    expected = plain(native)
    for config in (SelfDraftConfig(), SelfDraftConfig(retune=True, gap=1, trial_steps=1)):
        drafter = SelfDrafter(native, SkipSet.parse(spec, 4), config)
        engine = SpeculativeEngine(native, drafter, set())
        chains = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30))
        trees = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30,
                                                            tree=TreeConfig(shape=(2, 2, 1))))
        assert [s.generated for s in chains] == expected == [s.generated for s in trees]
        for runs in (chains, trees):
            drafts_accepted(runs)


def test_greedy_self_speculation_with_auto_k_and_lookup_first_equals_plain(native, monkeypatch):
    from verispec import tuning
    from verispec.config import PromptLookupConfig

    drafter = SelfDrafter(native, SkipSet.parse("a1,m2", 4), lookup=PromptLookupConfig(max_ngram=3, min_ngram=2))
    engine = SpeculativeEngine(native, drafter, set())
    monkeypatch.setattr(tuning, "_timed", lambda fn, repeats: fn() or 1.0)  # run each pass once; no clock
    measured = measure_costs(native, drafter.runner, k_max=4, repeats=1)
    assert measured.draft_token == 1.0  # its cost c is measured like a draft model's: its runner's pass ran
    # K from costs in which drafting pays, fixed: measured on a busy CPU they may turn drafting off
    tuner = KTuner(tuning.CostProfile({w: 1.0 for w in range(1, 6)}, draft_token=0.05), learn_costs=False)
    out = engine.generate(PROMPTS, GREEDY, SpecConfig(max_new_tokens=30), tuner=tuner)
    assert [s.generated for s in out] == plain(native)
    drafts_accepted(out)


@pytest.mark.parametrize("spec", ["a1,3-", "m0,h32"])
def test_greedy_self_speculation_equals_plain_decoding_torch(model, spec):
    runner = ModelRunner(model)
    expected = plain(runner)
    drafter = SelfDrafter(runner, SkipSet.parse(spec, 4))
    engine = SpeculativeEngine(runner, drafter, set())
    for tree in (None, TreeConfig(shape=(2, 2, 1))):
        out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
        assert [s.generated for s in out] == expected
        drafts_accepted(out)
    with pytest.raises(VerispecError, match="needs the native runner"):
        SelfDrafter(runner, SkipSet.parse(spec, 4), SelfDraftConfig(retune=True))


def test_the_torch_skipping_module_shares_the_targets_weights(model):
    skipped = skipping_module(model, SkipSet.parse("a1,m2,h32", 4))
    assert {p.data_ptr() for p in skipped.parameters()} <= {p.data_ptr() for p in model.parameters()}
    assert model.model.layers[1].__class__.__name__ == "LlamaDecoderLayer"  # the target is untouched


def test_seeded_self_speculation_re_tuned_online_is_the_same_alone_or_batched(native):
    drafter = SelfDrafter(native, SkipSet.parse("a1,m2", 4), SelfDraftConfig(retune=True, gap=1, trial_steps=1))
    engine = SpeculativeEngine(native, drafter, set())
    sampling, spec = SamplingConfig(temperature=1.0, top_k=20), SpecConfig(num_draft_tokens=3, max_new_tokens=24)
    batch = engine.generate(PROMPTS, sampling, spec, seeds=[11, 12, 13])
    for prompt, seed, seq in zip(PROMPTS, [11, 12, 13], batch):
        assert engine.generate([prompt], sampling, spec, seeds=[seed])[0].generated == seq.generated


# ---------------------------------------------------------------- exactness under sampling


def second_token_distribution(runner, prompt, sampling):
    """p(token 2) = sum over t1 of p(t1) p(token 2 | t1), with the target's processed distributions."""
    from verispec.sampling import logits_to_probs

    first = logits_to_probs(runner.forward(runner.new_state(1), [prompt], [1])[:, 0], sampling)[0]  # (V,)
    total = torch.zeros_like(first)
    for t1 in range(first.numel()):
        if first[t1] > 0:
            after = runner.forward(runner.new_state(1), [prompt + [t1]], [1])[:, 0]
            total += first[t1] * logits_to_probs(after, sampling)[0]
    return total  # (V,)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    model = tiny_model("qwen2", vocab=8, seed=3, layers=4, sharpness=4.0)
    path = gguf_from_hf(model, tmp_path_factory.mktemp("small") / "t.gguf", T.Q8_0)
    return NativeRunner(load_gguf(path, show_progress=False))


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4),
                                      SamplingConfig(temperature=1.2, top_p=0.8)], ids=["temperature", "top-k", "top-p"])
def test_sampled_self_speculation_follows_the_targets_distribution(small, sampling):
    """Chi-square on the second generated token (the first comes from the step that reads the prompt), with a
    fixed skip set, a searched one and the on-the-fly choice."""
    prompt = [1, 2, 3]
    p = second_token_distribution(small, prompt, sampling)
    searched = SkipSearch(small, [prompt, [4, 5, 6]], SelfTuneConfig(tokens=6, heads=(None,), repeats=1, finalists=1,
                                                                     k_values=(2,)), show_progress=False).run()
    modes = [(SkipSet.parse("a1,m2", 4), SelfDraftConfig()),
             (SkipSet.parse(searched["skip"], 4), SelfDraftConfig()),
             (SkipSet.parse("2-", 4), SelfDraftConfig(retune=True, gap=0, trial_steps=1))]
    for skip, config in modes:
        engine = SpeculativeEngine(small, SelfDrafter(small, skip, config), set())
        counts = torch.zeros(8)
        drafted = 0
        for seed in range(500):
            seq = engine.generate([prompt], sampling, SpecConfig(num_draft_tokens=3, max_new_tokens=4), seeds=[seed])[0]
            counts[seq.generated[1]] += 1
            drafted += seq.stats.draft_tokens
        assert drafted > 0
        assert chi_square_test(counts, p).p_value > 1e-3, (skip.text, config)


# ---------------------------------------------------------------- the on-the-fly choice and the search


def test_the_chooser_keeps_a_challenger_that_is_accepted_more():
    costs = SublayerCosts((1.0,) * 4, (8.0,) * 4, 10.0, 64)
    chooser = SkipChooser(SkipSet.parse("a1", 4), costs, SelfDraftConfig(retune=True, trial_steps=2, gap=1))
    start = chooser.incumbent
    for _ in range(12):
        skip = chooser.choose()
        accepted = 3 if skip != start else 0  # every challenger beats the starting set
        chooser.observe(3, accepted)
    assert chooser.switches >= 1 and chooser.incumbent != start
    # The choice depends only on what it observed: the same observations, the same choices.
    again = SkipChooser(SkipSet.parse("a1", 4), costs, SelfDraftConfig(retune=True, trial_steps=2, gap=1))
    for _ in range(12):
        skip = again.choose()
        again.observe(3, 3 if skip != start else 0)
    assert again.incumbent == chooser.incumbent


def test_the_search_reports_measured_numbers_and_its_choice_decodes_exactly(native, tmp_path):
    report = SkipSearch(native, PROMPTS[:2], SelfTuneConfig(tokens=10, heads=(None, 32), repeats=1, finalists=2,
                                                            k_values=(2, 3)), show_progress=False).run()
    skip = SkipSet.parse(report["skip"], 4)
    assert skip.size > 0 or skip.head is not None
    assert report["best"]["tokens_per_second"] > 0 and report["plain_tokens_per_second"] > 0
    assert len(report["single_sublayer_agreement_drop"]) == 8
    assert {f["k"] for f in report["finalists"]} == {2, 3}
    assert all(0 <= t["agreement"] <= 1 and t["c"] > 0 for t in report["screened"])
    with pytest.raises(VerispecError, match="native runner"):
        SkipSearch(object(), PROMPTS, SelfTuneConfig())


# ---------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_hf import save_tiny_model_dir

    return str(save_tiny_model_dir(tmp_path_factory.mktemp("models") / "target", "llama", seed=0))


def test_draft_self_on_the_command_line_equals_plain_decoding(model_dir, capsys):
    from verispec.cli import main

    common = ["generate", "--json", "--no-auto-k", "--target", model_dir, "--prompt", "hello there", "--temperature",
              "0", "--max-new-tokens", "16"]
    outputs = {}
    for draft in ("none", "self:a1", "self"):
        assert main([*common, "--draft", draft]) == 0
        captured = capsys.readouterr()
        outputs[draft] = json.loads(captured.out)
    assert outputs["self:a1"]["token_ids"] == outputs["none"]["token_ids"] == outputs["self"]["token_ids"]
    assert outputs["self:a1"]["draft"] == "self:a1" and outputs["self:a1"]["stats"]["draft_tokens"] > 0
    assert "untuned default skip set" in captured.err


@pytest.mark.parametrize("draft, extra, fragment", [
    ("self:5", [], "names layer 5, but the model has 2 layers"),
    ("self:0-", [], "skips every layer"),
    ("self:a1,q", [], "is not a layer"),
    ("self:{other}", [], "was made for another model"),
    ("self:{missing}", [], "does not exist"),
    ("self:a1", ["--self-retune"], "needs the native runner"),
])
def test_bad_self_drafts_are_one_line_and_exit_status_2(model_dir, tmp_path, capsys, native, draft, extra, fragment):
    from verispec.cli import main

    other = tmp_path / "other.json"
    SkipFile(SkipSet.parse("a1", 4), "tiny", fingerprint(native)).save(other)
    draft = draft.format(other=other, missing=tmp_path / "missing.json")
    code = main(["generate", "--target", model_dir, "--prompt", "hi", "--max-new-tokens", "4", "--draft", draft, *extra])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_self_tune_refuses_a_target_the_native_runner_cannot_run(model_dir, capsys, tmp_path):
    from verispec.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\n")
    code = main(["self-tune", "--target", model_dir, "--prompts", str(prompts), "--out", str(tmp_path / "s.json")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not (tmp_path / "s.json").exists()


def test_the_server_batches_self_drafted_requests_as_it_answers_them_alone(tmp_path):
    """Continuous batching with the self drafter on the native runner (skip sets chosen per row on the fly):
    requests answered together get the texts they get alone, greedy and seeded."""
    from test_serve import assert_served_together_as_alone
    from tiny_hf import save_tiny_model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verispec import SpeculativeDecoder
    from verispec.models.loading import LoadedModel

    folder = save_tiny_model_dir(tmp_path / "tiny", "llama", seed=0)
    path = gguf_from_hf(AutoModelForCausalLM.from_pretrained(str(folder)), tmp_path / "tiny.gguf", T.Q8_0)
    target = LoadedModel("target", None, AutoTokenizer.from_pretrained(str(folder)), str(path), weights="gguf",
                         backend="native", gguf=load_gguf(path, show_progress=False))
    decoder = SpeculativeDecoder(target, "self:a1", self_draft=SelfDraftConfig(retune=True, gap=1, trial_steps=1))
    assert_served_together_as_alone(decoder)


def test_a_runner_that_cannot_skip_sublayers_is_one_clear_line():
    class LlamaCppRunner:  # llama.cpp runs the whole model in one call: nothing to skip from outside
        vocab_size = 64

    with pytest.raises(VerispecError, match="'LlamaCppRunner' runner cannot"):
        SelfDrafter(LlamaCppRunner(), SkipSet.parse("a1", 4))
