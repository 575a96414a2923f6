"""Training-step speed, measured side by side in one process: `python -m models.train_bench`.

Each variant is one optimizer step of the model family (forward, backward, clip, AdamW) on a
batch of 256-byte windows; the variants run in turn, blocks of `--steps` steps, `--rounds` times,
and the best block counts (the machine is noisy; the ratio to `before` is what to read).

- before: the explicit attention graph (what export traces) and for-each AdamW;
- fused AdamW; fused attention (`F.scaled_dot_product_attention`); both (what `models.train` uses);
- both + torch.compile (with --compile; a minute of compiling first).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from contract.cli import HelpFormatter
from models.positional import SCHEMES, matched_config
from models.transformer import Transformer

Step = Callable[[], None]


def make_step(scheme: str, batch: int, context: int, fused_adamw: bool, fused_attention: bool, compiled: bool) -> Step:
    torch.manual_seed(0)
    model = Transformer(matched_config(scheme, train_context=context)).train()
    if fused_attention:
        model.attend_with_fused_kernel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused_adamw)
    forward = torch.compile(model) if compiled else model
    ids = torch.randint(0, 256, (batch, context + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits, _ = forward(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m models.train_bench", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--scheme", choices=SCHEMES, default="rope", help="model to time")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per step")
    parser.add_argument("--context", type=int, default=256, help="bytes per window")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=4, help="timed blocks per variant (the best counts)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile on top of both")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variants = {
        "before": (False, False, False),
        "fused AdamW": (True, False, False),
        "fused attention": (False, True, False),
        "both (models.train)": (True, True, False),
    }
    if args.compile:
        variants["both + torch.compile"] = (True, True, True)
    steps = {name: make_step(args.scheme, args.batch_size, args.context, *flags) for name, flags in variants.items()}
    for step in steps.values():
        for _ in range(3):  # warm-up (and compile)
            step()
    best = {name: float("inf") for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(args.steps):
                step()
            best[name] = min(best[name], (time.perf_counter() - started) / args.steps)
    tokens = args.batch_size * args.context
    print(f"{args.scheme}, {args.threads} thread(s), batch {args.batch_size} x {args.context}")
    print(f"{'variant':<24}{'ms/step':>10}{'tokens/s':>12}{'x before':>10}")
    for name, seconds in best.items():
        print(f"{name:<24}{seconds * 1000:>10.1f}{tokens / seconds:>12,.0f}{best['before'] / seconds:>10.2f}")


if __name__ == "__main__":
    main()
