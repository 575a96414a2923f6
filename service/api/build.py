"""Generate the Python stubs from proto/posenc/v1/generation.proto: `python -m service.api.build`.

grpcio-tools writes `from posenc.v1 import generation_pb2`; we rewrite that to a relative
import so the stubs live inside this package.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

from contract.paths import REPOSITORY_ROOT

PROTO_ROOT = REPOSITORY_ROOT / "proto"
PROTO = "posenc/v1/generation.proto"
OUT = Path(__file__).resolve().parent
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def generate(out: Path = OUT) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO,
        ]
        include = Path(protoc.__file__).parent / "_proto"
        if protoc.main([*args, f"-I{include}"]) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO}")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "posenc" / "v1" / name).read_text()
            text = text.replace("from posenc.v1 import generation_pb2", "from . import generation_pb2")
            (out / name).write_text(text)
            written.append(out / name)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(path)
