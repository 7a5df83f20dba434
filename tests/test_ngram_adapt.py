"""Online adaptation: what the buffer keeps, that adapting really changes the drafter and raises
acceptance (n-grams, dense and int8 draft models), that the target's output distribution is unchanged
with adaptation on (seeded chi-square), that a concurrent update never changes a step's drafts, and
the --adapt wiring of generate, serve and bench."""

import threading
import time
from dataclasses import replace

import httpx
import pytest
import torch
from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from test_exactness import PROMPT, THRESHOLD, V, check_distribution
from test_ngram import random_table, table_from
from tiny_hf import save_tiny_model_dir

from verispec import SamplingConfig, SpecConfig, SpeculativeDecoder
from verispec.adapt import AdaptationBuffer, AdaptExample, OnlineAdapter
from verispec.cli import main
from verispec.config import AdaptConfig, NGramConfig, PromptLookupConfig, TreeConfig
from verispec.serve.config import ServeConfig
from verispec.core.drafter import Draft
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.ngram_corpus import CorpusNGramDrafter
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.quantized import Int8Linear, quantize_linear_layers
from verispec.models.runners.hf import ModelRunner
from verispec.rejection import Verdict

SYNC = AdaptConfig(background=False, min_examples=1)
GREEDY = SamplingConfig(temperature=0)


class FakeSeq:
    def __init__(self, tokens):
        self.tokens = tokens


def test_buffer_keeps_the_first_rejected_position_and_the_target_top_k():
    buffer = AdaptationBuffer(AdaptConfig(top_k=2, max_context=4))
    p = torch.tensor([[0.1, 0.9, 0.0, 0.0], [0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0], [0.25] * 4])  # (n + 1, V)
    draft = Draft(torch.tensor([1, 3, 2]))
    buffer(FakeSeq([7, 8, 9, 10, 11]), draft, p, Verdict((0,), 0, bonus=False), None)  # x_2 = 3 rejected
    buffer(FakeSeq([7]), draft, p, Verdict((0, 1, 2), 1, bonus=True), None)  # all accepted: nothing to learn
    buffer(FakeSeq([5, 6]), Draft(torch.zeros(0, dtype=torch.long)), p, Verdict((), 1, bonus=True), None)  # no draft
    examples = buffer.drain()
    assert len(buffer) == 0 and buffer.collected == 2
    assert examples[0] == AdaptExample((9, 10, 11, 1), (0, 2), (pytest.approx(0.5), pytest.approx(0.3)))
    assert examples[1].context == (5, 6) and examples[1].tokens == (1, 0)  # position 0 of an empty draft
    quiet = AdaptationBuffer(AdaptConfig(include_undrafted=False))
    quiet(FakeSeq([5, 6]), Draft(torch.zeros(0, dtype=torch.long)), p, Verdict((), 1, bonus=True), None)
    assert len(quiet) == 0


def test_buffer_learning_from_all_keeps_every_settled_position():
    """learn_from="all": the accepted drafts' positions and the stopping position, each after its own prefix;
    rows after the first rejection (conditioned on a rejected token) are never kept."""
    buffer = AdaptationBuffer(AdaptConfig(top_k=1, max_context=4, learn_from="all"))
    p = torch.tensor([[0.1, 0.9, 0.0, 0.0], [0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0], [0.25, 0.3, 0.2, 0.25]])  # (n + 1, V)
    draft = Draft(torch.tensor([1, 3, 2]))
    buffer(FakeSeq([7, 8, 9, 10, 11]), draft, p, Verdict((0,), 0, bonus=False), None)  # x_1 = 1 accepted, x_2 = 3 rejected
    buffer(FakeSeq([7]), draft, p, Verdict((0, 1, 2), 1, bonus=True), None)  # all accepted: four positions, the bonus's too
    contexts = [(ex.context, ex.tokens) for ex in buffer.drain()]
    assert contexts == [((8, 9, 10, 11), (1,)), ((9, 10, 11, 1), (0,)),
                        ((7,), (1,)), ((7, 1), (0,)), ((7, 1, 3), (3,)), ((7, 1, 3, 2), (1,))]
    with pytest.raises(VerispecError, match="learn_from"):
        AdaptConfig(learn_from="everything")


@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(2, 2, 1))])
def test_buffer_learning_from_all_labels_every_output_position(greedy_pair, tree):
    """Through the engine, chains and trees: one example per generated token, labelled with that token."""
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    buffer = AdaptationBuffer(AdaptConfig(learn_from="all"))
    engine.observers.append(buffer)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30, stop_at_eos=False, tree=tree)
    seq = engine.generate([[1, 2, 3, 4]], GREEDY, spec)[0]
    examples = buffer.drain()
    assert seq.stats.accepted_tokens > 0
    assert [len(ex.context) for ex in examples][: len(seq.generated)] == list(range(4, 4 + len(seq.generated)))
    for ex in examples:  # the last step's bonus / recovered position may lie past max_new_tokens
        assert ex.probs == (1.0,) and tuple(seq.tokens[: len(ex.context)]) == ex.context
        if len(ex.context) < len(seq.tokens):
            assert seq.tokens[len(ex.context)] == ex.tokens[0]


def test_buffer_sees_what_the_engine_verified(greedy_pair):
    """Through the engine at temperature 0: each example is one-hot at the token the target emitted there."""
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    buffer = AdaptationBuffer(AdaptConfig(include_undrafted=False))
    engine.observers.append(buffer)
    seq = engine.generate([[1, 2, 3, 4]], GREEDY, SpecConfig(num_draft_tokens=4, max_new_tokens=30, stop_at_eos=False))[0]
    examples = buffer.drain()
    assert len(examples) == seq.stats.recovered_tokens > 0
    for ex in examples:
        assert ex.probs == (1.0,)
        assert seq.tokens[len(ex.context)] == ex.tokens[0] and tuple(seq.tokens[: len(ex.context)]) == ex.context


def test_buffer_sees_tree_steps(greedy_pair):
    """Tree steps feed the buffer too: the context ends with the accepted path, the label is the target's next token."""
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    buffer = AdaptationBuffer(AdaptConfig(include_undrafted=False))
    engine.observers.append(buffer)
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30, stop_at_eos=False, tree=TreeConfig(shape=(2, 2, 1)))
    seq = engine.generate([[1, 2, 3, 4]], GREEDY, spec)[0]
    examples = buffer.drain()
    assert len(examples) == seq.stats.recovered_tokens > 0
    for ex in examples:
        assert ex.probs == (1.0,)
        assert seq.tokens[len(ex.context)] == ex.tokens[0] and tuple(seq.tokens[: len(ex.context)]) == ex.context


def test_ngram_adaptation_with_trees_raises_acceptance(greedy_pair):
    target = greedy_pair[0]
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=48, stop_at_eos=False, tree=TreeConfig(budget=8, top_k=2))
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    plain = SpeculativeEngine(ModelRunner(target), None, set()).generate(prompts, GREEDY, replace(spec, tree=None))
    drafter = CorpusNGramDrafter(table_from([list(range(64)) * 3], vocab_size=64), 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, SYNC)
    rates = []
    for _ in range(3):
        seqs = engine.generate(prompts, GREEDY, spec)
        assert [s.generated for s in seqs] == [s.generated for s in plain]
        rates.append(sum(s.stats.accepted_tokens for s in seqs) / sum(s.stats.target_forward_passes for s in seqs))
        adapter.adapt_now()
    assert min(rates[1:]) > rates[0] + 0.2  # accepted tokens per target pass rise


def acceptance(seqs) -> float:
    return sum(s.stats.accepted_tokens for s in seqs) / max(1, sum(s.stats.draft_tokens for s in seqs))


def test_ngram_adaptation_raises_acceptance_on_a_repeated_stream(greedy_pair):
    target = greedy_pair[0]
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=48, stop_at_eos=False)
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    plain = SpeculativeEngine(ModelRunner(target), None, set()).generate(prompts, GREEDY, spec)
    table = table_from([list(range(64)) * 3], vocab_size=64)  # a corpus that says little about this target
    fixed = SpeculativeEngine(ModelRunner(target), CorpusNGramDrafter(table, 64), set())
    drafter = CorpusNGramDrafter(table, 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, SYNC)
    rates, control = [], []
    for _ in range(3):
        seqs = engine.generate(prompts, GREEDY, spec)
        assert [s.generated for s in seqs] == [s.generated for s in plain]
        rates.append(acceptance(seqs))
        adapter.adapt_now()
        control.append(acceptance(fixed.generate(prompts, GREEDY, spec)))
    assert adapter.updates == 3 and drafter.examples_learned > 0 and len(drafter.model.adapted) > 0
    assert control[0] == control[1] == control[2] == rates[0]  # without adapting nothing changes
    assert min(rates[1:]) > rates[0] + 0.2


@pytest.mark.parametrize("int8", [False, True], ids=["dense", "int8"])
def test_draft_model_adaptation_raises_acceptance(greedy_pair, int8):
    target = greedy_pair[0]
    draft = noisy_copy(target, 1.0)
    if int8 and not quantize_linear_layers(draft):
        pytest.skip("this CPU has no int8 kernel")
    drafter = DraftModelDrafter(ModelRunner(draft), 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, lr=3e-3, batch_size=8, max_steps=8))
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=40, stop_at_eos=False)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    plain = SpeculativeEngine(ModelRunner(target), None, set()).generate(prompts, GREEDY, spec)
    rates = []
    for _ in range(5):
        seqs = engine.generate(prompts, GREEDY, spec)
        assert [s.generated for s in seqs] == [s.generated for s in plain]
        rates.append(acceptance(seqs))
        adapter.adapt_now()
    assert drafter.runner.model is not draft  # new weights were swapped in
    assert any(isinstance(m, Int8Linear) for m in drafter.runner.model.modules()) == int8  # same serving format
    assert max(rates[2:]) > rates[0] + 0.2


def sample_adapting(engine, adapter, sampling, K, n=3000, seed=0, draft_stop=0.0):
    """Like test_exactness.sample_tokens, stepping the batch by hand and adapting between steps."""
    spec = SpecConfig(num_draft_tokens=K, max_new_tokens=max(3, K + 1), stop_at_eos=False, draft_stop=draft_stop)
    seqs = engine.make_sequences([PROMPT] * n, sampling, spec, seed)
    batch = DecodeBatch(engine)
    batch.add(seqs)
    while batch:
        engine.step(batch)
        adapter.adapt_now()
    return [tuple(s.generated[:3]) for s in seqs], seqs


@pytest.fixture(scope="module")
def target():
    return tiny_model("qwen2", vocab=V, seed=3, sharpness=4.0)


@pytest.mark.parametrize("K", [1, 3])
def test_chi_square_with_ngram_adaptation_on(target, K):
    sampling = SamplingConfig(temperature=1.0)
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    before = drafter.candidates(PROMPT, V)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, SYNC)
    samples, seqs = sample_adapting(engine, adapter, sampling, K)
    assert adapter.updates >= 2 and drafter.candidates(PROMPT, V) != before  # q really changed between steps
    assert 0 < sum(s.stats.accepted_tokens for s in seqs) < sum(s.stats.draft_tokens for s in seqs)
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_chi_square_with_draft_model_adaptation_on(target, sampling_pair):
    sampling = SamplingConfig(temperature=0.9, top_k=6)
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, lr=1e-2, batch_size=32, max_steps=4))
    samples, _ = sample_adapting(engine, adapter, sampling, 1)
    assert adapter.updates >= 2 and drafter.runner.model is not sampling_pair[1]
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def test_chi_square_with_draft_model_adaptation_and_stopping_chains(target, sampling_pair):
    """Both change only what the draft proposes: the weights between steps (adaptation) and where each chain
    stops (calibrated on earlier outcomes, with lookup-first copies); together they still sample from p."""
    sampling = SamplingConfig(temperature=0.9, top_k=6)
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V, lookup=PromptLookupConfig(max_ngram=2, min_ngram=1))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(background=False, min_examples=1, lr=1e-2, batch_size=32, max_steps=4))
    samples, seqs = sample_adapting(engine, adapter, sampling, 3, draft_stop=0.4)
    drafted = sum(s.stats.draft_tokens for s in seqs)
    assert adapter.updates >= 2 and drafter.runner.model is not sampling_pair[1]
    assert 0 < drafted < 3 * sum(s.stats.target_forward_passes for s in seqs)  # chains stopped early
    assert drafter.calibration.counts
    for fit in check_distribution(target, samples, sampling):
        assert fit.p_value > THRESHOLD, fit


def concurrent_update_during(obj, name, update):
    """Patch obj.name so that its first call runs `update` to completion in another thread first."""
    original = getattr(obj, name)
    fired = []

    def patched(*args, **kwargs):
        if not fired:
            fired.append(True)
            thread = threading.Thread(target=update)
            thread.start()
            thread.join()
        return original(*args, **kwargs)

    setattr(obj, name, patched)
    return fired


def proposals(drafter, engine, seed):
    seqs = engine.make_sequences([PROMPT] * 20, SamplingConfig(temperature=1.0), SpecConfig(num_draft_tokens=3), seed)
    drafter.start(seqs)
    return drafter.propose(seqs, [3] * 20)


def same_drafts(a, b) -> bool:
    return all(torch.equal(x.tokens, y.tokens) and (x.q is None) == (y.q is None) and (x.q is None or torch.equal(x.q, y.q))
               for x, y in zip(a, b))


def test_an_update_from_another_thread_never_changes_a_step_in_progress(target, sampling_pair):
    # n-grams: examples arriving mid-propose wait for the next propose.
    drafter = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    reference = CorpusNGramDrafter(random_table(), V, NGramConfig(max_n=3))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    examples = [AdaptExample(tuple(PROMPT), (t,), (1.0,)) for t in range(V)] * 5
    fired = concurrent_update_during(drafter.model, "distribution", lambda: drafter.adapt(examples))
    drafts = proposals(drafter, engine, seed=5)
    assert fired and same_drafts(drafts, proposals(reference, engine, seed=5))
    assert not same_drafts(proposals(drafter, engine, seed=5), drafts)  # the next step sees the update
    # Draft model: retrained weights finished mid-propose are swapped in only at the next propose.
    draft = sampling_pair[1]
    drafter = DraftModelDrafter(ModelRunner(draft), V)
    reference = DraftModelDrafter(ModelRunner(draft), V)
    drafter.check_adaptable(AdaptConfig(lr=1e-1, max_steps=4))
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    fired = concurrent_update_during(drafter.runner, "forward", lambda: drafter.adapt(examples))
    drafts = proposals(drafter, engine, seed=6)
    assert fired and drafter.runner.model is draft and same_drafts(drafts, proposals(reference, engine, seed=6))
    proposals(drafter, engine, seed=6)
    assert drafter.runner.model is not draft


def test_background_adapter_updates_between_prompts_and_stops(greedy_pair):
    target = greedy_pair[0]
    drafter = CorpusNGramDrafter(None, 64)
    engine = SpeculativeEngine(ModelRunner(target), drafter, set())
    adapter = OnlineAdapter(engine, AdaptConfig(min_examples=1))
    spec = SpecConfig(num_draft_tokens=4, max_new_tokens=24, stop_at_eos=False)
    plain = SpeculativeEngine(ModelRunner(target), None, set()).generate([[3, 1, 4]], GREEDY, spec)[0]
    deadline = time.monotonic() + 60
    while adapter.updates == 0 and time.monotonic() < deadline:
        assert engine.generate([[3, 1, 4]], GREEDY, spec)[0].generated == plain.generated
        adapter.poke()
        time.sleep(0.05)
    assert adapter.updates >= 1 and adapter.last_error is None
    seq = engine.generate([[3, 1, 4]], GREEDY, spec)[0]  # a table learned from the answers: drafts, still plain's
    assert seq.generated == plain.generated
    drafts_accepted([seq])
    adapter.close()
    assert not adapter._thread.is_alive() and adapter.buffer not in engine.observers


# --- wiring --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt_models")
    target = save_tiny_model_dir(root / "target", "llama", seed=0)
    draft = save_tiny_model_dir(root / "draft", "llama", seed=3)
    text = root / "corpus.txt"
    text.write_text("hello there, hello world. the cat sat on the mat.\n" * 3)
    table = root / "chars.ngram"
    assert main(["ngram", "build", "--tokenizer", str(target), "--corpus", str(text), "--out", str(table)]) == 0
    return str(target), str(draft), str(table)


def test_cli_generate_adapt(model_dirs, capsys):
    import json

    target, _, table = model_dirs
    common = ["generate", "--target", target, "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "30",
              "-k", "3"]  # fixed K: --auto-k's measured costs could turn drafting off on a busy CPU
    assert main([*common, "--draft", table, "--adapt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["adaptation"]["collected"] > 0 and out["adaptation"]["updates"] > 0
    assert main([*common, "--draft", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    drafts_accepted([out])
    for draft_spec, message in [("ngram", "'ngram' cannot"), ("none", "'none' cannot")]:
        assert main([*common, "--draft", draft_spec, "--adapt"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err


def test_packed_draft_weights_are_refused_for_adaptation(model_dirs):
    target, draft, _ = model_dirs
    decoder = SpeculativeDecoder.load(target, draft, draft_weights="packed")
    if decoder.draft_weights != "packed":
        pytest.skip("this CPU cannot pack weights")
    with pytest.raises(VerispecError, match="packed"):
        decoder.enable_adaptation()


def test_serve_adapts_while_idle_and_answers_stay_the_same(model_dirs):
    from verispec.serve.server import BackgroundServer

    target, _, table = model_dirs
    decoder = SpeculativeDecoder.load(target, f"ngram-corpus:{table}")
    expected = SpeculativeDecoder.load(target, "none").generate("hello", GREEDY, SpecConfig(max_new_tokens=20), chat=False)
    decoder.enable_adaptation(AdaptConfig(min_examples=1))
    with BackgroundServer(decoder, ServeConfig(port=0, max_batch_size=2)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):
            body = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "temperature": 0}).json()
            assert body["choices"][0]["text"] == expected.text
        def gauge(name: str) -> float:
            line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith(name + " "))
            return float(line.split()[-1])

        deadline = time.monotonic() + 60
        while gauge("verispec_adaptation_updates") == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gauge("verispec_adaptation_updates") >= 1 and gauge("verispec_adaptation_failed") == 0
        assert client.get("/health").json() == {"status": "ok"}  # nothing internal there
        body = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 20, "temperature": 0}).json()
        assert body["choices"][0]["text"] == expected.text
        drafts_accepted([body["usage"]["speculative"]])
    assert not decoder.adapter._thread.is_alive()  # stopped with the server


def test_draft_learning_rate_follows_the_draft_size_unless_given():
    assert AdaptConfig().draft_lr(12_600_000) == 3e-4  # a distilled draft
    assert AdaptConfig().draft_lr(494_000_000) == 1e-5  # a pre-trained 0.5B draft
    assert AdaptConfig(lr=2e-3).draft_lr(494_000_000) == 2e-3
    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(VerispecError, match="lr must be > 0"):
            AdaptConfig(lr=bad)


def test_replay_revisits_earlier_examples_beside_the_new_ones(sampling_pair):
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V)
    drafter.check_adaptable(AdaptConfig(lr=1e-3, batch_size=64, max_steps=4, replay=3))
    first = [AdaptExample(tuple(PROMPT), (t,), (1.0,)) for t in range(5)]
    second = [AdaptExample(tuple(PROMPT) + (1,), (t,), (1.0,)) for t in range(4)]
    drafter.adapt(first)
    seen: list = []
    trainer = drafter.trainer
    original = trainer.loss
    trainer.loss = lambda batch: seen.append(list(batch)) or original(batch)
    drafter.adapt(second)
    visited = [ex for batch in seen for ex in batch]
    assert all(ex in visited for ex in second)
    old = [ex for ex in visited if ex in first]
    assert len(old) == 3 and len(set(old)) == 3  # `replay` earlier examples, each once, drawn from the history
    assert len(visited) == 7
    with pytest.raises(VerispecError, match="replay must be an integer >= 0"):
        AdaptConfig(replay=-1)


def test_examples_along_one_output_share_a_row_and_keep_their_loss(sampling_pair):
    """The training loss packs prefix contexts into one row: same loss as one row per example, fewer rows."""
    from verispec.drafters.draft_adapt import shared_rows

    contexts = [(1, 2, 3), (1, 2), (4, 5), (1, 2, 3, 6), (4,), (1, 7)]
    carriers, rows = shared_rows(contexts)
    assert carriers == [(1, 2, 3, 6), (4, 5), (1, 7)] and rows == [0, 0, 1, 0, 1, 2]
    drafter = DraftModelDrafter(ModelRunner(sampling_pair[1]), V)
    drafter.check_adaptable(AdaptConfig(lr=1e-3))
    drafter.adapt([AdaptExample(tuple(PROMPT), (0,), (1.0,))])  # makes the trainer
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, V, (40,), generator=gen).tolist()
    batch = [AdaptExample(tuple(stream[:n]), (stream[n], 3), (0.7, 0.3)) for n in (5, 9, 17, 30, 39)]
    batch += [AdaptExample((2, 4, 6), (1,), (1.0,))]  # a context of its own
    loss = drafter.trainer.loss(batch)
    alone = torch.stack([drafter.trainer.loss([ex]) for ex in batch]).mean()
    torch.testing.assert_close(loss, alone, rtol=1e-4, atol=1e-5)
    assert len(shared_rows([ex.context for ex in batch])[0]) == 2
