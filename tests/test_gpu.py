"""On a CUDA GPU only (`pytest -m gpu`; skipped where torch sees none): the static-cache runner with compiled passes
gives Hugging Face `generate`'s greedy tokens on the GPU, sampled output follows the target's distribution
(chi-square, sampling and verification on the GPU from per-sequence GPU generators), and host syncs stay at the
decisions (at most three per pass: a greedy draft's token, the accepted count and the next token), counted with
torch's sync debug mode."""

import copy
import warnings

import pytest
import torch

from conftest import noisy_copy, tiny_model
from drafting import drafts_accepted
from test_exactness import PROMPT, THRESHOLD, check_distribution
from verispec.config import SamplingConfig, SpecConfig
from verispec.drafters.draft_model import DraftModelDrafter
from verispec.engine import SpeculativeEngine
from verispec.models.runners.static import StaticRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def on_gpu(model):
    return copy.deepcopy(model).to(CUDA)


def test_greedy_speculation_on_the_gpu_gives_hf_generates_tokens():
    target = tiny_model("llama", vocab=64, seed=4, sharpness=4.0)
    draft = noisy_copy(target, 0.5)
    gpu_target = on_gpu(target)
    prompt = [1, 2, 3, 4, 5, 6]
    with torch.inference_mode():
        want = gpu_target.generate(torch.tensor([prompt], device=CUDA), do_sample=False, max_new_tokens=24,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    engine = SpeculativeEngine(StaticRunner(gpu_target, 256), DraftModelDrafter(StaticRunner(on_gpu(draft), 256), 64), set())
    seq = engine.generate([prompt], SamplingConfig(temperature=0), SpecConfig(num_draft_tokens=3, max_new_tokens=24,
                                                                             stop_at_eos=False))[0]
    assert seq.generated == want
    drafts_accepted([seq])  # on the CPU this pair drafts 43 tokens here and has 8 accepted


def test_sampled_speculation_on_the_gpu_follows_the_target():
    target = tiny_model("qwen2", vocab=8, seed=3, sharpness=4.0)
    draft = noisy_copy(target, 1.0)
    sampling = SamplingConfig(temperature=1.0)
    engine = SpeculativeEngine(StaticRunner(on_gpu(target), 128), DraftModelDrafter(StaticRunner(on_gpu(draft), 128), 8),
                               set())
    seqs = engine.generate([PROMPT] * 2000, sampling, SpecConfig(num_draft_tokens=2, max_new_tokens=3, stop_at_eos=False),
                           seeds=0)
    for fit in check_distribution(target, [tuple(s.generated[:3]) for s in seqs], sampling):
        assert fit.p_value > THRESHOLD, fit


def test_host_syncs_are_only_the_decisions():
    target = tiny_model("llama", vocab=64, seed=4, sharpness=4.0)
    runner = StaticRunner(on_gpu(target), 256)
    engine = SpeculativeEngine(runner, DraftModelDrafter(StaticRunner(on_gpu(noisy_copy(target, 0.5)), 256), 64), set())
    spec = SpecConfig(num_draft_tokens=3, max_new_tokens=16, stop_at_eos=False)
    engine.generate([[1, 2, 3]], SamplingConfig(temperature=0), spec)  # compile first
    passes = 0
    forward = StaticRunner._run

    def counting(self, *args, **kwargs):
        nonlocal passes
        passes += 1
        return forward(self, *args, **kwargs)

    StaticRunner._run = counting
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate([[1, 2, 3]], SamplingConfig(temperature=0), spec)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        StaticRunner._run = forward
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert passes and syncs <= 3 * passes, (syncs, passes)
