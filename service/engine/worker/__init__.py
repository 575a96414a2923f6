"""The worker (vLLM v1's worker): the model runner, its ONNX Runtime sessions and graph bindings,
the decode calls resolved per batch, and the floating-point state of the threads that run graphs."""
