"""The served models measured by an outside tool: lm-evaluation-harness against the running service,
beside the project's own Score-based figures on the same text.

`python -m loadtest.evaluation` (or the comparison's `evaluation` section):

1. lm-evaluation-harness runs from a virtual environment of its own (`.venv-lmeval`, pinned
   `lm-eval[api]==LM_EVAL_VERSION`, made on first use; `--lm-eval-python` names another), since its
   dependencies (datasets, pyarrow, scikit-learn) are no business of the service's.
2. Its two tasks are built from local files, no download (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE):
   - `posenc_stdlib_rolling`: a rolling log-likelihood task over held-out windows of the stdlib test
     split: the same windows the report's quality figure at the training context scores
     (`HeldOut().windows(train_context, score_windows)`), so its bits per byte is that figure measured
     by another program;
   - `posenc_code_mc`: multiple choice, the true continuation of a held-out code line against three
     continuations taken from other lines (seeded).
3. It talks to the service as to any OpenAI-compatible server: `local-completions`, with the
   server's own tokenizer (`tokenizer_backend=remote`: /tokenizer_info, /tokenize) and token-id
   prompts, echo and logprobs. `custom_prefix_token_id=256`: the BOS id (/tokenize never parses
   "<|bos|>" out of text, so lm-eval cannot look it up by name).
4. Beside each scheme's lm-eval figures: the Score RPC's bits per byte over the same windows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from loadtest.study.held_out import HeldOut
from service.api import generation_pb2 as pb
from service.process import ServerProcess

LM_EVAL_VERSION = "0.4.13"
VENV = REPOSITORY_ROOT / ".venv-lmeval"
ROLLING, CHOICE = "posenc_stdlib_rolling", "posenc_code_mc"
BOS_TOKEN_ID = 256  # the byte tokenizer's BOS (ListModels' bos_token_id)
TRAIN_CONTEXT = 256
MC_CONTEXT_BYTES = 160  # code before the line's cut (within learned's 256 positions with a choice)


def lm_eval_python(given: Path | None = None) -> Path:
    """The interpreter lm-evaluation-harness runs in: `given`, or `.venv-lmeval` (made if missing:
    built aside and moved into place once lm-eval is installed, so a half-made one is never used)."""
    if given is not None:
        return given
    marker = VENV / f"lm-eval-{LM_EVAL_VERSION}"
    if not marker.exists():
        building = VENV.with_name(VENV.name + ".building")
        shutil.rmtree(building, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
        pip = [str(building / "bin" / "python"), "-m", "pip", "install", "-q", f"lm-eval[api]=={LM_EVAL_VERSION}"]
        subprocess.run(pip, check=True, stdout=subprocess.DEVNULL)
        shutil.rmtree(VENV, ignore_errors=True)
        building.rename(VENV)
        subprocess.run([sys.executable, "-m", "venv", "--upgrade", str(VENV)], check=True)  # its paths, moved
        marker.touch()
    return VENV / "bin" / "python"


def rolling_documents(count: int) -> list[str]:
    """The report's quality windows at the training context (loadtest/study/scored.py)."""
    return HeldOut().windows(TRAIN_CONTEXT, count)


def choice_documents(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Held-out code lines cut after their first third: the context is the code before the cut, the
    choices the line's true rest and three rests of other lines, in a seeded order."""
    data = HeldOut().data.decode("utf-8", errors="ignore")
    lines = [(start, line) for start, line in _lines(data) if 24 <= len(line) <= 80 and line.strip()]
    rng = random.Random(seed)
    picked = rng.sample(lines, count)
    documents = []
    for start, line in picked:
        cut = len(line) // 3
        context = data[max(0, start - MC_CONTEXT_BYTES) : start] + line[:cut]
        truth = line[cut:]
        others = [other[len(other) // 3 :] for _, other in rng.sample(lines, 12) if other[len(other) // 3 :] != truth]
        choices = [truth, *others[:3]]
        rng.shuffle(choices)
        documents.append({"context": context, "choices": choices, "label": choices.index(truth)})
    return documents


def _lines(text: str) -> list[tuple[int, str]]:
    out, start = [], 0
    for line in text.split("\n"):
        out.append((start, line + "\n"))
        start += len(line) + 1
    return out


def write_tasks(folder: Path, rolling: list[str], choices: list[dict[str, Any]]) -> None:
    """Both tasks' YAML (lm-eval's task config, as YAML's JSON subset) and their JSONL data into
    `folder` (lm-eval's --include_path)."""
    tasks = {
        ROLLING: ([{"text": t} for t in rolling], {
            "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        }),
        CHOICE: (choices, {
            "output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}", "target_delimiter": "", "metric_list": [{"metric": "acc"}],
        }),
    }  # fmt: skip
    for name, (documents, config) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in documents))
        dataset = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test"}
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, **dataset, **config}, indent=2))


def run_lm_eval(python: Path, folder: Path, server: ServerProcess, model: str, max_length: int) -> dict[str, Any]:
    """One scheme's lm-eval run against the server; its results JSON (the `results` of each task)."""
    out = folder / f"out-{model}"
    arguments = ",".join([
        f"model={model}", f"base_url={server.http_url}/v1/completions", "tokenizer_backend=remote",
        "tokenized_requests=True", f"max_length={max_length}", f"custom_prefix_token_id={BOS_TOKEN_ID}",
        "num_concurrent=1", "max_retries=1",
    ])  # fmt: skip
    command = [
        str(python), "-m", "lm_eval", "--model", "local-completions", "--model_args", arguments,
        "--tasks", f"{ROLLING},{CHOICE}", "--include_path", str(folder), "--output_path", str(out),
        "--batch_size", "1",
    ]  # fmt: skip
    environment = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"lm-eval failed for {model} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    (found,) = sorted(out.rglob("results_*.json"))[-1:]
    return json.loads(found.read_text())["results"]


def score_bits_per_byte(server: ServerProcess, model: str, texts: list[str]) -> float:
    """The Score RPC's bits per byte over the texts (the report's quality figure's way)."""
    total, count = 0.0, 0
    for text in texts:
        response = server.stub.Score(pb.ScoreRequest(model=model, text=text), timeout=600)
        total += response.total_logprob
        count += response.tokens
    return -total / count / math.log(2)


def evaluate(
    repository: Path, schemes: list[str], windows: int, choices: int, python: Path | None = None, threads: int = 0
) -> dict[str, dict[str, float]]:
    """Per scheme: lm-eval's bits per byte, byte perplexity and multiple-choice accuracy, and the
    Score RPC's bits per byte over the same windows."""
    interpreter = lm_eval_python(python)
    rolling, documents = rolling_documents(windows), choice_documents(choices)
    figures: dict[str, dict[str, float]] = {}
    server = ServerProcess(repository, "--models", *schemes, threads=threads)
    try:
        server.wait_serving()
        limits = {m.name: m.max_positions for m in server.stub.ListModels(pb.ListModelsRequest(), timeout=30).models}
        with tempfile.TemporaryDirectory(prefix="posenc-lmeval-") as tmp:
            folder = Path(tmp)
            write_tasks(folder, rolling, documents)
            for scheme in schemes:
                # A request's prompt and the one token lm-eval asks for must fit the positions.
                max_length = limits[scheme] - 1 if limits[scheme] else 4096
                results = run_lm_eval(interpreter, folder, server, scheme, max_length)
                figures[scheme] = {
                    "lm_eval_bits_per_byte": results[ROLLING]["bits_per_byte,none"],
                    "lm_eval_byte_perplexity": results[ROLLING]["byte_perplexity,none"],
                    "lm_eval_choice_accuracy": results[CHOICE]["acc,none"],
                    "score_bits_per_byte": score_bits_per_byte(server, scheme, rolling),
                    "windows": windows,
                    "choices": choices,
                }
    finally:
        server.stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.evaluation", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository")
    parser.add_argument("--schemes", nargs="+", default=["alibi", "learned", "none", "relative", "rope", "sinusoidal"])
    parser.add_argument("--windows", type=int, default=24, help="rolling windows (the report's quality windows)")
    parser.add_argument("--choices", type=int, default=100, help="multiple-choice questions")
    parser.add_argument("--lm-eval-python", type=Path, default=None, help="an interpreter with lm-eval installed")
    args = parser.parse_args(argv)
    figures = evaluate(args.model_repository, args.schemes, args.windows, args.choices, args.lm_eval_python)
    print(f"{'scheme':<11} {'lm-eval bpb':>12} {'Score bpb':>10} {'difference':>11} {'choice acc':>11}")
    for scheme, row in figures.items():
        difference = row["lm_eval_bits_per_byte"] / row["score_bits_per_byte"] - 1
        print(f"{scheme:<11} {row['lm_eval_bits_per_byte']:12.4f} {row['score_bits_per_byte']:10.4f} "
              f"{difference:+11.3%} {row['lm_eval_choice_accuracy']:11.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
