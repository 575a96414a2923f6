"""How much a comparison run measures: the full run, `--quick`, and the tests' tiny one."""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.study.cache_budget import CacheBudgetPlan


@dataclass
class Budget:
    """How much to measure; --quick shrinks every count."""

    prompt_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048)
    itl_contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    concurrency: tuple[int, ...] = (1, 8, 16, 32)
    load_seconds: float = 15.0
    load_new_tokens: int = 32
    load_rounds: int = 3  # every level over every scheme, this many times (loadtest/study/rounds.py)
    # The load under one fixed KV budget with 4 KB prompts (timed.measure_budget_load): 32 users'
    # 4,000-token prefills take half a minute a scheme here however short the level.
    budget_load: bool = True
    context_multiples: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    scaling_multiples: tuple[float, ...] = (2.0, 4.0, 8.0)
    score_windows: int = 24
    # Retrieval probes; lengths are multiples of the model's training context.
    retrieval_trials: int = 48  # per cell: copy and passkey trials; natural windows are a quarter
    copy_distances: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    depth_contexts: tuple[float, ...] = (1.0, 4.0, 8.0)
    retrieval_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    passkey_contexts: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)
    natural_context: float = 8.0
    repeats: int = 3
    # Cache budgets (loadtest/study/cache_budget.py): tokens the cache may hold, text lengths, cells.
    cache_budgets: tuple[int, ...] = (64, 128, 256)
    cache_multiples: tuple[float, ...] = (2.0, 4.0, 8.0)
    cache_windows: int = 3
    cache_trials: int = 16
    cache_copy_distances: tuple[int, ...] = (32, 128, 512)
    cache_passkey_context: float = 2.0
    int8_multiples: tuple[float, ...] = (1.0, 4.0)
    # KV reuse (loadtest/study/reuse.py): shared-prefix users and seconds per level, document prompts per
    # form (short: the training context; long: 256-byte documents), the repairs' k (the curve; the whole
    # document is always scored), the prompt samples' seeds (the first served and scored, the rest scored:
    # issue 48, verdicts that survive another sample).
    reuse_users: tuple[int, ...] = (1, 8, 32)
    reuse_seconds: float = 8.0
    reuse_trials: int = 192  # issue 48: the paired intervals decide at 192 prompts where 48 left them open
    reuse_forms: tuple[str, ...] = ("short", "long")
    reuse_repairs: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    reuse_seeds: tuple[int, ...] = (32, 7)
    # Speculative decoding (loadtest/speculative.py): prompts per workload and stream count, and new
    # tokens per request (at most what the model's positions leave).
    speculative_prompts: int = 16
    speculative_new_tokens: int = 192
    # lm-evaluation-harness's multiple-choice questions (its rolling task scores the quality windows).
    evaluation_choices: int = 100
    # Routing (loadtest/study/routing.py): prefixes (their K/V about twice one replica's prefix cache),
    # requests per prefix (different tails), each prefix's bytes, concurrent users.
    routing_prefixes: int = 32
    routing_uses: int = 16
    routing_prefix_bytes: int = 512
    routing_users: int = 8
    # Tenants (loadtest/study/tenants.py): the noisy tenant's closed-loop streams, the quiet tenant's
    # streams and the mean pause between each one's requests (exponential; 0: closed loop too), seconds a
    # measurement, each request's held-out prompt bytes and new tokens (rounds: load_rounds).
    tenants_noisy_users: int = 48
    tenants_quiet_users: int = 4
    tenants_quiet_think_s: float = 1.0
    tenants_max_batch_size: int = 64  # a row for every stream: the study measures prompts' scheduling
    tenants_seconds: float = 20.0
    tenants_prompt_bytes: int = 128
    tenants_new_tokens: int = 32
    # The scored sections (quality, retrieval, cache, reuse's answers) and speculation on every further
    # training seed of a scheme (models/weights/seed<N>/<scheme>; issue 55), not only the served model.
    extra_seeds: bool = True
    # Only those further seeds: the served models' figures already in the results stay as they are.
    seeds_only: bool = False

    def cache_plan(self) -> CacheBudgetPlan:
        return CacheBudgetPlan(
            self.cache_budgets, self.cache_multiples, self.cache_windows, self.cache_trials,
            self.cache_copy_distances, self.cache_passkey_context, self.int8_multiples,
        )  # fmt: skip

    @classmethod
    def quick(cls) -> Budget:
        """A first look within the README's first-run budget on 2 CPU cores, for nine schemes (issue
        64 and 61: README command 1 within ten minutes). The comparison leaves out five sections with
        it (compare.QUICK_LEAVES_OUT: the cache budgets, which scored policies and timed their decode at
        2,048 tokens for most of a minute a scheme, routing, tenants, reuse and speculation), and the
        load under one KV budget (32 users' 4 KB prefills). Scoring long texts is what costs, and
        retrieval scores the most of them: it keeps copy and passkey out to 8x the training context (the
        headline's columns) on fewer trials, and its depth grid stops at 4x; the load levels are shorter
        and only 1 and 32 users, one round (the full run has three), 1 s a level; quality scores fewer
        texts per length; the served models only, not further training seeds. The cache, reuse and
        speculation fields below size a quick run that names those sections (`--sections ... reuse`)."""
        return cls(
            prompt_lengths=(64, 256, 1024, 2048), itl_contexts=(128, 512, 2048), concurrency=(1, 32),
            load_seconds=1.0, load_new_tokens=16, load_rounds=1, score_windows=2, retrieval_trials=4,
            copy_distances=(0.125, 0.5, 2.0, 8.0), depth_contexts=(1.0, 4.0), passkey_contexts=(1.0, 8.0), repeats=3,
            cache_budgets=(256,), cache_multiples=(8.0,), cache_windows=1, cache_trials=2,
            cache_copy_distances=(512,), reuse_users=(1, 32), reuse_seconds=0.5, reuse_trials=4,
            reuse_forms=("short",), reuse_repairs=(4,), reuse_seeds=(32,), speculative_prompts=4,
            speculative_new_tokens=64,
            evaluation_choices=20, extra_seeds=False, budget_load=False,
        )  # fmt: skip

    @classmethod
    def tiny(cls) -> Budget:
        """For tests: every measurement once, as small as it gets (further seeds only when asked)."""
        return cls(
            prompt_lengths=(64, 512), itl_contexts=(128, 512), concurrency=(1, 2), load_seconds=0.5,
            load_new_tokens=4, context_multiples=(0.5, 2.0), scaling_multiples=(2.0,), score_windows=1,
            retrieval_trials=2, copy_distances=(0.125, 2.0), depth_contexts=(1.0,), retrieval_depths=(0.5,),
            passkey_contexts=(1.0, 2.0), natural_context=2.0, repeats=2, load_rounds=2, cache_budgets=(64,),
            cache_multiples=(2.0,), cache_windows=1, cache_trials=2, cache_copy_distances=(32,),
            cache_passkey_context=1.0, int8_multiples=(1.0,), reuse_users=(1, 2), reuse_seconds=0.5, reuse_trials=2,
            reuse_repairs=(4,), speculative_prompts=2, speculative_new_tokens=16,
            evaluation_choices=4, routing_prefixes=4, routing_uses=3, routing_prefix_bytes=272, routing_users=2,
            tenants_noisy_users=4, tenants_quiet_users=1, tenants_quiet_think_s=0.1, tenants_seconds=1.0,
            tenants_new_tokens=8,
            extra_seeds=False,
        )  # fmt: skip
