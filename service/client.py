"""Stream a generation to the terminal: `python -m service.client --model alibi "def fib(n):"`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    parser.add_argument("--token", default=None, help="bearer token, if the server requires one")
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA certificate (PEM): connect with TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="client key (PEM), for mutual TLS")
    args = parser.parse_args(argv)
    request = pb.GenerateRequest(
        model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
    )  # fmt: skip
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    if args.tls_ca:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca.read_bytes(),
            private_key=args.tls_key.read_bytes() if args.tls_key else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
        )
        channel = grpc.secure_channel(args.target, credentials)
    else:
        channel = grpc.insecure_channel(args.target)
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            sys.stdout.write(args.prompt)
            for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
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
