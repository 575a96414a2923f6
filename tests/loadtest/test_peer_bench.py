"""The peer benchmark's pieces that need no peer tool: its GuideLLM command line, tables and ratios."""

from __future__ import annotations

from loadtest.peer_bench import Level, guidellm_command, parse_args, ratios, table


def test_guidellm_runs_the_fixed_workload_with_the_shipped_tokenizer() -> None:
    args = parse_args(["--guidellm", "/venv/bin/guidellm", "--concurrency", "1", "4", "--requests", "8"])
    command = " ".join(guidellm_command(args, "http://127.0.0.1:8000", "/tmp/out.json"))  # type: ignore[arg-type]
    assert "target=http://127.0.0.1:8000,model=alibi,request_format=/v1/completions" in command
    assert "--override profile.streams 1,4" in command and "kind=max_requests,count=8" in command
    assert "kind=synthetic_text,prompt_tokens=256,output_tokens=64" in command
    assert "models/weights/alibi" in command and "kind=json,path=/tmp/out.json" in command


def test_ratios_agree_only_within_the_tolerance() -> None:
    ours = [Level(1, 8, 100.0, 2.0, 500.0)]
    text, agree = ratios([Level(1, 8, 109.0, 1.9, 460.0)], ours, 0.10)
    assert agree and "1.090" in text
    assert not ratios([Level(1, 8, 112.0, 2.0, 500.0)], ours, 0.10)[1]
    assert "TTFT p50 ms" in table("ours", ours) and "500.0" in table("ours", ours)
