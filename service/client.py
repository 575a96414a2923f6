"""Stream a generation to the terminal: `python -m service.client --model alibi "def fib(n):"`.

The prompt is echoed once the service has answered, followed by the generated text as it
arrives; a summary line (finish reason, tokens, latency) goes to stderr. The service's address
is --target, else the POSENC_TARGET environment variable, else localhost:50051.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from contract.cli import HelpFormatter
from service.api import generation_pb2 as pb
from service.api import generation_pb2_grpc
from service.channel import TARGET_ENV, default_target, open_channel
from service.routing import ROUTING_HEADER, routing_key


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m service.client", description=__doc__,
        formatter_class=HelpFormatter,
    )  # fmt: skip
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument(
        "--model", required=True, default=argparse.SUPPRESS, help="model to run (ListModels, or the demo, names them)"
    )
    parser.add_argument("--target", default=default_target(), help=f"HOST:PORT of the service (env {TARGET_ENV})")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest bytes (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    parser.add_argument("--stop", action="append", default=[], help="stop string; repeat for several")
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of the whole call, seconds")
    parser.add_argument("--token", default=None, help="bearer token, if the server requires one")
    parser.add_argument(
        "--routing-key", default=None,
        help=f"the {ROUTING_HEADER} header a prefix-affinity proxy hashes (default: a hash of the prompt's "
        "first 256 bytes; a conversation id keeps a conversation on one replica)",
    )  # fmt: skip
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA certificate (PEM): connect with TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="client key (PEM), for mutual TLS")
    return parser.parse_args(argv)


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials when --tls-ca is given, else None (plaintext)."""
    if not args.tls_ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=args.tls_ca.read_bytes(),
        private_key=args.tls_key.read_bytes() if args.tls_key else None,
        certificate_chain=args.tls_cert.read_bytes() if args.tls_cert else None,
    )


def explain(error: grpc.RpcError, target: str) -> str:
    """The error as a user can act on it: an unreachable service names where the address comes from."""
    message = f"error: {error.code().name}: {error.details()}"
    if error.code() == grpc.StatusCode.UNAVAILABLE:
        message += (
            f"\nhint: no service answered at {target}. Start one (`python -m service`) or point the client "
            f"at it with --target HOST:PORT or the {TARGET_ENV} environment variable."
        )
    return message


def stream_to(out: Iterator[pb.GenerateStreamResponse], prompt: str) -> None:
    """Echo the prompt once the first chunk has arrived (a call that fails at once prints no half
    line), then the text as it arrives; a failure mid-stream ends the line before it is raised."""
    first = next(out, None)
    sys.stdout.write(prompt)
    try:
        for chunk in itertools.chain([first] if first is not None else [], out):
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
    except grpc.RpcError:
        print(flush=True)
        raise


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    request = pb.GenerateRequest(
        model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
    )  # fmt: skip
    # The routing key: behind a prefix-affinity proxy (deploy/haproxy) prompts that start alike share a replica.
    metadata = [(ROUTING_HEADER, args.routing_key or routing_key(args.prompt))]
    if args.token:
        metadata.append(("authorization", f"Bearer {args.token}"))
    with open_channel(args.target, credentials(args)) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            stream_to(stub.GenerateStream(request, timeout=args.timeout, metadata=metadata), args.prompt)
        except grpc.RpcError as error:
            print(explain(error, args.target), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
