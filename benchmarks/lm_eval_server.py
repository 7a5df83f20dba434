"""lm-evaluation-harness against `verispec serve`: the same scores as a plain verispec server's, request for request.

    .venv/bin/python benchmarks/lm_eval_server.py --threads 2 [--docs 40] [--out artifacts/lm_eval]

(`pip install "lm_eval[api]"` first.) Two tasks written here as lm-eval task files over JSON lines in a temporary folder
(no dataset hub is reachable; the documents are made by this script, arithmetic with a fixed seed):
- `vs_arith_choice`, a loglikelihood task (`output_type: multiple_choice`, metric acc) through `local-completions`:
  each choice scored by the prompt's log-probabilities (`echo` with `logprobs`), tokenized by the server's own
  `/tokenize` (lm-eval's remote tokenizer reads `/tokenizer_info`);
- `vs_arith_answer`, a generation task (`generate_until`, metric exact_match) through `local-chat-completions` with
  the model's chat template applied, greedy.
Each server runs alone in its own process, in turn: `verispec serve` with its defaults, then `verispec serve --draft
none` (plain decoding). Printed: each task's scores on both, whether every document's log-likelihoods and every
generated answer are equal, and each run's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server_process import free_port, server

CHOICE_TASK = """task: vs_arith_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""

ANSWER_TASK = """task: vs_arith_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}} Reply with the number only."
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path, docs: int) -> None:
    """The two tasks' YAML and their documents: sums and products of small numbers, three wrong choices each."""
    rng = random.Random(0)
    choice_rows, answer_rows = [], []
    for i in range(docs):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        op, value = ("+", a + b) if i % 2 == 0 else ("*", a * b)
        wrong = set()
        while len(wrong) < 3:
            w = value + rng.choice([-10, -2, -1, 1, 2, 10])
            if w != value:
                wrong.add(w)
        choices = [str(v) for v in sorted({value, *wrong})]
        choice_rows.append({"question": f"What is {a} {op} {b}?", "choices": [" " + c for c in choices],
                            "answer": choices.index(str(value))})
        answer_rows.append({"question": f"What is {a} {op} {b}?", "target": str(value)})
    for name, rows, task in (("choice", choice_rows, CHOICE_TASK), ("answer", answer_rows, ANSWER_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"vs_arith_{name}.yaml").write_text(task.format(data=data))


def evaluate(url: str, model: str, tasks: Path, docs: int) -> dict:
    """Both tasks against one server: {task: (score, per-document responses, seconds)}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks))
    runs = {"vs_arith_choice": ("local-completions", f"{url}/v1/completions", "acc,none", False),
            "vs_arith_answer": ("local-chat-completions", f"{url}/v1/chat/completions", "exact_match,strip", True)}
    out = {}
    for task, (kind, base_url, metric, chat) in runs.items():
        start = time.perf_counter()
        results = lm_eval.simple_evaluate(
            model=kind, model_args={"model": model, "base_url": base_url, "num_concurrent": 1, "max_retries": 1,
                                    "timeout": 600, **({} if chat else {"tokenizer_backend": "remote"})},
            tasks=[task], task_manager=manager, log_samples=True, apply_chat_template=chat, limit=docs,
            random_seed=0)
        samples = [(s["doc_id"], s["resps"]) for s in results["samples"][task]]
        out[task] = (results["results"][task][metric], sorted(samples, key=lambda s: s[0]),
                     time.perf_counter() - start)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--target", default=None, help="verispec serve --target (default: its default target)")
    ap.add_argument("--out", default=None, help="a folder for the JSON report and the servers' logs")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the documents are local: never ask a hub
    out = Path(args.out or tempfile.mkdtemp(prefix="lm_eval_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"python {platform.python_version()}; lscpu:")
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags")[0].strip())
    with tempfile.TemporaryDirectory() as tmp:
        tasks = Path(tmp)
        write_tasks(tasks, args.docs)
        scores = {}
        for name, extra in (("verispec (defaults)", []), ("verispec --draft none", ["--draft", "none"])):
            port = free_port()
            command = [sys.executable, "-m", "verispec", "serve", "--port", str(port), "--threads", str(args.threads),
                       "--served-model-name", "target", *extra, *(["--target", args.target] if args.target else [])]
            with server(command, port, str(out / f"{name.split()[-1]}.log")) as url:
                scores[name] = evaluate(url, "target", tasks, args.docs)
    (first, a), (second, b) = scores.items()
    report = {}
    for task in a:
        same = a[task][1] == b[task][1]
        report[task] = {first: a[task][0], second: b[task][0], "every document equal": same,
                        f"{first} seconds": round(a[task][2], 1), f"{second} seconds": round(b[task][2], 1)}
        print(f"{task}: {first} {a[task][0]:.4f} ({a[task][2]:.0f} s), {second} {b[task][0]:.4f} "
              f"({b[task][2]:.0f} s); every document's responses equal: {same}")
    (out / "lm_eval.json").write_text(json.dumps(report, indent=2))
    print(f"report: {out / 'lm_eval.json'}")


if __name__ == "__main__":
    main()
