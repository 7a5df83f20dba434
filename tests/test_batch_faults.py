"""A fault stays with whoever it belongs to (`verispec.batch`), and long prompts are read in chunks.

Each fault is injected into a running DecodeBatch by monkeypatching: one sequence's verification or commit
(that sequence ends with "error", the others decode exactly as alone), the drafter (its rows go on without
drafts, still exactly; the next batch drafts again), the target's pass (the batch's sequences end, the next batch
decodes exactly). Chunked prefill: a long prompt read 8 tokens per step beside a short one gives both their solo
tokens, the short one's first token comes before the long prompt is read, and no pass reads more than a chunk
of it (the draft model's included)."""

import pytest

from verispec.batch import DecodeBatch
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)
SPEC = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12], [3], [20, 21, 22, 20, 21]]


@pytest.fixture()
def engine(greedy_pair):
    target, draft = greedy_pair
    return SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())


def alone(engine, prompt, spec=SPEC):
    return engine.generate([prompt], GREEDY, spec)[0].generated


def run(batch):
    """Step a batch to the end; the sequences that finished, by prompt index."""
    done = {}
    while batch:
        for _, seq in batch.step():
            if seq.finish_reason is not None:
                done[seq.index] = seq
    return done


def test_a_fault_in_one_rows_verification_ends_that_row_alone(engine, monkeypatch):
    expected = {i: alone(engine, p) for i, p in enumerate(PROMPTS)}
    verify = SpeculativeEngine._verify
    calls = {"n": 0}

    def faulty(self, seq, draft, logits):
        if seq.index == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected: row 1's sampling broke")
        return verify(self, seq, draft, logits)

    monkeypatch.setattr(SpeculativeEngine, "_verify", faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert done[1].finish_reason == "error" and "injected" in str(done[1].error)
    assert {i: s.generated for i, s in done.items() if i != 1} == {i: t for i, t in expected.items() if i != 1}
    assert [stage for stage, _ in batch.faults] == ["verify"] and batch.state is None
    with pytest.raises(VerispecError, match="sequence 1 failed: RuntimeError"):  # a library call fails loudly
        calls["n"] = 0
        engine.generate(PROMPTS, GREEDY, SPEC)


def test_a_fault_in_one_rows_commit_ends_that_row_alone(engine, monkeypatch):
    expected = {i: alone(engine, p, SPEC) for i, p in enumerate(PROMPTS)}
    commit = SpeculativeEngine._commit

    def faulty(self, seq, accepted, verdict):
        if seq.index == 2 and seq.num_generated >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return commit(self, seq, accepted, verdict)

    monkeypatch.setattr(SpeculativeEngine, "_commit", faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert done[2].finish_reason == "error"
    assert {i: s.generated for i, s in done.items() if i != 2} == {i: t for i, t in expected.items() if i != 2}


@pytest.mark.parametrize("method", ["propose", "commit", "extend"])
def test_a_drafter_fault_turns_drafting_off_for_the_batch_and_output_stays_exact(engine, monkeypatch, method):
    expected = {i: alone(engine, p) for i, p in enumerate(PROMPTS)}
    original = getattr(DraftModelDrafter, method)
    calls = {"n": 0}

    def faulty(self, *args):
        calls["n"] += 1
        if calls["n"] == (1 if method == "extend" else 2):
            raise MemoryError(f"injected in {method}")
        return original(self, *args)

    monkeypatch.setattr(DraftModelDrafter, method, faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS[:2], GREEDY, SPEC, [0, 1]))
    batch.step()
    late = engine.make_sequences(PROMPTS[2:], GREEDY, SPEC, [2, 3])  # rows joining a running batch
    for seq, index in zip(late, (2, 3)):
        seq.index = index
    batch.add(late)
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected  # every request answered, exactly
    assert batch.faults and batch.faults[0][0] == f"drafter.{method}" and batch.drafter is None
    monkeypatch.setattr(DraftModelDrafter, method, original)
    fresh = engine.generate(PROMPTS[:1], GREEDY, SPEC)[0]  # the next batch drafts again
    assert fresh.generated == expected[0] and fresh.stats.draft_tokens > 0


def test_a_target_fault_ends_the_batch_and_the_next_batch_is_exact(engine, monkeypatch):
    expected = alone(engine, PROMPTS[0])
    forward = ModelRunner.forward
    calls = {"n": 0}

    def faulty(self, state, tokens, num_logits, parents=None):
        if self is engine.target:
            calls["n"] += 1
            if calls["n"] == 3:
                raise MemoryError("injected: the target's pass ran out of memory")
        return forward(self, state, tokens, num_logits, parents)

    monkeypatch.setattr(ModelRunner, "forward", faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert len(done) == len(PROMPTS) and all(s.finish_reason == "error" for s in done.values())
    assert all(isinstance(s.error, MemoryError) for s in done.values())
    assert batch.state is None and batch.faults[0][0] == "target.forward"
    batch.add(engine.make_sequences(PROMPTS[:1], GREEDY, SPEC, None))
    assert run(batch)[0].generated == expected


def test_a_long_prompt_is_read_in_chunks_beside_a_short_one(engine):
    long_prompt = [(7 * i) % 60 + 1 for i in range(70)]
    short = PROMPTS[1]
    longer = SpecConfig(num_draft_tokens=3, max_new_tokens=40, stop_at_eos=False)  # drafts while the prompt is read
    expected = {0: alone(engine, long_prompt), 1: alone(engine, short, longer)}
    widths = {"target": [], "draft": []}
    for name, runner in (("target", engine.target), ("draft", engine.drafter.runner)):
        forward = runner.forward

        def spy(state, tokens, num_logits, parents=None, name=name, forward=forward):
            widths[name].append([len(t) for t in tokens])
            return forward(state, tokens, num_logits, parents)

        runner.forward = spy
    batch = DecodeBatch(engine, prefill_chunk=8)
    rows = engine.make_sequences([long_prompt], GREEDY, SPEC, None) + engine.make_sequences([short], GREEDY, longer, None)
    rows[1].index = 1
    batch.add(rows)
    first_event = {}
    step = 0
    while batch:
        step += 1
        for event, seq in batch.step():
            first_event.setdefault(seq.index, step)
            if seq.finish_reason is not None:
                assert seq.generated == expected[seq.index]
    assert first_event[1] == 1 and first_event[0] >= 70 // 8  # the short row did not wait for the long prompt
    long_reads = [w[0] for w in widths["target"][: first_event[0] - 1]]
    assert max(long_reads) == 8 and sum(long_reads) < 70  # prompt chunks only, then the rest with drafts
    assert max(w[0] for w in widths["draft"] if w) <= 8 + SPEC.num_draft_tokens  # the draft read it in chunks too
