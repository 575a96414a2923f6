"""The report's outside-tool section: lm-evaluation-harness's figures per scheme beside the
project's own Score-based ones (loadtest/evaluation.py says how they were measured)."""

from __future__ import annotations

from loadtest.study.results import Results


def evaluation_section(results: Results) -> str:
    """The section's markdown, or nothing where the run did not measure it."""
    if not results.evaluation:
        return ""
    rows = []
    for scheme, row in results.evaluation.items():
        reported = results.quality.get(scheme, {}).get("1")
        lm_eval, score = row["lm_eval_bits_per_byte"], row["score_bits_per_byte"]
        report = "-" if reported is None else f"{reported:.4f} ({lm_eval / reported - 1:+.2%})"
        rows.append(
            f"| {scheme} | {lm_eval:.4f} | {score:.4f} ({lm_eval / score - 1:+.3%}) | {report} "
            f"| {row['lm_eval_choice_accuracy']:.2f} |"
        )
    first = next(iter(results.evaluation.values()))
    table = "\n".join(rows)
    return f"""## Checked from outside: lm-evaluation-harness

lm-evaluation-harness (`local-completions` against the service's /v1/completions: token-id prompts,
echo and log-probabilities, the server's /tokenize) on two tasks built from local files:
- bits per byte over the report's own quality windows ({first["windows"]:.0f} held-out windows of the
  training context);
- multiple choice: the true rest of a held-out code line against three rests of other lines
  ({first["choices"]:.0f} questions; chance 0.25).

Beside them, the Score RPC over the same windows, and the quality section's figure at the training
context. Command: `python -m loadtest.evaluation` (or `--sections evaluation` of the comparison).

| scheme | lm-eval bits/byte | Score, same windows | quality section, 1x | choice accuracy |
|---|---|---|---|---|
{table}

"""
