"""Probe the standard gRPC health service: `python -m service.healthcheck [--target HOST:PORT]`.

Exit 0 when SERVING, 1 otherwise: for container healthchecks and orchestrator probes.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.cli import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m service.healthcheck", description=__doc__, formatter_class=HelpFormatter
    )
    default = f"127.0.0.1:{os.environ.get('POSENC_PORT', '50051')}"
    parser.add_argument("--target", default=default, help="HOST:PORT to probe (the port defaults to env POSENC_PORT)")
    parser.add_argument(
        "--service", default="", help="service to ask about: '' is the whole server, posenc.v1.Generation the API "
        "(default: %(default)r)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as error:
            print(f"unhealthy: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
