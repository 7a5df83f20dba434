"""A fault stays with whoever it belongs to (`verispec.batch`, `verispec.faults`), and long prompts are read in chunks.

Each fault is injected into a running DecodeBatch by monkeypatching, and every row's greedy output is checked against
plain decoding. One sequence's verification or commit: that sequence ends with "error", the others decode exactly as
alone. The drafter: a one-off fault leaves every row drafting; a fault one row causes (in start, propose, commit or
extend, whenever the row whose prompt holds MARK is among the drafter's rows) stops drafting for that row only, the
others draft on and a row joining later drafts; heads (which read the target's passes) stop the rows present and
draft for rows joining later. A native panic (a BaseException) is absorbed like an Exception, an interrupt is not.
Ids: a prompt past a smaller draft vocabulary decodes without drafts; a row the target cannot read ends before the
pass; a draft it cannot read is dropped. The target's pass: where the cache can be brought back (torch dynamic
cache, native runner), a pass that breaks part-way on one row's prompt ends that row alone and a one-off fault ends
none; where it cannot, the batch's sequences end and the next batch decodes exactly. Chunked prefill: a long prompt
read 8 tokens per step beside a short one gives both their solo tokens, the short one's first token comes before the
long prompt is read, and no pass reads more than a chunk of it (the draft model's included)."""

import copy

import pytest
import torch

from verispec.batch import DecodeBatch
from verispec.config import SamplingConfig, SpecConfig
from verispec.core.drafter import Draft
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.step import StepRules
from verispec.models.runners.hf import KVState, ModelRunner

GREEDY = SamplingConfig(temperature=0)
SPEC = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12], [3], [20, 21, 22, 20, 21]]


@pytest.fixture()
def engine(greedy_pair):
    target, draft = greedy_pair
    return SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(draft), 64), set())


def alone(engine, prompt, spec=SPEC):
    return engine.generate([prompt], GREEDY, spec)[0].generated


def run(batch, done=None, steps=None):
    """Step a batch to the end (or `steps` times); the sequences that finished, by index (added to `done`)."""
    done = {} if done is None else done
    while batch and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        for _, seq in batch.engine.step(batch):
            if seq.finish_reason is not None:
                done[seq.index] = seq
    return done


def test_a_fault_in_one_rows_verification_ends_that_row_alone(engine, monkeypatch):
    expected = {i: alone(engine, p) for i, p in enumerate(PROMPTS)}
    verify = StepRules.verify_one
    calls = {"n": 0}

    def faulty(self, seq, draft, logits):
        if seq.index == 1:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected: row 1's sampling broke")
        return verify(self, seq, draft, logits)

    monkeypatch.setattr(StepRules, "verify_one", faulty)
    monkeypatch.setattr(StepRules, "batched", lambda *_: False)  # every row verified alone, where the fault is
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
    commit = StepRules.commit

    def faulty(self, seq, accepted, verdict):
        if seq.index == 2 and seq.num_generated >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return commit(self, seq, accepted, verdict)

    monkeypatch.setattr(StepRules, "commit", faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert done[2].finish_reason == "error"
    assert {i: s.generated for i, s in done.items() if i != 2} == {i: t for i, t in expected.items() if i != 2}


@pytest.mark.parametrize("method", ["propose", "commit", "extend"])
def test_a_drafter_fault_no_row_causes_leaves_every_row_drafting_and_output_exact(engine, monkeypatch, method):
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
    engine.step(batch)
    late = engine.make_sequences(PROMPTS[2:], GREEDY, SPEC, [2, 3])  # rows joining a running batch
    for seq, index in zip(late, (2, 3)):
        seq.index = index
    batch.add(late)
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected  # every request answered, exactly
    # a one-off fault: the drafter is started afresh, no row fails it alone, and every row drafts on
    assert [stage for stage, _ in batch.faults] == [f"drafter.{method}"] and batch.drafter is engine.drafter
    assert all(s.stats.draft_tokens > 0 for s in done.values())
    monkeypatch.setattr(DraftModelDrafter, method, original)
    fresh = engine.generate(PROMPTS[:1], GREEDY, SPEC)[0]  # the next batch drafts as ever
    assert fresh.generated == expected[0] and fresh.stats.draft_tokens > 0


# --- faults the drafter's batched calls cannot name: found by running the drafter for each row alone ----------------
LONGER = SpecConfig(num_draft_tokens=3, max_new_tokens=24, stop_at_eos=False)
MARKED = 1  # the row whose prompt holds MARK: the injected drafter fails whenever that row is among its rows
MARK = PROMPTS[MARKED][2]
LATE = [5, 6, 5, 6, 5]


def marked(sequences) -> bool:
    return any(MARK in s.tokens[: s.prompt_len] for s in sequences)


def indexed(engine, prompts: dict, spec=LONGER):
    """Sequences for {index: prompt}, with those indices."""
    out = []
    for i, prompt in prompts.items():
        seq = engine.make_sequences([prompt], GREEDY, spec, None)[0]
        seq.index = i
        out.append(seq)
    return out


@pytest.mark.parametrize("method", ["start", "propose", "commit"])
def test_a_drafter_fault_one_row_causes_stops_drafting_for_that_row_only(engine, monkeypatch, method):
    prompts = dict(enumerate(PROMPTS))
    expected = {i: alone(engine, p, LONGER) for i, p in [*prompts.items(), (4, LATE)]}
    original = getattr(DraftModelDrafter, method)

    def faulty(self, sequences, *args):
        if marked(sequences):
            raise MemoryError(f"injected in {method}: the marked row is here")
        return original(self, sequences, *args)

    monkeypatch.setattr(DraftModelDrafter, method, faulty)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, prompts))
    engine.step(batch)
    before = {s.index: (s.stats.draft_tokens, s.stats.accepted_tokens) for s in batch.sequences}
    batch.add(indexed(engine, {4: LATE}))  # a row joining after the fault drafts
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected  # every row exactly as plain decoding
    assert [stage for stage, _ in batch.faults] == [f"drafter.{method}"]  # found once, then kept out
    assert done[MARKED].stats.draft_tokens == before[MARKED][0]  # no drafts after the fault
    others = [i for i in prompts if i != MARKED and done[i].num_generated > before[i][0] + 4]
    assert others and all(done[i].stats.accepted_tokens > before[i][1] for i in others)  # drafting on, accepted
    assert done[4].stats.draft_tokens > 0 and batch.drafter is engine.drafter


def test_a_row_that_fails_the_drafters_extend_alone_joins_without_drafts(engine, monkeypatch):
    expected = {i: alone(engine, p, LONGER) for i, p in enumerate(PROMPTS)}
    extend = DraftModelDrafter.extend

    def faulty(self, sequences):
        if marked(sequences):
            raise MemoryError("injected in extend: the marked row joins")
        return extend(self, sequences)

    monkeypatch.setattr(DraftModelDrafter, "extend", faulty)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, {0: PROMPTS[0], 2: PROMPTS[2]}))
    engine.step(batch)
    before = {s.index: s.stats.accepted_tokens for s in batch.sequences}
    batch.add(indexed(engine, {1: PROMPTS[1], 3: PROMPTS[3]}))  # joins together with the marked row
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected
    assert [stage for stage, _ in batch.faults] == ["drafter.extend"]
    assert done[MARKED].stats.draft_tokens == 0 and done[3].stats.draft_tokens > 0
    assert done[0].stats.accepted_tokens > before[0]


class PanicException(BaseException):
    """Stands in for pyo3's PanicException (a native extension's panic derives from BaseException)."""


def test_a_native_panic_is_absorbed_like_an_exception_and_an_interrupt_is_not(engine, monkeypatch):
    expected = {i: alone(engine, p, LONGER) for i, p in enumerate(PROMPTS)}
    propose, verify = DraftModelDrafter.propose, StepRules.verify_one

    def panicking_propose(self, sequences, *args):
        if marked(sequences):
            raise PanicException("injected: the drafter's native code panicked")
        return propose(self, sequences, *args)

    def panicking_verify(self, seq, draft, logits):
        if seq.index == 3 and seq.num_generated >= 3:
            raise PanicException("injected: row 3's constraint panicked")
        return verify(self, seq, draft, logits)

    monkeypatch.setattr(DraftModelDrafter, "propose", panicking_propose)
    monkeypatch.setattr(StepRules, "verify_one", panicking_verify)
    monkeypatch.setattr(StepRules, "batched", lambda *_: False)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, dict(enumerate(PROMPTS))))
    done = run(batch)
    assert done[3].finish_reason == "error" and isinstance(done[3].error, PanicException)
    assert {i: s.generated for i, s in done.items() if i != 3} == {i: t for i, t in expected.items() if i != 3}
    assert [stage for stage, _ in batch.faults] == ["drafter.propose", "verify"]
    assert done[MARKED].stats.draft_tokens == 0 and done[0].stats.draft_tokens > 0

    for where in ("propose", "verify_one"):  # an interrupt is no fault: it leaves the batch
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt

        owner = DraftModelDrafter if where == "propose" else StepRules
        monkeypatch.setattr(owner, where, interrupted)
        batch = DecodeBatch(engine)
        batch.add(indexed(engine, {0: PROMPTS[0]}))
        with pytest.raises(KeyboardInterrupt):
            engine.step(batch)
        monkeypatch.setattr(owner, where, propose if where == "propose" else verify)


def test_a_prompt_past_a_smaller_draft_vocabulary_decodes_without_drafts(greedy_pair):
    target, draft = greedy_pair
    small = copy.deepcopy(draft)
    small.resize_token_embeddings(48)  # a draft that reads ids 0 .. 47 of the target's 64
    engine = SpeculativeEngine(ModelRunner(target), DraftModelDrafter(ModelRunner(small), 64), set())
    assert engine.drafter.traits.input_vocab == 48
    prompts = {0: PROMPTS[0], 1: [50, 51, 52, 50, 51], 2: PROMPTS[3]}
    plain = SpeculativeEngine(ModelRunner(target), None, set())
    expected = {i: alone(plain, p, LONGER) for i, p in prompts.items()}
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, prompts))
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected and not batch.faults
    assert done[1].stats.draft_tokens == 0 and done[0].stats.draft_tokens > 0
    # a row whose output reaches an id the draft cannot read stops drafting there, exactly
    assert any(max(s.generated) >= 48 for s in done.values())
    assert [s.generated for s in engine.generate(list(prompts.values()), GREEDY, LONGER)] == list(expected.values())


# --- the target's pass ------------------------------------------------------------------------------------------
def test_a_target_fault_where_the_cache_cannot_be_restored_ends_the_batch(engine, monkeypatch):
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
    monkeypatch.setattr(KVState, "checkpoint", lambda self: None)  # as a static cache's (or llama.cpp's)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert len(done) == len(PROMPTS) and all(s.finish_reason == "error" for s in done.values())
    assert all(isinstance(s.error, MemoryError) for s in done.values())
    assert batch.state is None and batch.faults[0][0] == "target.forward"
    batch.add(engine.make_sequences(PROMPTS[:1], GREEDY, SPEC, None))
    assert run(batch)[0].generated == expected


def test_a_one_off_target_fault_is_retried_by_parts_and_every_row_finishes(engine, monkeypatch):
    expected = {i: alone(engine, p) for i, p in enumerate(PROMPTS)}
    run_pass = ModelRunner._run
    calls = {"n": 0}

    def faulty(self, state, *args):
        if self is engine.target:
            calls["n"] += 1
            if calls["n"] == 3:
                raise MemoryError("injected: the target's pass ran out of memory")
        return run_pass(self, state, *args)

    monkeypatch.setattr(ModelRunner, "_run", faulty)
    batch = DecodeBatch(engine)
    batch.add(engine.make_sequences(PROMPTS, GREEDY, SPEC, None))
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected
    assert [stage for stage, _ in batch.faults] == ["target.forward"]


@pytest.mark.parametrize("runner_kind, joins", [("torch", True), ("torch", False), ("native", True)])
def test_a_target_pass_that_fails_for_one_row_ends_that_row_alone(greedy_pair, runner_kind, joins, tmp_path,
                                                                    monkeypatch):
    """The pass raises part-way (after its first layer wrote the cache) whenever it reads the marked row's prompt:
    the state is brought back, the pass runs again by halves, the marked row ends and the others finish exactly.
    `joins`: the marked row joins a running batch (else it is in the batch's first pass, on an empty cache)."""
    target_model, draft = greedy_pair
    if runner_kind == "native":
        from tiny_gguf import T, gguf_from_hf
        from verispec.models.gguf.model import load_gguf
        from verispec.models.gguf.runner import NativeRunner

        target = NativeRunner(load_gguf(gguf_from_hf(target_model, tmp_path / "t.gguf", T.Q8_0), show_progress=False))
    else:
        target = ModelRunner(target_model)
    engine = SpeculativeEngine(target, DraftModelDrafter(ModelRunner(draft), 64), set())
    expected = {i: alone(engine, p, LONGER) for i, p in [*enumerate(PROMPTS), (4, LATE)]}
    poison = PROMPTS[MARKED]

    def reads_poison(rows: list[list[int]]) -> bool:
        return any(row[: len(poison)] == poison for row in rows)

    if runner_kind == "native":
        layers = target._layers

        def faulty_layers(x, queries, rows, low, high, skip):
            layers(x, queries, rows, low, min(high, low + 1), skip)  # the first layer writes its entries
            by_row: dict[int, list[int]] = {}
            for q in queries:
                if q.position == len(by_row.get(q.row, [])):
                    by_row.setdefault(q.row, []).append(q.token)
            if reads_poison(list(by_row.values())):
                raise MemoryError("injected: the pass broke on the marked row")
            layers(x, queries, rows, low + 1, high, skip)

        monkeypatch.setattr(target, "_layers", faulty_layers)
    else:
        run_pass, last = target._run, target_model.model.layers[-1]
        layer_forward, armed = last.forward, {"on": False}

        def faulty_run(state, input_ids, *args):
            armed["on"] = reads_poison(input_ids.tolist())
            try:
                return run_pass(state, input_ids, *args)
            finally:
                armed["on"] = False

        def faulty_layer(*args, **kwargs):
            if armed["on"]:  # the layers before this one have appended their keys and values
                raise MemoryError("injected: the pass broke on the marked row")
            return layer_forward(*args, **kwargs)

        monkeypatch.setattr(target, "_run", faulty_run)
        monkeypatch.setattr(last, "forward", faulty_layer)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, {i: p for i, p in enumerate(PROMPTS) if i != MARKED or not joins}))
    done = run(batch, steps=3)  # the others are decoding, their caches part-written, when the marked row joins
    if joins:
        batch.add(indexed(engine, {MARKED: poison}))
        run(batch, done, steps=1)
    batch.add(indexed(engine, {4: LATE}))
    run(batch, done)
    assert done[MARKED].finish_reason == "error" and isinstance(done[MARKED].error, MemoryError)
    assert {i: s.generated for i, s in done.items() if i != MARKED} == \
        {i: t for i, t in expected.items() if i != MARKED}
    assert [stage for stage, _ in batch.faults] == ["target.forward", "forward"]
    assert done[4].stats.draft_tokens > 0


def test_a_fault_in_a_drafter_that_reads_the_targets_passes_stops_the_rows_present_and_later_rows_draft(
        greedy_pair, monkeypatch):
    """Heads cannot be replayed for rows mid-answer (`Traits.restartable` False): the rows present decode plainly,
    exactly, and a row that joins later drafts; the same after a target pass run by parts (the heads lost its
    features)."""
    from test_medusa import random_heads

    target_model, _ = greedy_pair
    runner = ModelRunner(target_model)
    engine = SpeculativeEngine(runner, MedusaDrafter(runner, random_heads(target_model)), set())
    expected = {i: alone(engine, p, LONGER) for i, p in [*enumerate(PROMPTS), (4, LATE), (5, PROMPTS[0])]}
    propose, run_pass = MedusaDrafter.propose, ModelRunner._run
    calls = {"propose": 0, "pass": 0}

    def faulty_propose(self, *args):
        calls["propose"] += 1
        if calls["propose"] == 3:
            raise PanicException("injected: the heads panicked")
        return propose(self, *args)

    def faulty_pass(self, *args):
        calls["pass"] += 1
        if calls["pass"] == 7:  # in the late row's third step
            raise MemoryError("injected: one pass ran out of memory")
        return run_pass(self, *args)

    monkeypatch.setattr(MedusaDrafter, "propose", faulty_propose)
    monkeypatch.setattr(ModelRunner, "_run", faulty_pass)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, dict(enumerate(PROMPTS))))
    done = run(batch, steps=4)
    drafted = {s.index: s.stats.draft_tokens for s in batch.sequences}
    batch.add(indexed(engine, {4: LATE}))
    done = run(batch, done, steps=4)
    late = {s.index: s.stats.draft_tokens for s in batch.sequences}
    batch.add(indexed(engine, {5: PROMPTS[0]}))
    run(batch, done)
    assert {i: s.generated for i, s in done.items()} == expected
    assert [stage for stage, _ in batch.faults] == ["drafter.propose", "target.forward"]
    assert all(done[i].stats.draft_tokens == n for i, n in drafted.items())  # off since the heads' fault
    assert late[4] > 0 and done[4].stats.draft_tokens == late[4]  # drafted, then off since the split pass
    assert done[5].stats.draft_tokens > 0


def test_a_row_the_target_cannot_read_ends_before_the_pass(engine):
    expected = {i: alone(engine, p) for i, p in enumerate(PROMPTS)}
    batch = DecodeBatch(engine)
    seqs = engine.make_sequences(PROMPTS, GREEDY, SPEC, None)
    batch.add(seqs)
    engine.step(batch)
    seqs[2].tokens.append(64)  # an id past the target's vocabulary, as a broken constraint might commit
    done = run(batch)
    assert done[2].finish_reason == "error" and "outside the target's vocabulary" in str(done[2].error)
    assert {i: s.generated for i, s in done.items() if i != 2} == {i: t for i, t in expected.items() if i != 2}
    assert [stage for stage, _ in batch.faults] == ["inputs"]


def test_a_draft_the_target_cannot_read_is_dropped_and_its_row_decodes_on_without_drafts(engine, monkeypatch):
    expected = {i: alone(engine, p, LONGER) for i, p in enumerate(PROMPTS)}
    propose = DraftModelDrafter.propose

    def bad_ids(self, sequences, *args):
        drafts = propose(self, sequences, *args)
        return [Draft(torch.tensor([70, 71])) if MARK in s.tokens[: s.prompt_len] and len(d) else d
                for s, d in zip(sequences, drafts)]

    monkeypatch.setattr(DraftModelDrafter, "propose", bad_ids)
    batch = DecodeBatch(engine)
    batch.add(indexed(engine, dict(enumerate(PROMPTS))))
    done = run(batch)
    assert {i: s.generated for i, s in done.items()} == expected  # the marked row too: it was not ended
    assert [stage for stage, _ in batch.faults] == ["drafter.propose"]
    assert done[MARKED].stats.draft_tokens == 0 and done[0].stats.draft_tokens > 0


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
        for event, seq in engine.step(batch):
            first_event.setdefault(seq.index, step)
            if seq.finish_reason is not None:
                assert seq.generated == expected[seq.index]
    assert first_event[1] == 1 and first_event[0] >= 70 // 8  # the short row did not wait for the long prompt
    long_reads = [w[0] for w in widths["target"][: first_event[0] - 1]]
    assert max(long_reads) == 8 and sum(long_reads) < 70  # prompt chunks only, then the rest with drafts
    assert max(w[0] for w in widths["draft"] if w) <= 8 + SPEC.num_draft_tokens  # the draft read it in chunks too
