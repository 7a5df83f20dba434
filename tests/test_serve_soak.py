"""The soak script (benchmarks/serve_soak.py) at a small scale: a flood, slow and non-reading clients, disconnects
at every stage, byte-by-byte headers and one long prompt beside normal traffic leave the server clean (no running
rows, no cache rows, nothing queued or reserved), healthy, with no 5xx but the concurrency limit's and every
normal request answered 200 or 429."""

import importlib.util
from pathlib import Path

from tiny_hf import save_tiny_model_dir
from verispec import SpeculativeDecoder


def test_the_soak_leaves_the_server_clean(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_soak", Path(__file__).parent.parent / "benchmarks/serve_soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    decoder = SpeculativeDecoder.load(str(save_tiny_model_dir(tmp_path / "t", "llama", seed=0)),
                                      str(save_tiny_model_dir(tmp_path / "d", "llama", seed=1)))
    args = soak.parser().parse_args(["--requests", "12", "--flood", "30", "--slow", "2", "--tricklers", "3",
                                     "--disconnects", "60", "--rounds", "2", "--long-words", "15",
                                     "--header-timeout", "1", "--trickle-seconds", "4"])
    summary = soak.run_soak(decoder, args)
    assert soak.clean(summary), summary
    answers = summary["answers"]
    assert sum(n for kind, n in answers.items() if kind.startswith("disconnect stage")) == 60
    assert answers.get("trickler closed by the server") == 3
    assert set(k for k in answers if k.startswith("normal")) <= {"normal 200", "normal 429", "normal 503"}
    assert summary["normal_served"] >= 1 and summary["long_prompt_first_token_s"] is not None
