"""Stream a generation to the terminal: `python -m service.client --model alibi "def fib(n):"`."""

from __future__ import annotations

import argparse
import sys

import grpc

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt")
    parser.add_argument("--model", required=True)
    parser.add_argument("--target", default="localhost:50051", help="host:port of the service")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    request = pb.GenerateRequest(
        model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
    )  # fmt: skip
    with grpc.insecure_channel(args.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            sys.stdout.write(args.prompt)
            for chunk in stub.GenerateStream(request, timeout=args.timeout):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    reason = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
                    print(
                        f"\n[{reason}: {chunk.usage.completion_tokens} tokens, first token "
                        f"{chunk.timings.time_to_first_token_seconds * 1000:.1f} ms, total "
                        f"{chunk.timings.total_seconds * 1000:.1f} ms]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
