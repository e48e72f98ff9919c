"""How well the untrained model does as the SQL agent, and whether GRPO has signal to learn from.

    python examples/sql/measure_baseline.py                          # starts vLLM (smollm2-135m)
    python examples/sql/measure_baseline.py --base-url http://127.0.0.1:8000/v1 --model policy

Greedy (temperature 0) on validation tasks (the held-out databases), then ``--samples`` rollouts per train task at
``--temperature`` (GRPO's groups): execution accuracy of the final query and of the writer's first draft, the share
of groups with mixed rewards (only those give a gradient), how often the checker accepts and how many rewrites run,
LLM calls and tokens per rollout, and seconds per rollout. Runs the agent plainly, without ``lit.instrument``.

Measured on the 2-core CPU machine (vLLM CPU fp32, 16 rollouts at a time, max_tokens 48; 64 validation tasks greedy
on the held-out databases; 16 train tasks x 8 samples). final = the graph's last query, draft = the writer's first:

    writer examples            checker asks        greedy final|draft   sampled (T) final|draft   mixed groups
    four fixed                 "does it answer?"     7.8% |  9.4%        (0.7)  0.0% |  0.0%         0%
    two closest                "does it answer?"    10.9% | 14.1%        (0.7)  3.1% |  5.5%         6%
    one closest                "does it answer?"     4.7% | 10.9%        (0.5)  8.6% | 17.2%        31%
    one closest (chosen)       "is it wrong?"       10.9% | 10.9%        (0.6) 17.2% | 17.2%        44%

Asked whether a query answers the question, the untrained checker said "no" to 98-100% of them, so the rewriter
replaced right drafts with worse ones (final below draft). Asked whether it is wrong, it says "no" to 96-100%: the
rewriter then runs for queries that fail or return nothing (0.4-0.6 rewrites per rollout), and fixes none yet.
Without example selection the model writes a generic ``WHERE city = 'New York'`` for almost every question. The
chosen design: 2.0 LLM calls per rollout, 107-115 prompt and 17-21 response tokens per call, 0.45 s per rollout.
Greedy by question form: maximum 25%, total_where 25%, above 22%, count_where 12%, the rest 0%.

Those figures are of the one-table databases. With the lookup table behind a foreign key and the three join forms
(2026-11-27, same machine and settings, 64 validation tasks of which 17 joins; 24 train tasks x 8 at T=0.6 for the
chosen design, 16 x 8 for the others; the schema read from the database):

    schema shown                                  examples shown              greedy (joins)   sampled  mixed  prompt
    a line per table, a line per key (chosen)     closest one-table + join    6.2% (1/17)      3.1%     21%    212
    one line, "Tables: a(x, y); b(z)", keys       closest one-table + join    1.6% (0/17)      2.3%     12%    217
    "Table: a(x, y)" per line, keys               closest one-table + join    4.7% (1/17)      0.0%      0%    224
    a line per table, a line per key              the one closest of both     6.2% (0/17)      2.3%     19%    165

Two tables make the untrained model worse at everything (6.2% against 10.9% greedy): it invents columns of the
other table (``WHERE country = 'USA'`` on students), joins on the wrong columns, and writes on after the query
(``A: 1``), so 0.9 rewrites per rollout run, all accepted by the checker, none fixing the query.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lit_sdk as lit
from examples import baseline
from examples.sql.agent import SHOT_POOL, Attempt, Shots, solve
from examples.sql.tasks import JOIN_FORMS, make_tasks

JOIN_KINDS = {f.__name__ for f in JOIN_FORMS}

FIXED = [SHOT_POOL[i] for i in (1, 3, 6, 5)]
VARIANTS: dict[str, Shots] = {
    "closest_one": 1,  # the agent's own design: the example closest to the question
    "closest_two": 2,
    "fixed_two": FIXED[:2],
    "fixed_four": FIXED,
    "all_one_table": SHOT_POOL,
}
"""Worked examples for the writer compared; ``closest_one`` is what ``sql_agent`` runs."""


def describe(attempts: list[Attempt]) -> dict[str, float]:
    calls = sum(a.llm_calls for a in attempts) or 1
    checks = sum(a.checker_calls for a in attempts) or 1
    return {
        "accuracy": statistics.fmean(a.reward for a in attempts),
        "draft_accuracy": statistics.fmean(a.draft_correct for a in attempts),
        "checker_accepts": sum(a.checker_accepts for a in attempts) / checks,
        "rewrites_per_rollout": statistics.fmean(a.rewrites for a in attempts),
        "calls_per_rollout": calls / len(attempts),
        "prompt_tokens_per_call": sum(a.prompt_tokens for a in attempts) / calls,
        "response_tokens_per_call": sum(a.completion_tokens for a in attempts) / calls,
    }


async def measure(base_url: str, model: str, args: argparse.Namespace) -> None:
    greedy = lit.LLM(base_url=base_url, model=model, temperature=0.0, max_tokens=args.max_tokens)
    sampled = lit.LLM(base_url=base_url, model=model, temperature=args.temperature, max_tokens=args.max_tokens)
    validation = make_tasks("validation", args.validation)
    pool = make_tasks("train", 2000)
    train = pool[:: max(1, len(pool) // args.train_tasks)][: args.train_tasks]

    t0 = time.perf_counter()
    shots = VARIANTS[args.variant]
    val = await baseline.run_all(validation, lambda t: solve(t, greedy, shots), args.concurrency)
    val_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups_of = [t for t in train for _ in range(args.samples)]
    sam = await baseline.run_all(groups_of, lambda t: solve(t, sampled, shots), args.concurrency)
    sam_s = time.perf_counter() - t0
    groups = [[a.reward for a in sam[i:i + args.samples]] for i in range(0, len(sam), args.samples)]

    print(f"\n== {args.variant}: greedy, {len(val)} validation tasks ({val_s:.0f} s) ==")
    for key, value in describe(val).items():
        print(f"  {key:26s} {value:8.3f}")
    by_kind: dict[str, list[float]] = defaultdict(list)
    for task, a in zip(validation, val, strict=True):
        by_kind[task["kind"]].append(a.reward)
    print("  by form: " + ", ".join(f"{k} {statistics.fmean(v):.2f}" for k, v in by_kind.items()))
    joins = [r for k, v in by_kind.items() if k in JOIN_KINDS for r in v]
    others = [r for k, v in by_kind.items() if k not in JOIN_KINDS for r in v]
    print(f"  join questions {statistics.fmean(joins):.3f} ({len(joins)}), "
          f"one-table questions {statistics.fmean(others):.3f} ({len(others)})")
    print(f"\n== temperature {args.temperature}, {len(train)} train tasks x {args.samples} ({sam_s:.0f} s) ==")
    for key, value in describe(sam).items():
        print(f"  {key:26s} {value:8.3f}")
    print(f"  {'mixed_groups':26s} {statistics.fmean(0 < sum(g) < len(g) for g in groups):8.3f}")
    print(f"  {'s_per_rollout':26s} {sam_s / len(sam):8.3f}")
    for a in sam[: args.show]:
        print(f"  --- reward={a.reward} rewrites={a.rewrites} replies={a.replies}")


def main() -> None:
    parser = baseline.arguments(__doc__.split("\n")[0])
    parser.add_argument("--variant", default="closest_one", choices=sorted(VARIANTS))
    baseline.main(measure, parser.parse_args())


if __name__ == "__main__":
    main()
