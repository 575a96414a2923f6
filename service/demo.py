"""Start the service on the model repository and stream one generation per model.

`python -m service.demo` (part of the README's main command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.api import generation_pb2 as pb
from service.process import ServerProcess
from service.server import REPOSITORY_ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-repository", type=Path, default=REPOSITORY_ROOT / "model_repository")
    parser.add_argument("--prompt", default="def fibonacci(n):\n")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    # Greedy decoding of models this small settles into runs of indentation; a seeded sample reads better.
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    server = ServerProcess(args.model_repository, threads=0)
    try:
        server.wait_serving()
        print(f"service on {server.target}, metrics on http://127.0.0.1:{server.metrics_port}/metrics\n")
        for model in server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models:
            limit = model.max_positions or "unbounded"
            print(
                f"=== {model.name} (scheme {model.scheme}, positions {limit}, "
                f"{model.kv_cache_bytes_per_token} KV bytes/token)"
            )
            request = pb.GenerateRequest(
                model=model.name, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature, top_p=args.top_p, seed=args.seed,
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
