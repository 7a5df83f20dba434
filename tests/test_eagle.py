"""EAGLE-3 heads (`--draft eagle:DIR`): the SpecForge checkpoint format and its refusals, the runners' layer
features taken from the verification pass, the head's cache following the committed tokens, exactness (greedy
equality for chains, static and dynamic trees, argmax drafts; chi-square at temperature / top-k / top-p for
chains and trees with sampled and top-token children; batched = single), and training with the
training-time test (`verispec train-heads --kind eagle3`: checkpoints, resume, bad input)."""

import json
import math

import pytest
import torch

from conftest import forward_tree, tiny_model
from drafting import drafts_accepted
from test_medusa import cli_greedy_equals_plain, second_tokens_follow_the_target, small  # noqa: F401 - a fixture
from tiny_gguf import T, gguf_from_hf
from verispec.config import SamplingConfig, SpecConfig, TreeConfig
from verispec.drafters.eagle import EagleDrafter
from verispec.engine import DecodeBatch, SpeculativeEngine
from verispec.errors import VerispecError
from verispec.models.heads.eagle3 import Eagle3Config, Eagle3Head, load_eagle3
from verispec.models.gguf.model import load_gguf
from verispec.models.gguf.runner import NativeRunner
from verispec.models.runners.hf import ModelRunner

GREEDY = SamplingConfig(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]
AUX = (0, 2, 3)


def random_head(model, draft_vocab=48, aux=AUX, seed=0, scale=0.2):
    """A head for `model` (hidden 32, 64 tokens) over every fourth-ish id, weights random."""
    E, V = model.config.hidden_size, model.config.vocab_size
    config = Eagle3Config(hidden=E, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=V, draft_vocab=draft_vocab,
                          target_hidden=E, aux_layers=aux)
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, scale)
    head.set_vocabulary(torch.linspace(0, V - 1, draft_vocab).round().long())
    return head.eval()


def trained_head(runner, steps=150, seed=0):
    """A head trained on the runner's own answers (so it agrees with the target often)."""
    from verispec.head_training.common import split
    from verispec.head_training.eagle3_run import EmbeddingTable
    from verispec.head_training.eagle3_train import EagleTrainConfig, collect, draft_vocabulary, new_head, train
    from verispec.models.heads.shipped import final_norm, lm_head_rows

    config = EagleTrainConfig(draft_vocab=48, intermediate=64, heads=4, kv_heads=2, tokens=24, top_k=8, steps=steps,
                              batch_size=4, lr=3e-3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    samples = collect(runner, prompts, config, AUX, show=False)
    train_set, val_set = split(samples, 0.2, seed)
    ids = draft_vocabulary(train_set, config.draft_vocab, runner.vocab_size)
    head = new_head(runner, config, AUX, ids, lm_head_rows(runner, ids), final_norm(runner))
    log = train(head, train_set, val_set, EmbeddingTable(runner, samples), config, show=False)
    return head, log


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = tiny_model("llama", vocab=64, seed=0, layers=4, sharpness=30.0)
    native = NativeRunner(load_gguf(gguf_from_hf(model, tmp_path_factory.mktemp("m") / "t.gguf", T.F32),
                                    show_progress=False))
    return model, native


@pytest.fixture(scope="module")
def trained(pair):
    return trained_head(ModelRunner(pair[0]))


def plain(runner, prompts=PROMPTS, tokens=30):
    return [s.generated for s in SpeculativeEngine(runner, None, set()).generate(prompts, GREEDY, SpecConfig(max_new_tokens=tokens))]


# ---------------------------------------------------------------- the checkpoint format


def test_a_checkpoint_in_the_specforge_format_round_trips(pair, tmp_path):
    model, _ = pair
    head = random_head(model)
    head.save(tmp_path / "eagle", dtype=torch.float32)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 48
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "eagle" / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.mlp.down_proj.weight"} <= names
    loaded = load_eagle3(tmp_path / "eagle", 32, 64, 4)
    assert torch.equal(loaded.target_ids, head.target_ids) and bool(loaded.t2d[head.target_ids].all())
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded.logits(x), head.logits(x))
    assert bool(torch.isinf(head.logits(x)[:, ~head.t2d]).all())


def test_published_variants_load(pair, tmp_path):
    """`layers.0.*` names, the layer ids at the top level, a .bin file and an embedding of the head's own."""
    model, _ = pair
    head = random_head(model)
    head.save(tmp_path / "a", dtype=torch.float32)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    tensors["embed_tokens.weight"] = torch.randn(64, 32)
    (tmp_path / "b").mkdir()
    torch.save(tensors, tmp_path / "b" / "pytorch_model.bin")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config.pop("eagle_config")
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    loaded = load_eagle3(tmp_path / "b", 32, 64, 4)
    assert loaded.config.aux_layers == (1, 2, 3) and loaded.embed_tokens is not None
    torch.testing.assert_close(loaded.midlayer.self_attn.q_proj.weight, head.midlayer.self_attn.q_proj.weight)


def test_bad_eagle_checkpoints_are_one_clear_line(pair, tmp_path):
    model, _ = pair
    random_head(model).save(tmp_path / "good")
    with pytest.raises(VerispecError, match="fuses three features of width 32; this target's hidden states are 16"):
        load_eagle3(tmp_path / "good", 16, 64, 4)
    with pytest.raises(VerispecError, match="vocabulary of 64 tokens; this target has 100"):
        load_eagle3(tmp_path / "good", 32, 100, 4)
    with pytest.raises(VerispecError, match=r"reads the target's layers \[0, 2, 3\]; this target has 3"):
        load_eagle3(tmp_path / "good", 32, 64, 3)
    with pytest.raises(VerispecError, match="config.json is missing"):
        load_eagle3(tmp_path, 32, 64, 4)
    from safetensors.torch import load_file, save_file

    def variant(name, change_tensors=None, change_config=None):
        folder = tmp_path / name
        folder.mkdir()
        tensors = load_file(str(tmp_path / "good" / "model.safetensors"))
        config = json.loads((tmp_path / "good" / "config.json").read_text())
        if change_tensors:
            change_tensors(tensors)
        if change_config:
            change_config(config)
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    cases = [
        (variant("no_d2t", lambda t: t.pop("d2t")), "'d2t' .* is missing"),
        (variant("zero_d2t", lambda t: t["d2t"].zero_()), "d2t is all zeros"),
        (variant("bad_d2t", lambda t: t["d2t"].fill_(60)), "outside the target's vocabulary"),
        (variant("no_fc", lambda t: t.pop("fc.weight")), "'fc.weight' is missing"),
        (variant("no_mlp", lambda t: t.pop("midlayer.mlp.up_proj.weight")), "'midlayer.mlp.up_proj.weight' is missing"),
        (variant("shape", change_config=lambda c: c.update(intermediate_size=40)), "has shape .* the config says"),
        (variant("arch", change_config=lambda c: c.update(architectures=["LlamaForCausalLM"])), "name no EAGLE-3 head"),
    ]
    for folder, fragment in cases:
        with pytest.raises(VerispecError, match=fragment):
            load_eagle3(folder, 32, 64, 4)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with pytest.raises(VerispecError, match="no EAGLE-3 weights"):
        load_eagle3(tmp_path / "noweights", 32, 64, 4)


# ---------------------------------------------------------------- features and the head's cache


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_both_runners_keep_every_read_tokens_layer_states(pair, backend):
    model, native = pair
    runner = native if backend == "native" else ModelRunner(model)
    ids = PROMPTS[1]
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states  # entering layer i: [i]
    expected = torch.cat([states[i][0] for i in AUX], dim=-1)  # (T, 3E)
    runner.aux_layers = AUX
    state = runner.new_state(2)
    runner.forward(state, [ids[:5], ids[:2]], [1, 1])
    assert [a.shape[0] for a in runner.aux_features] == [5, 2]
    runner.forward(state, [ids[5:], []], [2, 0])
    assert runner.aux_features[1].shape[0] == 0
    torch.testing.assert_close(runner.aux_features[0], expected[5:], rtol=1e-4, atol=1e-4)
    state = runner.new_state(1)
    runner.forward(state, [ids[:6]], [1])
    forward_tree(runner, state, [[]], [[ids[6], ids[7], 0]], [[-1, 0, -1]])  # nodes read in the order given
    torch.testing.assert_close(runner.aux_features[0][:2], expected[6:8], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tree", [None, TreeConfig(shape=(2, 2, 1)), TreeConfig(budget=6, top_k=2)],
                         ids=["chain", "static-tree", "dynamic-tree"])
@pytest.mark.parametrize("constrained", [False, True], ids=["free", "constrained"])
def test_the_heads_cache_holds_the_targets_features_of_the_committed_tokens(pair, trained, tree, constrained):
    """After each step the head's committed entries are what one pass of the head over the sequence gives: the
    target's fused features at positions 0 .. N - 2 with the embeddings of tokens 1 .. N - 1. Under a constraint
    too, where forced runs (and a cut of a chain) are verified in place of the head's own drafts."""
    from test_medusa import FORCING, constrained_engines

    model, _ = pair
    runner = ModelRunner(model)
    head, _ = trained
    drafter = EagleDrafter(runner, head)
    engine = constrained_engines(runner, drafter)[1] if constrained else SpeculativeEngine(runner, drafter, set())
    batch = DecodeBatch(engine)
    sampling = FORCING if constrained else GREEDY
    batch.add(engine.make_sequences(PROMPTS, sampling, SpecConfig(num_draft_tokens=3, max_new_tokens=40, tree=tree), 0))
    for _ in range(4):
        engine.step(batch)
        drafter.propose(batch.sequences, [1] * len(batch.sequences))  # catches up, then drafts one token
        for seq, row in zip(batch.sequences, drafter.rows):
            tokens = seq.tokens
            with torch.no_grad():
                states = model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
                features = head.fc(torch.cat([states[i][0] for i in AUX], dim=-1))  # (N - 1, E)
                _, k, _ = head.new_kv(runner.token_embeddings(torch.tensor(tokens[1:])), features,
                                      torch.arange(len(tokens) - 1))
            assert row.length == len(tokens) - 1
            torch.testing.assert_close(row.keys[: row.length], k, rtol=1e-4, atol=1e-4)


def test_the_heads_linears_on_the_native_kernels_match_torch(pair):
    """Beside a native target the head's linears run in Q8_0 on the native kernels (torch's Linear the reference)."""
    from verispec.models.gguf.convert import NativeLinear, native_linears

    model, native = pair
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(5, 64)
    with torch.no_grad():
        expected = linear(x)
    torch.testing.assert_close(NativeLinear(linear)(x), expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))
    head = random_head(model)
    assert native_linears(head) == 8  # fc, q, k, v, o, gate, up, lm_head (down_proj takes 48 inputs: stays torch)
    drafter = EagleDrafter(native, random_head(model))
    assert isinstance(drafter.head.lm_head, NativeLinear) and not isinstance(random_head(model).lm_head, NativeLinear)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_eagle_speculation_equals_plain_decoding(pair, trained, backend):
    model, native = pair
    runner = native if backend == "native" else ModelRunner(model)
    expected = plain(runner)
    head, _ = trained
    for argmax in (False, True):
        engine = SpeculativeEngine(runner, EagleDrafter(runner, head, argmax=argmax), set())
        for tree in (None, TreeConfig(shape=(2, 2, 1)), TreeConfig(budget=6, top_k=2)) if not argmax else (None,):
            out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
            assert [s.generated for s in out] == expected, (argmax, tree)
            drafted, accepted = drafts_accepted(out)
            assert accepted < drafted


def test_argmax_drafts_are_chains_only_even_when_set_after_construction(pair, trained):
    """An argmax head drafts one-hot chains: a tree request is refused in one line, however argmax was set (the
    registry sets it on a built drafter)."""
    from verispec.errors import VerispecError

    model, native = pair
    head, _ = trained
    drafter = EagleDrafter(native, head)
    assert drafter.traits.trees and not drafter.traits.restartable
    drafter.argmax = True
    assert not drafter.traits.trees
    engine = SpeculativeEngine(native, drafter, set())
    with pytest.raises(VerispecError, match="cannot draft trees"):
        engine.check_tree_request(TreeConfig(budget=6))


def test_lookup_first_copies_from_the_context_and_stays_exact(pair, trained, small):
    """Where the context repeats, the draft copies (one-hot q) and the head goes on from the copied token:
    greedy equality for chains and trees, chi-square when sampling."""
    from verispec.config import PromptLookupConfig

    model, native = pair
    lookup = PromptLookupConfig(max_ngram=3, min_ngram=1)
    drafter = EagleDrafter(native, trained[0], lookup=lookup)
    engine = SpeculativeEngine(native, drafter, set())
    for tree in (None, TreeConfig(budget=6, top_k=2)):
        out = engine.generate(PROMPTS, GREEDY, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
        assert [s.generated for s in out] == plain(native)
        drafts_accepted(out)
    seq = engine.make_sequences([[5, 6, 7, 8, 5, 6]], GREEDY, SpecConfig(num_draft_tokens=2), 0)[0]
    assert drafter._copied(seq, []) == 7 and drafter._copied(seq, [7]) == 8
    tiny, runner = small
    head = random_head(tiny, draft_vocab=6, aux=(0, 1, 1), scale=0.5, seed=4)
    second_tokens_follow_the_target(runner, EagleDrafter(runner, head, lookup=lookup), SamplingConfig(temperature=1.0),
                                    prompt=(1, 2, 1, 2, 1))


def test_a_seeded_eagle_request_is_the_same_alone_or_batched(pair, trained):
    _, native = pair
    engine = SpeculativeEngine(native, EagleDrafter(native, trained[0]), set())
    sampling = SamplingConfig(temperature=1.0, top_k=20)
    for tree in (None, TreeConfig(budget=6, top_k=2)):
        spec = SpecConfig(num_draft_tokens=3, max_new_tokens=20, tree=tree)
        batch = engine.generate(PROMPTS, sampling, spec, seeds=[11, 12, 13])
        for prompt, seed, seq in zip(PROMPTS, [11, 12, 13], batch):
            assert engine.generate([prompt], sampling, spec, seeds=[seed])[0].generated == seq.generated


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=4),
                                      SamplingConfig(temperature=1.2, top_p=0.8)], ids=["temperature", "top-k", "top-p"])
def test_sampled_eagle_speculation_follows_the_targets_distribution(small, sampling):
    """Chi-square on the second generated token (the first comes from the prompt step, before any feature), chains
    and trees with sampled and top-token children, the head's q over a reduced vocabulary (6 of 8 ids)."""
    model, runner = small
    head = random_head(model, draft_vocab=6, aux=(0, 1, 1), scale=0.5, seed=4)  # a 2-layer target
    second_tokens_follow_the_target(runner, EagleDrafter(runner, head), sampling)


def test_eagle_on_a_runner_without_features_or_another_targets_head_is_one_line(pair, tmp_path):
    from verispec.drafters.registry import build_drafter

    head_drafter = lambda spec, runner: build_drafter(spec, None, runner)  # noqa: E731

    model, native = pair

    class LlamaCppRunner:
        vocab_size = 64

    with pytest.raises(VerispecError, match="does not give them"):
        EagleDrafter(LlamaCppRunner(), random_head(model))
    with pytest.raises(VerispecError, match="does not give them"):
        head_drafter(f"eagle:{tmp_path}", LlamaCppRunner())
    with pytest.raises(VerispecError, match=r"reads the target's layers \(0, 2, 5\); this target has 4"):
        EagleDrafter(native, random_head(model, aux=(0, 2, 5)))
    with pytest.raises(VerispecError, match="the shipped eagle head was trained for"):
        head_drafter("eagle", native)
    with pytest.raises(VerispecError, match="the shipped medusa head was trained for"):
        head_drafter("medusa", native)


def test_auto_k_times_a_heads_drafted_token(pair, tmp_path, monkeypatch):
    """Heads have no runner for `measure_costs` to time: each times its own drafted token, and --auto-k uses it.
    The target's passes come from a fixed profile here (test_cli.py has the one test of their measurement)."""
    from test_medusa import random_heads
    from tiny_hf import save_tiny_model_dir
    from transformers import AutoModelForCausalLM

    import verispec.api
    from verispec import SpeculativeDecoder
    from verispec.drafters.medusa import MedusaDrafter
    from verispec.tuning import CostProfile

    passes = {1: 1.0, 2: 1.0, 3: 1.0}
    monkeypatch.setattr(verispec.api, "measure_costs", lambda target, draft, k_max: CostProfile(passes, 0.0))

    model, native = pair
    for drafter in (EagleDrafter(native, random_head(model)), MedusaDrafter(native, random_heads(model))):
        cost = drafter.token_cost()
        assert isinstance(cost, float) and math.isfinite(cost) and cost > 0  # timed: no speed threshold here
    folder = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    tiny = AutoModelForCausalLM.from_pretrained(str(folder))
    random_head(tiny, draft_vocab=tiny.config.vocab_size, aux=(0, 1, 1)).save(tmp_path / "eagle")
    decoder = SpeculativeDecoder.load(str(folder), f"eagle:{tmp_path / 'eagle'}")
    profile = decoder.auto_tuner(2).profile
    assert profile.target_pass == passes and profile.draft_token > 0  # the head's own timed token


# ---------------------------------------------------------------- training


def test_training_with_the_training_time_test_raises_agreement_and_tau(pair, trained):
    _, log = trained
    first, last = log["validation"][0], log["validation"][-1]
    assert last["tau"] > 1.5 and last["agreement"][0] > 0.4
    assert log["loss"][-1][1] < log["loss"][0][1] and first["step"] == 100


def test_training_batches_are_drawn_among_answers_of_like_length():
    """Batches come from buckets of similar lengths (little padding) and every answer is in exactly one bucket."""
    from verispec.head_training.eagle3_train import batch_of_like_lengths, length_buckets
    from verispec.models.heads.eagle3_ttt import Sample

    lengths = [5, 300, 7, 120, 40, 2, 90, 64, 33, 250, 11, 18, 77, 3]
    samples = [Sample(torch.zeros(n, dtype=torch.long), None, None, None, 0) for n in lengths]
    buckets = length_buckets(samples, batch_size=2, per_bucket=2)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    assert [len(b) for b in buckets] == [4, 4, 6]  # the short last bucket merged into the one before
    spans = [(min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in buckets]
    assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:]))
    g = torch.Generator().manual_seed(0)
    drawn = [batch_of_like_lengths(buckets, 2, g) for _ in range(600)]
    assert all(any(set(d) <= set(b) for b in buckets) for d in drawn)
    counts = torch.bincount(torch.tensor(drawn).flatten(), minlength=len(lengths)).float()
    assert counts.min() > 0.5 * counts.mean()  # every answer drawn about equally often


def test_answers_collected_in_a_batch_are_the_ones_collected_one_by_one(pair):
    from verispec.head_training.eagle3_train import EagleTrainConfig, collect

    _, native = pair
    config = EagleTrainConfig(tokens=6, top_k=4, window=5)
    alone = collect(native, PROMPTS, config, AUX, show=False, batch_size=1)
    together = collect(native, PROMPTS, config, AUX, show=False, batch_size=3)
    for a, b in zip(alone, together):
        assert a.start == b.start and torch.equal(a.tokens, b.tokens) and torch.equal(a.aux, b.aux)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
    assert alone[0].tokens.numel() == 5 + 6 and alone[0].start == 4 and alone[2].start == 0  # prompts cut to 5


def test_train_heads_eagle3_end_to_end_with_resume(tmp_path, capsys, monkeypatch):
    """The CLI on a tiny HF target: a run stopped after its first checkpoint leaves its answers and checkpoint in
    OUT.partial and no OUT; --resume goes on from there without collecting again and writes a head folder with
    its manifest, loadable as --draft eagle:DIR."""
    import verispec.head_training.eagle3_run as eagle_run
    from tiny_hf import save_tiny_model_dir
    from verispec.cli import main

    folder = save_tiny_model_dir(tmp_path / "target", "llama", seed=0)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"tell me about number {i}" for i in range(12)))
    out = tmp_path / "head"
    command = ["train-heads", "--kind", "eagle3", "--target", str(folder), "--data", str(prompts), "--out", str(out),
               "--tokens", "12", "--draft-vocab", "64", "--intermediate", "32", "--heads", "4", "--kv-heads", "2",
               "--batch-size", "2", "--val-fraction", "0.25", "--steps", "200"]
    real_train, real_collect = eagle_run.train, eagle_run.collect

    def stopped(*args, checkpoint=None, **kwargs):
        def stop(head, optimizer, step):
            checkpoint(head, optimizer, step)
            raise KeyboardInterrupt  # the run is stopped right after its first checkpoint

        return real_train(*args, checkpoint=stop, **kwargs)

    monkeypatch.setattr(eagle_run, "train", stopped)
    assert main(command) != 0 and "interrupted" in capsys.readouterr().err
    partial = tmp_path / "head.partial"
    assert not out.exists() and (partial / "answers.pt").is_file() and (partial / "checkpoint.pt").is_file()
    monkeypatch.setattr(eagle_run, "train", real_train)
    monkeypatch.setattr(eagle_run, "collect", lambda *a, **k: pytest.fail("--resume collected the answers again"))
    assert main([*command, "--resume"]) == 0
    assert "resuming at step 100 of 200" in capsys.readouterr().err
    monkeypatch.setattr(eagle_run, "collect", real_collect)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"config.json", "model.safetensors", "training.json"}
    assert not partial.exists()
    log = json.loads((out / "training.json").read_text())
    assert [v["step"] for v in log["validation"]] == [200]
    cli_greedy_equals_plain(folder, f"eagle:{out}", capsys)


def test_train_heads_refuses_bad_requests_in_one_line(tmp_path, capsys):
    from verispec.cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("taken")
    (tmp_path / "empty.txt").write_text("\n\n")
    for args, fragment in ((["--kind", "eagle3", "--rows", "5", "--out", str(tmp_path / "new")], "--rows does not apply"),
                           (["--kind", "eagle3", "--out", str(tmp_path / "new"), "--resume"], "nothing to go on from"),
                           (["--kind", "eagle3", "--out", str(tmp_path / "new"), "--heads", "3", "--kv-heads", "2"],
                            "multiple of kv_heads"),
                           (["--kind", "eagle3", "--out", str(tmp_path / "out")], "exists and is not empty"),
                           (["--kind", "eagle3", "--out", str(tmp_path / "new"), "--device", "tpu"], "choose cpu or cuda"),
                           *([] if torch.cuda.is_available() else [
                               ([*kind, "--out", str(tmp_path / "new"), "--device", "cuda"], "no CUDA device is visible")
                               for kind in (["--kind", "medusa"], ["--kind", "eagle3"])]),
                           (["--kind", "eagle3", "--out", str(tmp_path / "new"), "--data", str(tmp_path / "empty.txt")],
                            "no prompts in")):
        assert main(["train-heads", *args]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()


def test_eagle_heads_through_the_audit_and_the_server(tmp_path, capsys):
    """`verispec audit` passes with an EAGLE head drafting; the server answers requests together as it does alone."""
    from test_serve import assert_served_together_as_alone
    from tiny_hf import save_tiny_model_dir
    from transformers import AutoModelForCausalLM

    from verispec import SpeculativeDecoder
    from verispec.cli import main

    folder = save_tiny_model_dir(tmp_path / "target", "qwen2", seed=0, sharpness=3.0)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    layers = model.config.num_hidden_layers
    random_head(model, draft_vocab=model.config.vocab_size - 8, aux=(0, layers - 1, layers - 1), scale=0.3).save(
        tmp_path / "eagle")
    draft = f"eagle:{tmp_path / 'eagle'}"
    code = main(["audit", "--target", str(folder), "--draft", draft, "--prompt", "dog", "--no-chat", "--temperature",
                 "1.0", "--samples", "600", "--batch-size", "200", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["acceptance_rate"] > 0
    decoder = SpeculativeDecoder.load(str(folder), draft)
    assert_served_together_as_alone(decoder)


def test_skipping_the_prompt_in_later_unrolled_steps_changes_nothing(pair):
    """The training-time test runs steps after the first only from where a label can be reached: the same loss,
    gradients and agreement counts as running every index, on a batch of answers after prompts of different
    lengths."""
    from verispec.models.heads.eagle3_ttt import Sample, training_batch, unrolled

    torch.manual_seed(0)
    head = random_head(pair[0]).train()
    E, V, k = head.config.hidden, head.config.vocab, 3
    samples = []
    for prompt, answer in ((9, 6), (4, 8), (12, 3)):
        n = prompt + answer
        ids = torch.randint(V, (n, k))
        probs = torch.softmax(torch.randn(n, k), -1)
        ids[: prompt - 1], probs[: prompt - 1] = 0, 0
        samples.append(Sample(torch.randint(V, (n,)), torch.randn(n, 3 * E).half(), ids, probs, prompt - 1))
    table = torch.randn(V, E)
    batch = training_batch(samples, head, lambda t: table[t], 3)
    results = []
    for skip in (True, False):
        head.zero_grad()
        loss, stats = unrolled(head, *batch, 3, skip_unlabelled=skip)
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in head.parameters() if p.grad is not None]))
    (a, sa, ga), (b, sb, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert sa == sb and len(ga) == len(gb)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_constrained_eagle_keeps_the_targets_features_and_equals_constrained_plain_decoding(pair, trained):
    from test_medusa import FORCING, constrained_engines

    model, native = pair
    head, _ = trained
    plain, engine = constrained_engines(native, EagleDrafter(native, head))
    expected = [s.generated for s in plain.generate(PROMPTS, FORCING, SpecConfig(max_new_tokens=30))]
    for tree in (None, TreeConfig(budget=6, top_k=2)):
        out = engine.generate(PROMPTS, FORCING, SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree))
        assert [s.generated for s in out] == expected, tree
        assert sum(s.stats.forced_tokens for s in out) > 0


@pytest.mark.parametrize("tree", [None, TreeConfig(budget=6, top_k=2)], ids=["chain", "tree"])
def test_a_composite_of_suffix_decoding_and_a_head_keeps_the_heads_cache_and_equals_plain_decoding(pair, trained, tree):
    """Where suffix decoding's drafts are verified in place of the head's, the head's commit still sees them (it keeps
    the target's features at the accepted path): its cache equals one pass over the committed tokens after every step,
    and greedy output equals plain decoding's with both members drafting."""
    from verispec.config import SuffixConfig
    from verispec.drafters.composite import CompositeDrafter
    from verispec.drafters.suffix import SuffixDrafter
    from verispec.tuning import KTuner, CostProfile

    class FixedCosts(KTuner):
        def costs(self, rows=1):
            return self.profile

    model, _ = pair
    runner = ModelRunner(model)
    head, _ = trained
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=30, tree=tree)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2], *PROMPTS]
    expected = plain(runner, prompts)
    composite = CompositeDrafter([SuffixDrafter(SuffixConfig(min_match=1)), EagleDrafter(runner, head)],
                                 learn_costs=False)
    engine = SpeculativeEngine(runner, composite, set())
    tuner = FixedCosts(CostProfile({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15}, 0.02), learn_costs=False)
    batch = DecodeBatch(engine, tuner)
    batch.add(engine.make_sequences(prompts, GREEDY, spec, 0))
    eagle = composite.members[1]
    for _ in range(4):
        engine.step(batch)
        eagle.propose(batch.sequences, [1] * len(batch.sequences))  # catches up, then drafts one token
        for seq, row in zip(batch.sequences, eagle.rows):
            with torch.no_grad():
                states = model(torch.tensor([seq.tokens[:-1]]), output_hidden_states=True).hidden_states
                features = head.fc(torch.cat([states[i][0] for i in AUX], dim=-1))  # (N - 1, E)
                _, k, _ = head.new_kv(runner.token_embeddings(torch.tensor(seq.tokens[1:])), features,
                                      torch.arange(len(seq.tokens) - 1))
            assert row.length == len(seq.tokens) - 1
            torch.testing.assert_close(row.keys[: row.length], k, rtol=1e-4, atol=1e-4)
    composite = CompositeDrafter([SuffixDrafter(SuffixConfig(min_match=1)), EagleDrafter(runner, head)],
                                 learn_costs=False)
    out = SpeculativeEngine(runner, composite, set()).generate(prompts, GREEDY, spec, tuner=tuner)
    assert [s.generated for s in out] == expected
    drafts_accepted(out)
    assert all(composite.shares().values()), composite.shares()


SYSTEM = [(7 * i + 3) % 64 for i in range(30)]  # a long shared beginning


def _conversation(engine, sampling, spec, seed=4):
    """Three turns, each prompt the last prompt and answer and a new user turn."""
    prompt, turns = SYSTEM + [1, 2, 3], []
    for turn in range(3):
        seq = engine.generate([prompt], sampling, spec, seeds=seed + turn)[0]
        turns.append(seq)
        prompt = seq.tokens + [5, 6, turn]
    return turns


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.9, top_k=20)], ids=["greedy", "sampled"])
def test_an_eagle_heads_cache_follows_the_reused_prefixes(pair, trained, sampling):
    """With the target's prefix store on, the head keeps its finished rows' entries by their tokens and a joining row
    starts from them; the target takes as many positions (their features are never made again), so each later turn
    reads only what is new, and the answers are the same bits as without. Without a store of the head's own, the
    target reuses nothing for it."""
    from verispec.core.prefix import PrefixStore
    _, native = pair
    spec = SpecConfig(max_new_tokens=12, num_draft_tokens=3, stop_at_eos=False)
    cold = _conversation(SpeculativeEngine(native, EagleDrafter(native, trained[0]), set()), sampling, spec)
    drafter = EagleDrafter(native, trained[0])
    engine = SpeculativeEngine(native, drafter, set())
    engine.prefixes = PrefixStore(1 << 30)
    drafter.reuse_prefixes(1 << 30)
    warm = _conversation(engine, sampling, spec)
    assert [s.generated for s in warm] == [s.generated for s in cold]
    assert warm[0].stats.cached_tokens == 0 and drafter.prefixes.stats.hits == 2
    for before, seq in zip(warm, warm[1:]):  # the head's entries end a step or so short of its row's tokens
        assert len(before.tokens) - 2 - spec.num_draft_tokens <= seq.stats.cached_tokens <= len(before.tokens) - 2
    assert sum(s.stats.accepted_tokens for s in warm) > 0
    assert [s.stats.accepted_tokens for s in warm] == [s.stats.accepted_tokens for s in cold]  # the same drafts

    alone = SpeculativeEngine(native, EagleDrafter(native, trained[0]), set())  # the head keeps no store
    alone.prefixes = PrefixStore(1 << 30)
    turns = _conversation(alone, sampling, spec)
    assert [s.generated for s in turns] == [s.generated for s in cold]
    assert all(s.stats.cached_tokens == 0 for s in turns) and alone.prefixes.stats.hits == 0
