"""The gRPC side of deploy/smoke.sh: calls a running service and prints one line per check.

Runs inside the image under test (its grpcio and stubs; `docker run -v deploy/smoke_rpc.py:...`),
so the smoke test needs no Python environment on the host.

    python smoke_rpc.py generate HOST:PORT [--calls N]   Generate and GenerateStream answer (N of each)
    python smoke_rpc.py streams HOST:PORT [--streams S] [--max-new-tokens N]
        S long streams at once; prints "streaming" once every one has text (smoke.sh stops the
        container then) and how they ended: a drain must finish every one
"""

from __future__ import annotations

import argparse
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc

MODEL = "alibi"
PROMPT = "class Stack:\n    def push(self, item):\n"


def generate(stub: generation_pb2_grpc.GenerationStub, calls: int) -> int:
    for i in range(calls):
        request = pb.GenerateRequest(model=MODEL, prompt=PROMPT, max_new_tokens=24, temperature=0.6, top_k=20, seed=i)
        unary = stub.Generate(request, timeout=60)
        chunks = list(stub.GenerateStream(request, timeout=60))
        streamed = "".join(chunk.text for chunk in chunks)
        reason = pb.FinishReason.Name(chunks[-1].finish_reason)
        if unary.usage.completion_tokens == 0 or streamed != unary.text:
            print(f"FAIL: Generate gave {unary.text!r}, GenerateStream {streamed!r}")
            return 1
        if i == 0:
            print(f"Generate: {unary.usage.completion_tokens} tokens, {pb.FinishReason.Name(unary.finish_reason)}, "
                  f"{unary.text!r}; GenerateStream: the same text in {len(chunks)} chunks, {reason}")  # fmt: skip
    return 0


def streams(stub: generation_pb2_grpc.GenerationStub, count: int, max_new_tokens: int) -> int:
    started = threading.Barrier(count, action=lambda: print("streaming", flush=True))

    def one(seed: int) -> pb.GenerateStreamResponse:
        request = pb.GenerateRequest(
            model=MODEL, prompt=PROMPT, max_new_tokens=max_new_tokens, temperature=0.6, top_k=20, seed=seed
        )
        last = None
        for chunk in stub.GenerateStream(request, timeout=120):
            if last is None:
                started.wait(timeout=60)
            last = chunk
        assert last is not None
        return last

    with ThreadPoolExecutor(count) as pool:
        ends = list(pool.map(one, range(count)))
    tokens = [end.usage.completion_tokens for end in ends]
    reasons = sorted({pb.FinishReason.Name(end.finish_reason) for end in ends})
    print(f"{count} streams finished: {', '.join(reasons)}, {'+'.join(map(str, tokens))} tokens")
    return 0 if tokens == [max_new_tokens] * count else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["generate", "streams"])
    parser.add_argument("target", help="HOST:PORT")
    parser.add_argument("--calls", type=int, default=1)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            if args.check == "generate":
                return generate(stub, args.calls)
            return streams(stub, args.streams, args.max_new_tokens)
        except grpc.RpcError as error:
            print(f"FAIL: {error.code().name}: {error.details()}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
