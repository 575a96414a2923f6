"""Serving engine, split like vLLM v1: request -> scheduler -> KV store -> runner -> sampler.

Here: the engine core process (`core`), its engine over every model (`engine`) and each model's
loop (`model_engine`), the messages across the process boundary (`messages`), a request's state
(`request`), sampling (`sampler`), and a model's limits and metrics. By role, in packages:

- `sched`: scheduling and admission.
- `spec`: speculative decoding.
- `prompts`: prompts, their prefill, and their reuse (prefix cache, segments).
- `processing`: input and output processing, and the streams text reaches its reader through.
- `worker`: the model runner and its ONNX Runtime sessions.
- `kv`: the KV store.
"""
