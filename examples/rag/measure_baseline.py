"""How well the untrained model does as the RAG agent, and whether GRPO has signal to learn from.

    python examples/rag/measure_baseline.py                          # starts vLLM (smollm2-135m)
    python examples/rag/measure_baseline.py --base-url http://127.0.0.1:8000/v1 --model policy
    python examples/rag/measure_baseline.py --max-searches 3        # let the agent search up to 3 times

Greedy on validation questions, then ``--samples`` rollouts per train question at ``--temperature``: mean reward
(0.9 x F1 + 0.1 x format), F1, format, exact answers, searches and useful searches per rollout, the share that
answered while it could still search, the share of groups whose rewards differ (only those give GRPO a gradient),
tokens per call and seconds per rollout. Runs the agent plainly, without ``lit.instrument`` (``lit.reward`` is then
ignored).

Measured on the 2-core CPU machine (vLLM CPU fp32, 16 rollouts at a time, max_tokens 48; 32 validation questions
greedy, 12 train questions x 8 at T=0.7), one design after another:

    design                                                 greedy reward (F1)   T=0.7 reward   mixed groups
    SDK tool loop, worked example with its tool results          0.00 (0.00)         0.00            0%
    same, worked example without tool results                    0.00 (0.00)         0.00            0%
    notes (question + passages found), up to 4 searches          0.00 (0.00)         0.03           83%
    notes, 2 searches, then the agent without its tool           0.01 (0.01)         0.01           50%
    notes, 2 searches, answer call shown the answer turn only    0.32 (0.25)         0.16          100%  (chosen)

In the SDK's own loop the model wrote ``<tool_response>`` itself instead of calling or answering. With notes it
searched the question's entity and then the bridge entity, but kept searching; without its tool it still wrote
``<tool_call>``, copying the worked search turns, until the answer call showed only the answer turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lit_sdk as lit
from examples import baseline
from examples.rag.agent import Attempt, solve
from examples.rag.corpus import make_tasks


def describe(attempts: list[Attempt]) -> dict[str, float]:
    calls = sum(a.llm_calls for a in attempts) or 1
    return {
        "reward": statistics.fmean(a.reward for a in attempts),
        "f1": statistics.fmean(a.f1 for a in attempts),
        "format": statistics.fmean(a.format for a in attempts),
        "exact": statistics.fmean(a.f1 == 1.0 for a in attempts),
        "searches_per_rollout": statistics.fmean(len(a.searches) for a in attempts),
        "useful_per_rollout": statistics.fmean(a.useful for a in attempts),
        "answered_early": statistics.fmean(a.answered_early for a in attempts),
        "calls_per_rollout": calls / len(attempts),
        "prompt_tokens_per_call": sum(a.prompt_tokens for a in attempts) / calls,
        "response_tokens_per_call": sum(a.completion_tokens for a in attempts) / calls,
    }


async def measure(base_url: str, model: str, args: argparse.Namespace) -> None:
    import agents

    agents.set_trace_processors([])  # nothing leaves this machine
    greedy = lit.LLM(base_url=base_url, model=model, temperature=0.0, max_tokens=args.max_tokens)
    sampled = lit.LLM(base_url=base_url, model=model, temperature=args.temperature, max_tokens=args.max_tokens)
    validation, train = make_tasks("validation", args.validation), make_tasks("train", args.train_tasks)
    if args.max_searches is not None:  # the agent's limit on searches, as a task's "max_searches" sets it
        validation, train = ([{**t, "max_searches": args.max_searches} for t in tasks] for tasks in (validation, train))
    t0 = time.perf_counter()
    val = await baseline.run_all(validation, lambda t: solve(t, greedy), args.concurrency)
    val_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sam = await baseline.run_all([t for t in train for _ in range(args.samples)], lambda t: solve(t, sampled),
                                 args.concurrency)
    sam_s = time.perf_counter() - t0
    groups = [[a.reward for a in sam[i:i + args.samples]] for i in range(0, len(sam), args.samples)]
    print(f"\n== greedy, {len(val)} validation questions ({val_s:.0f} s) ==")
    for key, value in describe(val).items():
        print(f"  {key:26s} {value:8.3f}")
    print(f"\n== temperature {args.temperature}, {len(train)} train questions x {args.samples} ({sam_s:.0f} s) ==")
    for key, value in describe(sam).items():
        print(f"  {key:26s} {value:8.3f}")
    print(f"  {'mixed_groups':26s} {statistics.fmean(max(g) > min(g) for g in groups):8.3f}")
    print(f"  {'s_per_rollout':26s} {sam_s / len(sam):8.3f}")
    for a in val[: args.show]:
        print(f"  --- reward={a.reward:.2f} searches={a.searches} final={a.final[:80]!r}")


def main() -> None:
    parser = baseline.arguments(__doc__.split("\n")[0])
    parser.add_argument("--max-searches", type=int, default=None,
                        help="the most searches before the answer call (default: agent.MAX_SEARCHES)")
    baseline.main(measure, parser.parse_args())


if __name__ == "__main__":
    main()
