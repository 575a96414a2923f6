"""The report's figures by file name, with the title each is drawn under."""

from __future__ import annotations

PLOTS = {
    "bpb_vs_context.png": "Bits per byte versus context length",
    "itl_vs_context.png": "Inter-token latency versus context",
    "ttft_vs_prompt.png": "Time to first token versus prompt length",
    "throughput_vs_concurrency.png": "Throughput versus concurrency",
    "goodput_vs_users.png": "Goodput versus users, without and with admission control",
    "kv_bytes.png": "KV bytes per sequence by cache policy and context length",
    "retrieval.png": "Retrieval probes with 95% intervals",
    "retrieval_depth.png": "Copy accuracy by context length and depth of the first copy",
    "cache_budget.png": "Quality against KV bytes per sequence, per cache policy",
    "copy_emergence.png": "Copy accuracy and validation bits per byte against training tokens",
    "reuse.png": "KV reuse: a shared prefix with and without the prefix cache, documents reused per scheme",
    "reuse_repair.png": "KV reuse: the repair curve and EPIC's sink-kept precompute, paired 95% intervals",
}
