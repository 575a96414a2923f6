"""Generated gRPC stubs of posenc.v1 (`python -m service.api.build` regenerates them)."""
