"""Start the service on the model repository and stream one generation per model.

`python -m service.demo` (part of the README's main command). The prompt is the start of a
function with its docstring and first lines, so each model sees the indentation it continues:
after a bare "def fibonacci(n):" these models, trained on the standard library (mostly methods
nested in classes), give runs of indentation, and sinusoidal and none gave nothing but spaces.
Each model samples at a modest temperature among its 20 likeliest bytes with a fixed seed, since
greedy decoding of models this small settles into repeated lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from contract.cli import HelpFormatter
from contract.paths import REPOSITORY_ROOT
from service.api import generation_pb2 as pb
from service.process import ServerProcess

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for i in range(n):\n'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.demo", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository",
        help="model repository to serve (written by python -m export)",
    )  # fmt: skip
    parser.add_argument(
        "--prompt",
        default=PROMPT,
        help="text every model continues (default: the first four lines of a fibonacci function)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=120, help="tokens per model (fewer where a model's positions end)"
    )
    parser.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=20, help="sample among the k likeliest bytes (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this mass")
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (the same seed gives the same text)")
    args = parser.parse_args(argv)
    server = ServerProcess(args.model_repository, threads=0)
    try:
        server.wait_serving()
        print(f"service on {server.target}, metrics on http://127.0.0.1:{server.metrics_port}/metrics\n")
        for model in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models:
            limit = model.max_positions or "unbounded"
            per_sequence = model.kv_cache_bytes_per_sequence  # a split hybrid's local layers, fixed per row
            kv = f"{model.kv_cache_bytes_per_token} B/token" + (f" + {per_sequence} B/sequence" if per_sequence else "")
            print(f"=== {model.name} (scheme {model.scheme}, positions {limit}, KV {kv})")
            new_tokens = args.max_new_tokens
            if model.max_positions:  # a bounded model (learned): BOS, prompt and output must fit
                new_tokens = min(new_tokens, model.max_positions - 1 - len(args.prompt.encode()))
            if new_tokens < 1:
                print(f"(the prompt leaves none of its {model.max_positions} positions to generate)\n")
                continue
            request = pb.GenerateRequest(
                model=model.name, prompt=args.prompt, max_new_tokens=new_tokens,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            )  # fmt: skip
            sys.stdout.write(args.prompt)
            for chunk in server.stub.GenerateStream(request, timeout=120):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    reason = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
                    timings = chunk.timings
                    print(
                        f"\n--- {reason}, {chunk.usage.completion_tokens} tokens, first token "
                        f"{timings.time_to_first_token_seconds * 1000:.1f} ms, "
                        f"total {timings.total_seconds * 1000:.0f} ms\n"
                    )
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
