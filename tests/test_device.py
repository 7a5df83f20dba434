"""Where models run (`--device`, `models.device`): devices named in one line when torch has none of them, the
dtype each device defaults to, the CPU runners refusing a GPU, and `--compile` (the static cache and compiled passes
the GPU path uses) giving plain decoding's tokens through the CLI on the CPU."""

import json

import pytest
import torch

from drafting import drafts_accepted
from verispec.errors import VerispecError
from verispec.models.device import default_dtype, resolve_device
from verispec.models.loading import load_model

NO_CUDA = not torch.cuda.is_available()


def test_auto_is_the_cpu_without_a_gpu_and_unknown_devices_are_one_line():
    if NO_CUDA:
        assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(VerispecError, match="unknown device 'tpu': choose auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(VerispecError, match="unknown device 'mps'"):
        resolve_device("mps")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_gpu_that_is_not_there_is_one_line(name):
    with pytest.raises(VerispecError, match=f"--device {name}: torch sees no CUDA device"):
        resolve_device(name)


def test_devices_default_to_their_dtype():
    assert default_dtype(torch.device("cpu")) == "float32"
    assert default_dtype(torch.device("cuda")) == "bfloat16"


def test_the_cpu_runners_refuse_a_gpu_and_compile(tmp_path):
    from tiny_gguf import T, gguf_from_hf

    from conftest import tiny_model

    path = gguf_from_hf(tiny_model("llama"), tmp_path / "t.gguf", T.F32)
    if not NO_CUDA:
        with pytest.raises(VerispecError, match="the native backend runs on the CPU"):
            load_model(str(path), backend="native", device="cuda")
    with pytest.raises(VerispecError, match="--compile runs the torch route; the native backend has its own kernels"):
        load_model(str(path), backend="native", compiled=True)


def test_cli_compile_gives_plain_decodings_tokens(tmp_path, capsys):
    from tiny_hf import save_tiny_model_dir

    from verispec.cli import main

    target = save_tiny_model_dir(tmp_path / "target", "qwen2", seed=1, sharpness=3.0)  # seed 0 writes 2 tokens, then EOS
    common = ["generate", "--json", "--target", str(target), "--prompt", "hello there", "--temperature", "0",
              "--max-new-tokens", "20", "--draft", "ngram", "-k", "3"]
    outputs = []
    for extra in ([], ["--compile"], ["--draft", "none"]):
        assert main([*common, *extra]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"] == outputs[2]["token_ids"]  # eager, compiled, plain
    for speculative in outputs[:2]:
        drafts_accepted([speculative])
    assert main([*common, "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_the_gpu_benchmark_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    """benchmarks/gpu_bench.py is what a GPU session runs: a dry run here keeps it working (CPU, eager, tiny)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"
    monkeypatch.setattr(sys, "argv", ["gpu_bench.py", "--sizes", "tiny", "--device", "cpu", "--tokens", "8",
                                      "--no-compile", "--out", str(tmp_path)])
    runpy.run_path(str(script), run_name="__main__")
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    (result,) = report["results"]
    assert set(result["pass_costs"]["v"]) == {str(k) for k in range(1, 17)}
    for mode in ("greedy", "t0.7"):
        assert result[mode]["verispec"]["tokens"] == 8 and result[mode]["hf-assisted"]["tokens"] == 8
        assert set(result[mode]["batches"]) == {"1", "2", "4", "8"}
    assert result["greedy"]["greedy_equal_prefix_vs_plain"] == 8  # float32 here: speculation gives plain's tokens
    assert (tmp_path / "pass_costs.png").is_file() and (tmp_path / "speed.png").is_file()


def test_the_gpu_profile_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    """benchmarks/gpu_profile.py (where a GPU decode step's time goes) keeps working between GPU sessions."""
    import runpy
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    monkeypatch.setattr(sys, "argv", ["gpu_profile.py", "--size", "tiny", "--device", "cpu", "--tokens", "4",
                                      "--no-compile", "--out", str(tmp_path)])
    runpy.run_path(str(benchmarks / "gpu_profile.py"), run_name="__main__")
    report = json.loads((tmp_path / "profile.json").read_text())
    for layer in ("compiled_step", "runner_forward", "engine_plain"):
        assert report[f"{layer}_ms"] > 0 and 0 < report[f"{layer}_bandwidth_share"] < 1
    assert "Self CPU" in (tmp_path / "profile_table.txt").read_text()
