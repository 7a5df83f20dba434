"""The step's batched verification (`verispec.step`): the greedy chain rows of a batch verified from one argmax over
the pass give the verdicts `rejection.verify_greedy` gives each row alone, a row whose logits cannot be read fails
alone, and the engine and the batch do not import each other, not even for types."""

import torch

from test_layers import cycles, package_graph
from verispec.batch import DecodeBatch
from verispec.config import SamplingConfig, SpecConfig
from verispec.core.drafter import PLAIN, Draft, PlainDrafter
from verispec.core.sequence import Sequence
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runners.hf import ModelRunner
from verispec.rejection import verify_greedy
from verispec.sampling import greedy_tokens
from verispec.step import StepRules

GREEDY = SamplingConfig(temperature=0)
SPEC = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12], [3], [20, 21, 22, 20, 21]]


def decode_all(engine, batch):
    """PROMPTS added to the batch and stepped to the end: the finished sequences by index."""
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = {}
    while batch:
        for _, seq in engine.step(batch):
            if seq.finish_reason is not None:
                done[seq.index] = seq
    return done


def test_batched_verdicts_equal_each_rows_own_verdict_ties_included():
    gen = torch.Generator().manual_seed(0)
    rows, vocab, width = 6, 40, 6
    # small integer logits: many rows hold ties, which both paths must break the same way (the first largest id)
    logits = torch.randint(-3, 3, (rows, width, vocab), generator=gen).float()  # (B, M, V)
    drafts, sequences = [], []
    for b in range(rows):
        n = b % width  # drafts of 0 .. 5 tokens
        best = logits[b, :n].argmax(-1)  # (n,) the target's argmax: drafts that match it for a while
        tokens = best.clone()
        if n and b % 2:
            tokens[n // 2] = (tokens[n // 2] + 1) % vocab  # a rejection half way
        drafts.append(Draft(tokens))
        sequences.append(Sequence(b, [1], 1, GREEDY, torch.Generator(), 16, SPEC))
    rules = StepRules(set())
    assert all(rules.batched(s, d) for s, d in zip(sequences, drafts))
    together = rules.verify_rows(list(range(rows)), sequences, drafts, logits)
    for b in range(rows):
        alone = verify_greedy(greedy_tokens(logits[b, : len(drafts[b]) + 1], GREEDY), drafts[b])
        assert together[b] == alone
        assert rules.verify_one(sequences[b], drafts[b], logits[b, : len(drafts[b]) + 1]) == alone
    assert {together[b].num_accepted for b in range(rows)} != {0}  # the check saw acceptances


def test_a_row_whose_logits_hold_nan_is_left_out_and_fails_alone_in_a_batch(greedy_pair, monkeypatch):
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    expected = {i: engine.generate([p], GREEDY, SPEC)[0].generated for i, p in enumerate(PROMPTS)}
    rows = [0, 1]
    logits = torch.zeros(2, 3, 8)
    logits[1, 1, 2] = float("nan")
    seqs = [Sequence(b, [1], 1, GREEDY, torch.Generator(), 16, SPEC) for b in rows]
    verdicts = engine.rules.verify_rows(rows, seqs, [Draft(torch.tensor([0, 0]))] * 2, logits)
    assert set(verdicts) == {0}  # row 1 goes to `verify_one`, which refuses its NaN

    forward = ModelRunner.forward
    calls = {"n": 0}

    def poisoned(self, state, tokens, num_logits, parents=None):
        out = forward(self, state, tokens, num_logits, parents)
        if self is not engine.target:  # (the draft's runner)
            return out
        calls["n"] += 1
        if calls["n"] == 3:
            out = out.clone()
            out[2, 0, 5] = float("nan")  # row 2's logits in its third step
        return out

    monkeypatch.setattr(ModelRunner, "forward", poisoned)
    batch = DecodeBatch(engine)
    done = decode_all(engine, batch)
    assert done[2].finish_reason == "error" and "NaN" in str(done[2].error)
    assert {i: s.generated for i, s in done.items() if i != 2} == {i: t for i, t in expected.items() if i != 2}
    assert [stage for stage, _ in batch.faults] == ["verify"]


def test_an_engine_without_a_drafter_holds_the_plain_drafter(greedy_pair):
    target, _ = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), None, set())
    assert engine.drafter is PLAIN and isinstance(PLAIN, PlainDrafter) and PLAIN.traits.plain and PLAIN.name == "none"
    out = engine.generate(PROMPTS, GREEDY, SPEC)
    assert all(s.stats.draft_tokens == 0 and s.num_generated == SPEC.max_new_tokens for s in out)
    assert [s.stats.target_forward_passes for s in out] == [SPEC.max_new_tokens] * len(PROMPTS)  # one token a pass


def test_the_engine_and_the_batch_do_not_import_each_other_even_for_types():
    graph = package_graph()
    typed = {name: [(t, False) for t, _ in imports] for name, imports in graph.items()}  # type-only edges count
    assert not [group for group in cycles(typed) if "verispec.engine" in group or "verispec.batch" in group]


def test_the_api_and_the_server_decode_through_the_engines_one_loop(tmp_path, monkeypatch):
    """`SpeculativeEngine.run` is the loop: the API's generate and a server request both step through it (a step
    taken by any other loop would not be counted), and their tokens are the same."""
    import httpx

    from tiny_hf import save_tiny_model_dir
    from verispec import SpeculativeDecoder
    from verispec.serve.config import ServeConfig
    from verispec.serve.server import BackgroundServer

    target = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    decoder = SpeculativeDecoder.load(str(target), "ngram")
    run, step = SpeculativeEngine.run, SpeculativeEngine.step
    counts = {"loops": 0, "steps": 0, "in_loop": 0}

    def counted_run(self, batch, *args, **kwargs):
        counts["loops"] += 1
        for results in run(self, batch, *args, **kwargs):
            counts["in_loop"] += 1
            yield results

    def counted_step(self, batch):
        counts["steps"] += 1
        return step(self, batch)

    monkeypatch.setattr(SpeculativeEngine, "run", counted_run)
    monkeypatch.setattr(SpeculativeEngine, "step", counted_step)
    ids = decoder.encode("abc abc abc", chat=False)
    api = decoder.generate(ids, SamplingConfig(temperature=0), SpecConfig(max_new_tokens=12, stop_at_eos=False))
    assert counts["loops"] == 1 and counts["steps"] == counts["in_loop"] > 0
    with BackgroundServer(decoder, ServeConfig(port=0)) as s:
        body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        served = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
    assert counts["loops"] == 2 and counts["steps"] == counts["in_loop"]
    assert served["choices"][0]["text"] == decoder.decode(api.token_ids)


def test_a_sampled_rows_p_made_as_the_walk_reads_it_gives_the_whole_pass_verdict():
    """`verify_one` makes a sampled row's p one row at a time, only those the walk reads (k + 1 when the k-th draft is
    rejected); the verdict and the draws are those of `rejection.verify` on the whole pass's p, with a drafter's q and
    with deterministic drafts, under every processor."""
    from verispec.rejection import verify
    gen = torch.Generator().manual_seed(1)
    vocab, n = 3000, 4  # two blocks of `row_sums` and a tail
    configs = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.6, top_p=0.9),
               SamplingConfig(temperature=0.9, top_k=30, min_p=0.05, repetition_penalty=1.3)]
    rules, made, seen_accepted = StepRules(set()), [], set()
    for case in range(60):
        sampling = configs[case % 3]
        logits = torch.randn(n + 1, vocab, generator=gen) * 3  # (N + 1, V)
        logits[:, :4] += 8.0  # a few likely tokens
        q = torch.softmax(logits[:n] + torch.randn(n, vocab, generator=gen) * 0.5, -1)  # (N, V) near p: often accepted
        tokens = torch.multinomial(q, 1, generator=gen)[:, 0]  # (N,) drawn from q
        draft = Draft(tokens, q if case % 2 else None)
        seq = Sequence(0, [1, 2, 2], 1, sampling, torch.Generator().manual_seed(case), 16, SPEC)
        chain, target = seq.processors, seq.processors.target
        rows = []
        seq.processors.target = lambda x, seen: (rows.append(x.shape[0]), target(x, seen))[1]
        alone = rules.verify_one(seq, draft, logits)
        del seq.processors.target
        seen = chain.seen_rows(seq.tokens, draft.tokens, None, vocab)
        whole = verify(chain.target(logits, seen), draft, torch.Generator().manual_seed(case))
        assert alone == whole
        assert rows == [1] * (alone.num_accepted + 1)  # the rows the walk read, one at a time
        assert seq.rng.get_state().equal(torch.Generator().manual_seed(case).get_state()) is False  # it drew
        made.append(len(rows))
        seen_accepted.add(alone.num_accepted)
    assert {0, n} <= seen_accepted and sum(made) < 0.8 * 60 * (n + 1)  # rejections early and late; rows saved


def test_the_steps_observers_see_every_rows_outcome_and_the_counters_are_one_of_them(greedy_pair):
    """A step hands its StepReport to the batch's observers once it has committed: the rows' counters
    (`step.count_step`) are one observer, the tuner another, and one added beside them sees the same outcomes."""
    from verispec.step import count_step
    from verispec.tuning import KTuner
    target, draft = greedy_pair
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())
    tuner = KTuner.__new__(KTuner)  # only its observer is looked at here
    assert DecodeBatch(engine, tuner).observers == [count_step, tuner.observe_report]
    batch, reports = DecodeBatch(engine), []
    assert batch.observers == [count_step]
    batch.observers.append(reports.append)
    done = decode_all(engine, batch)
    for index, seq in done.items():
        rows = [row for report in reports for row in report.rows if row.seq is seq]
        assert sum(row.accepted for row in rows) == seq.stats.accepted_tokens
        assert sum(row.drafted for row in rows) == seq.stats.draft_tokens
        assert len(rows) == seq.stats.target_forward_passes
    assert all(report.clock.pass_tokens > 0 for report in reports) and not any(report.trees for report in reports)
    assert sum(seq.stats.accepted_tokens for seq in done.values()) > 0 and len(done) == len(PROMPTS)
