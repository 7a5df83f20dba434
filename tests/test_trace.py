"""Tracing verification: on or off, the same seed gives the same tokens; records agree with the
rule (min(1, p/q), u < p/q <=> accepted, residual); `generate --trace` and `replay` round-trip.
The same for trees: records agree with the engine's stats and the recorded uniforms reproduce the walk."""

import json

import pytest
import torch

from conftest import noisy_copy, tiny_model
from tiny_hf import save_tiny_model_dir
from verispec.cli import main
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.drafters.prompt_lookup import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runners.hf import ModelRunner
from verispec.rejection import residual_distribution, verify, walk_tree
from verispec.trace import Tracer, tracing, tree_verification_record, verification_record
from verispec.tree import Draft, static_parents, tree_from_parents

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11]]
# Runs are repeated with these seeds until the records have covered accepted and rejected drafts: whether a
# given seed draws both depends on the tokens it happens to sample (prompt lookup's copies are rarely
# accepted by a near-uniform tiny target at temperature 1), and the checks must see both outcomes.
COVERAGE_SEEDS = range(5, 25)


def make_engine(kind):
    target = tiny_model("llama", vocab=32, seed=0, sharpness=3.0)
    drafter = DraftModelDrafter(ModelRunner(noisy_copy(target, 0.5)), 32) if kind == "model" else PromptLookupDrafter()
    return SpeculativeEngine(ModelRunner(target), drafter, set())


def run(engine, sampling, tracer=None, seed=5):
    steps, tokens = [], {}
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24)
    with tracing(engine, tracer) if tracer else _null():
        for event, seq in engine.stream(PROMPTS, sampling, spec, seeds=seed):
            tokens[seq.index] = list(seq.generated)
            if tracer:
                steps.append(tracer.step(event, seq))
    return tokens, steps


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_tracing_on_or_off_gives_the_same_tokens(kind, temperature):
    sampling = SamplingConfig(temperature=temperature)
    verdicts, steps = set(), []
    for seed in COVERAGE_SEEDS:
        plain, _ = run(make_engine(kind), sampling, seed=seed)
        traced, seed_steps = run(make_engine(kind), sampling, Tracer(), seed=seed)
        assert traced == plain
        assert seed_steps and all(s["committed"] for s in seed_steps)
        steps += seed_steps
        verdicts |= {d["verdict"] for s in seed_steps for d in s["drafts"]}
        if {"accepted", "rejected"} <= verdicts:
            break
    assert "accepted" in verdicts and "rejected" in verdicts  # the check covers both outcomes
    for s in steps:
        for d in s["drafts"]:
            ratio = d["p"] / d["q"]  # of values rounded to 6 digits
            assert d["accept_probability"] == pytest.approx(min(1.0, ratio), rel=1e-3, abs=1e-5)
            if temperature == 0:
                assert d["uniform"] is None
            elif d["verdict"] != "discarded" and abs(d["uniform"] - ratio) > 1e-3:
                assert (d["uniform"] < d["p"] / d["q"]) == (d["verdict"] == "accepted")
        assert s["counters"]["target_calls"] == s["step"]


def test_verify_returns_the_uniforms_it_used_without_changing_the_draws():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 10, generator=gen), -1)  # (n+1, V)
    q = torch.softmax(torch.randn(3, 10, generator=gen), -1)  # (n, V)
    x = torch.tensor([1, 4, 7])
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    verdict, u = verify(p, Draft(x, q), a, return_uniforms=True)
    assert verdict == verify(p, Draft(x, q), b)
    assert torch.equal(a.get_state(), b.get_state())
    assert torch.equal(u, torch.rand(3, generator=torch.Generator().manual_seed(9)))


def test_verification_record_lists_overlap_excess_and_residual():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])  # (n+1, V), n = 1
    q = torch.tensor([[0.2, 0.6, 0.1, 0.1]])  # (n, V)
    from verispec.rejection import Verdict

    rec = verification_record(p, torch.tensor([1]), q, Verdict((), 0, False), torch.tensor([0.9]), top=4)
    d = rec["drafts"][0]
    assert (d["p"], d["q"], d["accept_probability"], d["uniform"], d["verdict"]) == (0.3, 0.6, 0.5, 0.9, "rejected")
    pos = rec["positions"][0]
    assert pos["acceptance_mass"] == pytest.approx(0.2 + 0.3 + 0.1 + 0.0)
    by_token = {c["token"]: c for c in pos["candidates"]}
    residual = residual_distribution(p[0], q[0])
    for t, c in by_token.items():
        assert c["overlap"] == pytest.approx(min(p[0, t], q[0, t]))
        assert c["draft_excess"] == pytest.approx(max(0.0, q[0, t] - p[0, t]))
        assert c["residual"] == pytest.approx(float(residual[t]), abs=1e-6)
    assert by_token[0]["residual"] == pytest.approx(0.3 / 0.4)
    assert rec["positions"][1]["acceptance_mass"] is None and rec["positions"][1]["candidates"][0]["token"] == 3


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return str(save_tiny_model_dir(root / "t", seed=0, sharpness=3.0)), str(save_tiny_model_dir(root / "d", seed=1, sharpness=3.0))


def test_generate_trace_then_replay(model_dirs, tmp_path, capsys):
    target, draft = model_dirs
    path = tmp_path / "trace.json"
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "abc", "--max-new-tokens", "16",
            "--seed", "3", "--no-chat", "--temperature", "1", "-k", "3", "--json"]
    assert main(args + ["--trace", str(path)]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == traced["token_ids"]
    doc = json.loads(path.read_text())
    assert [t for s in doc["steps"] for t in s["committed"]] == traced["token_ids"]
    assert "".join(text for s in doc["steps"] for text, _ in s["pieces"]) == traced["text"]
    assert doc["steps"][-1]["counters"]["target_calls"] == traced["stats"]["target_forward_passes"]
    assert main(["replay", str(path), "--delay", "0", "--details", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "min(1,p/q)=" in out and "tokens per target pass" in out
    assert main(["replay", str(path), "--delay", "0", "--no-color"]) == 0
    assert traced["text"].replace("\n", "") in capsys.readouterr().out.replace("\n", "")


def test_replay_refuses_a_file_that_is_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    assert main(["replay", str(bad)]) == 2
    assert "not a verispec trace" in capsys.readouterr().err


# --- trees ----------------------------------------------------------------------------------------
TREES = {"shape": TreeConfig(shape=(2, 2, 1)), "budget": TreeConfig(budget=6, top_k=2)}


class KeepingTracer(Tracer):
    """A Tracer that also keeps what the engine handed it (p rows, the Draft, the Verdict)."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __call__(self, seq, draft, p, verdict, uniforms):
        super().__call__(seq, draft, p, verdict, uniforms)
        self.kept.append((draft, torch.stack([p[i] for i in range(len(draft) + 1)]), verdict))  # (N + 1, V)


def run_tree(engine, sampling, tree, tracer=None, seed=5):
    steps, tokens, stats = [], {}, {}
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=24, tree=tree)
    with tracing(engine, tracer) if tracer else _null():
        for event, seq in engine.stream(PROMPTS, sampling, spec, seeds=seed):
            tokens[seq.index], stats[seq.index] = list(seq.generated), seq.stats
            if tracer:
                steps.append((seq.index, tracer.step(event, seq)))
    return tokens, steps, stats


@pytest.mark.parametrize("kind", ["model", "ngram"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("tree", list(TREES))
def test_tree_tracing_on_or_off_gives_the_same_tokens_and_records_agree(kind, temperature, tree):
    verdicts: set[str] = set()
    for seed in COVERAGE_SEEDS:
        verdicts |= _check_tree_records(kind, temperature, tree, seed)
        if {"accepted", "rejected"} <= verdicts:
            break
    assert {"accepted", "rejected"} <= verdicts  # the checks cover both outcomes


def _check_tree_records(kind, temperature, tree, seed) -> set[str]:
    """One seed's traced and untraced tree runs: same tokens, records that agree with the engine and the
    rule. Returns the node verdicts the records hold."""
    sampling = SamplingConfig(temperature=temperature)
    plain, _, _ = run_tree(make_engine(kind), sampling, TREES[tree], seed=seed)
    tracer = KeepingTracer()
    traced, steps, stats = run_tree(make_engine(kind), sampling, TREES[tree], tracer, seed=seed)
    assert traced == plain
    assert len(tracer.kept) == len(steps)
    verdicts = {n["verdict"] for _, s in steps for n in s["tree"]["nodes"]}
    for index in (0, 1):  # the records agree with the engine's stats, per sequence
        mine = [s for i, s in steps if i == index]
        st = stats[index]
        assert [t for s in mine for t in s["committed"]] == traced[index]
        assert sum(s["num_accepted"] for s in mine) == st.accepted_tokens
        assert sum(s["tree"]["size"] for s in mine) == st.draft_tokens
        assert len(mine) == st.target_forward_passes == mine[-1]["counters"]["target_calls"]
        assert mine[-1]["counters"]["tokens_per_target_call"] == pytest.approx(st.tokens_per_target_pass, abs=1e-6)
        assert sum(s["bonus"] for s in mine) == st.bonus_tokens
    for (_, s), (draft, p, verdict) in zip(steps, tracer.kept):
        tree_rec, nodes = s["tree"], s["tree"]["nodes"]
        assert tree_rec["path"] == list(verdict.path) and s["num_accepted"] == len(verdict.path)
        assert s["token"] == verdict.token and s["bonus"] == verdict.bonus
        assert [n["parent"] for n in nodes] == draft.tree.parents.tolist()
        assert [n["depth"] for n in nodes] == draft.tree.depths.tolist()
        assert [n["token"] for n in nodes] == draft.tokens.tolist()
        # the path goes down from the root, its nodes accepted; its tokens were committed first
        assert [nodes[i]["parent"] for i in tree_rec["path"]] == ([-1] + tree_rec["path"])[: len(tree_rec["path"])]
        assert all(nodes[i]["verdict"] == "accepted" for i in tree_rec["path"])
        assert sum(n["verdict"] == "accepted" for n in nodes) == len(tree_rec["path"])
        assert [d["node"] for d in s["drafts"]] == tree_rec["path"]
        assert len(s["positions"]) == len(s["drafts"]) + 1
        assert s["committed"] == ([nodes[i]["token"] for i in tree_rec["path"]] + [s["token"]])[: len(s["committed"])]
        for n in nodes:
            if n["verdict"] == "not tried":
                assert n["p"] is None and n["uniform"] is None and n["position"] is None
                continue
            ratio = n["p"] / n["q"]  # of values rounded to 6 digits
            assert n["accept_probability"] == pytest.approx(min(1.0, ratio), rel=1e-3, abs=1e-5)
            if temperature == 0:
                assert n["uniform"] is None and (n["verdict"] == "accepted") == (n["p"] == 1.0)
            elif abs(n["uniform"] - ratio) > 1e-3:
                assert (n["uniform"] < ratio) == (n["verdict"] == "accepted")
        # the uniforms are the ones verify used: walking the tree from them (untried nodes get
        # u = 2, which would reject anything) reproduces the verdict
        if temperature > 0:
            u = torch.tensor([2.0 if n["uniform"] is None else n["uniform"] for n in nodes])  # (N,)
            path, final, leaf = walk_tree(p, draft.tree, draft.tokens, draft.q, draft.siblings, u)
            assert path == verdict.path and leaf == verdict.bonus and final[verdict.token] > 0
    return verdicts


def test_verify_on_a_tree_returns_the_uniforms_it_used_without_changing_the_draws():
    gen = torch.Generator().manual_seed(0)
    parents = static_parents((3, 2))
    tree = tree_from_parents(parents)
    p = torch.softmax(torch.randn(len(parents) + 1, 10, generator=gen), -1)  # (N + 1, V)
    q = torch.softmax(torch.randn(len(parents), 10, generator=gen), -1)  # (N, V)
    tokens = torch.randint(0, 10, (len(parents),), generator=gen)  # (N,)
    for siblings in ("iid", "without_replacement"):
        for seed in range(20):
            a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            draft = Draft(tokens, q, tree=tree, siblings=siblings)
            verdict, u = verify(p, draft, a, return_uniforms=True)
            assert verdict == verify(p, draft, b)
            assert torch.equal(a.get_state(), b.get_state())
            assert torch.equal(u, torch.rand(len(parents), generator=torch.Generator().manual_seed(seed)))
            rec = tree_verification_record(p, draft, verdict, u)
            assert rec["tree"]["path"] == list(verdict.path)
            assert [n["uniform"] for n in rec["tree"]["nodes"] if n["uniform"] is not None] == \
                [float(u[n["node"]]) for n in rec["tree"]["nodes"] if n["verdict"] != "not tried"]


def test_tree_record_of_a_recovery_lists_the_residual_it_was_drawn_from():
    # root children 0 (token 1) and 1 (token 2), deterministic; p puts no mass on either -> both rejected
    tree = tree_from_parents((-1, -1))
    p = torch.tensor([[0.5, 0.0, 0.0, 0.5], [0.25] * 4, [0.25] * 4])  # (N + 1, V)
    draft = Draft(torch.tensor([1, 2]), tree=tree)
    verdict = verify(p, draft, torch.Generator().manual_seed(0))
    assert verdict.path == () and not verdict.bonus and verdict.token in (0, 3)
    rec = tree_verification_record(p, draft, verdict, torch.tensor([0.1, 0.2]))
    nodes = rec["tree"]["nodes"]
    assert [n["verdict"] for n in nodes] == ["rejected", "rejected"] and [n["try"] for n in nodes] == [0, 1]
    assert (nodes[1]["p"], nodes[1]["q"], nodes[1]["uniform"]) == (0.0, 1.0, pytest.approx(0.2))
    assert rec["tree"]["final"] == {"node": -1, "drawn_from": "residual", "position": nodes[1]["position"]}
    residual = {c["token"]: c["residual"] for c in rec["positions"][0]["candidates"]}
    assert residual[0] == residual[3] == 0.5 and rec["drafts"] == []


def test_generate_tree_trace_then_replay(model_dirs, tmp_path, capsys):
    target, draft = model_dirs
    path = tmp_path / "tree.json"
    args = ["generate", "--target", target, "--draft", draft, "--prompt", "abc", "--max-new-tokens", "16",
            "--seed", "3", "--no-chat", "--temperature", "1", "--tree-shape", "2,2", "--json"]
    assert main(args + ["--trace", str(path)]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == traced["token_ids"]
    doc = json.loads(path.read_text())
    assert doc["spec"]["tree"]["shape"] == [2, 2]
    assert all(s["tree"]["size"] == 6 or s is doc["steps"][-1] for s in doc["steps"])
    assert [t for s in doc["steps"] for t in s["committed"]] == traced["token_ids"]
    assert sum(s["num_accepted"] for s in doc["steps"]) == traced["stats"]["accepted_tokens"]
    assert "".join(text for s in doc["steps"] for text, _ in s["pieces"]) == traced["text"]
    assert main(["replay", str(path), "--delay", "0", "--details", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "tree speculation: static tree, shape 2,2" in out and "accepted path: " in out
    tried = sum(n["try"] is not None for s in doc["steps"] for n in s["tree"]["nodes"])
    assert out.count("min(1,p/q)=") == tried and "tokens per target pass" in out
    assert main(["replay", str(path), "--delay", "0", "--no-color"]) == 0
    assert traced["text"].replace("\n", "") in capsys.readouterr().out.replace("\n", "")
