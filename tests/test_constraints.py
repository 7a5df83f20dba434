"""Structured output under exact speculation (verispec.constraints): masks, forced drafts, exactness, bad input.

Layers: the constraint's masks against a reference walk; greedy speculative output equal to greedy constrained plain
decoding for chains, trees and several drafters; chi-square of constrained speculative sampling against the exact
constrained p (with a mutant that leaves p unconstrained, which the audit must catch); batched rows with different
constraints equal to their solo runs; every output valid; one clear error for each kind of bad constraint."""

import json
import logging
import re
import string

import pytest
import torch
import transformers

from conftest import noisy_copy
from tiny_hf import CHARS, char_tokenizer, save_tiny_model_dir
from verispec import SpeculativeDecoder
from verispec.audit import run_audit
from verispec.config import Constraint, SamplingConfig, SpecConfig, TreeConfig
from verispec.constraints import apply_constraint, unpack_bitmask
from verispec.errors import VerispecError

JSON_CHARS = CHARS + list('{}[]"-')
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                         "maximum": 120}, "tags": {"type": "array", "items": {"enum": ["red", "blue"]},
                         "maxItems": 3}}}
REGEX = "(ab|ba)+c[0-9]{2}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, and a draft that is the target with noise in its weights: accepted often, not always."""
    root = tmp_path_factory.mktemp("constrained")
    target = save_tiny_model_dir(root / "target", "llama", seed=0, vocab_chars=JSON_CHARS)
    noisy_copy(transformers.AutoModelForCausalLM.from_pretrained(str(target)), 0.5).save_pretrained(str(root / "draft"))
    char_tokenizer(chars=JSON_CHARS).save_pretrained(str(root / "draft"))
    return str(target), str(root / "draft")


@pytest.fixture(scope="module")
def decoders(models):
    target, draft = models
    return {name: SpeculativeDecoder.load(target, spec) for name, spec in
            (("draft", draft), ("ngram", "ngram"), ("suffix", "suffix"), ("none", "none"))}


def valid(schema: dict, text: str) -> bool:
    """SCHEMA's rules, checked by hand (no JSON-schema validator is a dependency)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (set(value) == {"name", "age", "tags"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["age"], int) and 0 <= value["age"] <= 120 and len(value["tags"]) <= 3
            and all(t in ("red", "blue") for t in value["tags"]))


# --- masks -----------------------------------------------------------------------------------------
def test_unpack_bitmask_matches_a_bit_by_bit_reference():
    words = torch.tensor([0b1011, -1, 0, -(1 << 31)], dtype=torch.int32)  # the last: bit 31 alone
    expected = [bool((int(w) >> j) & 1) for w in words.tolist() for j in range(32)]
    assert unpack_bitmask(words, 100).tolist() == expected[:100]


def test_node_masks_equal_a_walk_that_consumes_each_path_and_leave_the_state_as_it_was(decoders):
    engine = decoders["none"].engine
    state = engine.grammars().start(Constraint("regex", REGEX))
    tok = decoders["none"].target.tokenizer
    ids = lambda text: [tok.convert_tokens_to_ids(c) for c in text]  # noqa: E731
    state.advance(ids("ab"))
    before = state.allowed()
    # a tree: root -> 'b' -> 'a' ; root -> 'c' -> '1' ; root -> 'z' (forbidden) -> 'a'
    tokens = ids("bcza1a")
    parents = [-1, -1, -1, 0, 1, 2]
    tokens = [tokens[0], tokens[1], tokens[2], tokens[3], tokens[4], tokens[5]]
    masks = state.node_masks(tokens, parents)
    assert torch.equal(state.allowed(), before)  # rolled back
    fresh = lambda path: (lambda s: (s.advance(ids("ab") + path), s.allowed())[1])(  # noqa: E731
        engine.grammars().start(Constraint("regex", REGEX)))
    assert torch.equal(masks[0], before)
    assert torch.equal(masks[1], fresh(ids("b"))) and torch.equal(masks[2], fresh(ids("c")))
    assert torch.equal(masks[4], fresh(ids("ba"))) and torch.equal(masks[5], fresh(ids("c1")))
    assert not bool(before[ids("z")[0]]) and bool(masks[3].all()) and bool(masks[6].all())  # below a forbidden node
    allowed = {tok.convert_ids_to_tokens(i) for i in masks[5].nonzero().view(-1).tolist()}
    assert allowed == set(string.digits)


def test_apply_constraint_forbids_with_minus_infinity_and_refuses_a_dead_end():
    logits = torch.randn(2, 6)
    allowed = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    out = apply_constraint(logits, allowed)
    assert torch.equal(out[allowed], logits[allowed]) and bool((out[~allowed] == float("-inf")).all())
    with pytest.raises(VerispecError, match="dead-ends"):
        apply_constraint(logits, torch.zeros(2, 6, dtype=torch.bool))


# --- greedy equality and validity --------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["draft", "ngram", "suffix"])
@pytest.mark.parametrize("constraint", [Constraint("regex", REGEX), Constraint("json_schema", json.dumps(SCHEMA)),
                                        Constraint("json_object")], ids=["regex", "schema", "object"])
def test_greedy_constrained_speculation_equals_greedy_constrained_plain_decoding(decoders, drafter, constraint):
    sampling = SamplingConfig(temperature=0.0, constraint=constraint)
    spec = SpecConfig(max_new_tokens=80, num_draft_tokens=4)
    for prompt in ("hello", "the cat sat"):
        plain = decoders["none"].generate(prompt, sampling, spec)
        fast = decoders[drafter].generate(prompt, sampling, spec)
        assert fast.token_ids == plain.token_ids, (drafter, constraint.kind, prompt)
        assert plain.finish_reason == "eos"  # the constraint completed: only its end token could follow
        if constraint.kind == "regex":
            assert re.fullmatch(REGEX, fast.text)
        elif constraint.kind == "json_schema":
            assert valid(SCHEMA, fast.text), fast.text
        else:
            assert isinstance(json.loads(fast.text), dict)
        assert plain.stats.forced_tokens == 0  # plain decoding drafts nothing, not even forced tokens
    if constraint.kind == "json_schema":
        assert fast.stats.forced_tokens > 0 and fast.stats.target_forward_passes < plain.stats.target_forward_passes


def test_greedy_constrained_tree_speculation_equals_plain(decoders, caplog):
    """Also without a drafter fault: a row whose step verified a forced run drafted no tree, and the draft model's
    commit read that run's path against the tree it did not draft (an IndexError, absorbed by restarting the drafter,
    which then read the whole prompt again: 0.07x plain decoding on the bench's function calls)."""
    sampling = SamplingConfig(temperature=0.0, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    for tree in (TreeConfig(shape=(3, 2, 1)), TreeConfig(budget=8)):
        spec = SpecConfig(max_new_tokens=80, num_draft_tokens=4, tree=tree)
        with caplog.at_level(logging.WARNING, logger="verispec"):
            fast = decoders["draft"].generate("hello", sampling, spec)
        assert fast.token_ids == decoders["none"].generate("hello", sampling, SpecConfig(max_new_tokens=80)).token_ids
        assert fast.stats.forced_tokens > 0  # forced runs were verified between tree steps
        assert not [r for r in caplog.records if "drafter failed" in r.getMessage()], caplog.text


def test_sampled_outputs_are_all_valid(decoders):
    sampling = SamplingConfig(temperature=1.0, top_p=0.95, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    results = decoders["draft"].generate_batch(["hello"] * 12, sampling, SpecConfig(max_new_tokens=120), seed=5)
    for r in results:
        assert r.finish_reason == "eos" and valid(SCHEMA, r.text), r.text


# --- exactness of sampling ---------------------------------------------------------------------------
HALF = Constraint("regex", "[a-m ]+[0-9]")  # forbids much of what the unconstrained target writes


@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(3, 2))], ids=["chain", "tree"])
def test_constrained_speculative_sampling_passes_the_chi_square_audit(decoders, tree):
    dec = decoders["draft"]
    prompt = dec.encode("the cat", chat=False)
    sampling = SamplingConfig(temperature=1.5, top_p=0.98, constraint=HALF)
    report = run_audit(dec, prompt, sampling, num_draft_tokens=3, samples=1500, batch_size=300, seed=3, tree=tree)
    assert report.passed, report.to_dict()
    assert len(report.checks) == 4 and 0 < report.acceptance_rate < 1


def test_a_target_left_unconstrained_never_passes_off_as_constrained(decoders, monkeypatch):
    """A mutant: the engine forgets the mask in verification. The first token outside the constraint is refused when
    it is committed, and the request fails loudly instead of returning unconstrained text."""
    import verispec.step

    monkeypatch.setattr(verispec.step, "apply_constraint", lambda logits, allowed: logits)
    dec = decoders["draft"]
    with pytest.raises(VerispecError, match="refused a committed token"):
        run_audit(dec, dec.encode("the cat", chat=False), SamplingConfig(temperature=1.5, constraint=HALF),
                  num_draft_tokens=3, samples=300, batch_size=150, seed=3)


def test_the_constrained_audit_catches_a_wrong_residual(decoders, monkeypatch):
    """A mutant of the verifier (recovered tokens drawn from q instead of the residual): the audit must fail, so the
    passing audits above have power."""
    from verispec import rejection

    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: q)
    dec = decoders["draft"]
    report = run_audit(dec, dec.encode("the cat", chat=False), SamplingConfig(temperature=1.5, constraint=HALF),
                       num_draft_tokens=3, samples=1500, batch_size=300, seed=3)
    assert not report.passed


# --- batches -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_rows_with_different_constraints_equal_their_solo_runs(decoders, temperature):
    dec = decoders["draft"]
    configs = [SamplingConfig(temperature=temperature, constraint=c) for c in
               (Constraint("regex", REGEX), Constraint("json_schema", json.dumps(SCHEMA)), None,
                Constraint("json_object"))]
    prompts = ["hello", "the cat", "abc", "hello"]
    spec = SpecConfig(max_new_tokens=60, num_draft_tokens=3)
    together = dec.generate_batch(prompts, configs, spec, seed=[7, 8, 9, 10])
    for prompt, cfg, seed, got in zip(prompts, configs, [7, 8, 9, 10], together):
        alone = dec.generate(prompt, cfg, spec, seed=seed)
        assert got.token_ids == alone.token_ids


# --- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, message", [
    (("json_schema", "{not json"), "not valid JSON"),
    (("json_schema", '{"type": "strin"}'), "invalid JSON schema constraint"),
    (("json_schema", '{"type": "object", "if": {}}'), "Unimplemented"),
    (("regex", "[a-"), "invalid regex constraint"),
    (("grammar", "start: ("), "invalid grammar constraint"),
    (("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'), "constraint"),
])
def test_bad_constraints_get_one_clear_line(decoders, constraint, message):
    sampling = SamplingConfig(temperature=0.0, constraint=Constraint(*constraint))
    with pytest.raises(VerispecError, match=message) as err:
        decoders["draft"].generate("hello", sampling, SpecConfig(max_new_tokens=8))
    assert "\n" not in str(err.value)


def test_constraint_config_refuses_unknown_kinds_and_empty_sources():
    with pytest.raises(VerispecError, match="unknown constraint kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(VerispecError, match="regex constraint is empty"):
        Constraint("regex", "  ")
    assert Constraint("json_object").source == ""


def test_a_gbnf_grammar_is_read_as_llama_cpp_writes_it(decoders):
    gbnf = 'root ::= "yes" | "no" | digit digit\ndigit ::= [0-9]'
    sampling = SamplingConfig(temperature=1.0, constraint=Constraint("grammar", gbnf))
    for r in decoders["draft"].generate_batch(["hello"] * 6, sampling, SpecConfig(max_new_tokens=8), seed=1):
        assert re.fullmatch("yes|no|[0-9]{2}", r.text), r.text


def test_a_constraint_the_tokenizer_cannot_write_is_refused_before_decoding(tmp_path):
    """The default tiny tokenizer has no '{': no JSON object can be written with it."""
    target = save_tiny_model_dir(tmp_path / "plain_chars", "llama", seed=0)
    decoder = SpeculativeDecoder.load(str(target), "none")
    with pytest.raises(VerispecError, match="allows no output with this tokenizer"):
        decoder.generate("hello", SamplingConfig(constraint=Constraint("json_object")), SpecConfig(max_new_tokens=4))


# --- forced runs with a lookup's guess, and deterministic chains cut at a forbidden token ------------------------
def test_a_forced_run_is_followed_by_the_lookups_guess_and_a_forbidden_copy_is_cut(decoders):
    from verispec.batch import DecodeBatch
    from verispec.core.drafter import Draft
    from verispec.plan import after_forced, within_constraint

    dec = decoders["ngram"]
    tok = dec.target.tokenizer
    ids = lambda text: [tok.convert_tokens_to_ids(c) for c in text]  # noqa: E731
    seq = dec.engine.make_sequences([ids("ab:12 ab:13 ab")], SamplingConfig(temperature=0.0,
                                    constraint=Constraint("regex", ":[0-9]+ ab:[0-9]+")), SpecConfig(), [0])[0]
    batch = DecodeBatch(dec.engine)
    batch.add([seq])
    assert seq.constraint.forced(8) == ids(":")  # ':' is forced, the digits are free
    chain = after_forced(batch, 0, ids(":"), 4)
    assert chain[:1] == ids(":") and len(chain) > 1  # the lookup copies what followed "ab:" before
    copied = Draft(torch.tensor(ids(":1x3")))  # 'x' is forbidden: the chain is cut before it
    assert within_constraint(seq, copied).tokens.tolist() == ids(":1")
    sampled = Draft(torch.tensor(ids(":1x")), q=torch.full((3, dec.runner.vocab_size), 1.0 / dec.runner.vocab_size))
    assert within_constraint(seq, sampled) is sampled  # never cut by its value


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_forced_runs_with_guesses_pass_the_chi_square_audit(decoders, drafter):
    dec = decoders[drafter]
    prompt = dec.encode("a cat, a cat, a bat", chat=False)
    sampling = SamplingConfig(temperature=1.5, constraint=Constraint("regex", "a [a-m ]+[0-9]"))
    report = run_audit(dec, prompt, sampling, num_draft_tokens=3, samples=1200, batch_size=300, seed=5)
    assert report.passed, report.to_dict()


def test_trees_draw_their_children_from_the_constrained_q(decoders):
    """A tree drafted under a constraint has only allowed nodes (its q is masked after each node's path), and stays
    exact: greedy equal to plain above, and here the audit of sampled trees from a draft model."""
    dec = decoders["draft"]
    prompt = dec.encode("the cat", chat=False)
    sampling = SamplingConfig(temperature=1.5, constraint=HALF)
    seq = dec.engine.make_sequences([prompt], sampling, SpecConfig(tree=TreeConfig(shape=(3, 2))), [0])[0]
    dec.drafter.start([seq])
    draft = dec.drafter.propose([seq], [2], [TreeConfig(shape=(3, 2))])[0]
    masks = seq.constraint.node_masks(draft.tokens.tolist(), draft.tree.parents.tolist())  # (N + 1, V)
    for i, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft.tree.parents.tolist())):
        assert bool(masks[parent + 1, token]), i
        assert float(draft.q[i][~masks[parent + 1]].sum()) == 0.0  # q is zero where the constraint forbids
    report = run_audit(dec, prompt, sampling, num_draft_tokens=3, samples=1200, batch_size=300, seed=9,
                       tree=TreeConfig(shape=(3, 2), children="iid"))
    assert report.passed, report.to_dict()


# --- a draft that cannot write what the constraint allows --------------------------------------------------------
class OnlyAllows:
    """A constraint state allowing these ids after any path (what `constraints.ConstraintState.allowed_after` gives)."""

    def __init__(self, ids: list[int], vocab: int) -> None:
        self.allowed = torch.zeros(vocab, dtype=torch.bool)
        self.allowed[ids] = True

    def allowed_after(self, path):
        return self.allowed


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)],
                         ids=["greedy", "sampled"])
def test_a_draft_whose_logits_are_minus_infinity_on_every_allowed_token_drafts_nothing_there(sampling):
    """A draft head that keeps only some ids (`--draft-vocab`, an EAGLE head's vocabulary, self-speculation's cut
    head) gives the others -inf: where the constraint allows only those, the chain ends and the tree node gets no
    children (was: drawing from a row that is -inf everywhere raised, a fault the bench found in the self, Medusa and
    EAGLE drafters on JSON schemas, each restarting the drafter or leaving the row without drafts)."""
    from types import SimpleNamespace

    from verispec.drafters.drawing import allow_only, constrained_logits
    from verispec.drafters.tree_growth import TreeGrowth

    logits = torch.tensor([[2.0, 1.0, 0.5, float("-inf"), float("-inf")]])  # (1, 5): ids 3 and 4 cut from the head
    cut = OnlyAllows([3, 4], 5)
    assert constrained_logits(logits, SimpleNamespace(constraint=cut), []) is None
    kept = allow_only(logits, OnlyAllows([1, 4], 5).allowed)  # one allowed id the head can write
    assert kept is not None and torch.isfinite(kept).tolist() == [[False, True, False, False, False]]
    for tree in (TreeConfig(shape=(2,)), TreeConfig(budget=4, top_k=2)):
        growth = TreeGrowth(tree, 1, sampling, torch.Generator().manual_seed(0), 5, constraint=cut)
        growth.add_children(-1, logits[0], None)
        assert growth.tokens == []
        growth = TreeGrowth(tree, 1, sampling, torch.Generator().manual_seed(0), 5, constraint=OnlyAllows([1, 4], 5))
        growth.add_children(-1, logits[0], None)
        assert growth.tokens == [1]  # the one allowed id the head writes; never the cut one
