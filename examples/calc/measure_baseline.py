"""How well the untrained model does as the calc agent, and whether GRPO has signal to learn from.

    python examples/calc/measure_baseline.py                       # starts vLLM (smollm2-135m), default design
    python examples/calc/measure_baseline.py --variant all         # every prompt/tool variant below
    python examples/calc/measure_baseline.py --base-url http://127.0.0.1:8000/v1 --model policy   # running server

For each variant: greedy accuracy on validation tasks (temperature 0; also by one-step/two-step and by kind:
``in_template`` wordings seen in training, ``out_of_template`` ones it never uses), then ``--samples`` rollouts
per train task at temperature 1.0 (GRPO's groups): mean accuracy, the share of groups with mixed rewards (neither
all 0 nor all 1: only those give a gradient), how often the model called the tool and how often the call failed,
mean prompt and response tokens per LLM call (the ``usage`` the server reports) and wall time per batch. Runs the
agent plainly, without ``lit.instrument`` (``@lit.trace`` is then a pass-through).

Measured on the 2-core CPU machine (vLLM CPU fp32, 16 rollouts at a time; 64 validation tasks greedy; 16 train
tasks x 8 samples; tasks half one-step, half two-step; max_tokens 64). greedy = accuracy at temperature 0; acc, mixed
(groups with mixed rewards) and tool (rollouts that called the tool) at temperature 0.7 | 1.0; tokens per LLM call:

    variant                 greedy  acc .7|1.0   mixed .7|1.0  tool .7|1.0  prompt  response
    direct (no tool)          6%     2% | 2%     12% | 12%      -            52     60
    no_shot (tool, no demo)   5%     2% | 2%      6% | 12%     0% | 0%      227     59
    one_shot                 12%     5% | 2%     25% | 12%    55% | 19%     289     42-49
    two_shots (chosen then)  14%     6% | 3%     25% | 19%    86% | 41%     361     37-47
    two_shots_full_schema    17%    12% | 3%     25% | 19%    84% | 38%     378     38-48
    two_shots_reflect        12%     2% | 0%     19% | 0%     87% | 46%     313*    32* (1.5-1.9 calls)
    three_shots (+ a "/")    14%     5% | 5%     12% | 25%    89% | 56%     425     36-44

Earlier designs, with the same 2-line system message: the worked example written into the system message, or shown
as a real tool call followed by its tool result: tool use 0-2%, accuracy 0-4% (the model copies the last tag it saw
and writes ``<tool_response>`` itself). ``two_shots`` on the final 3:1 one-step:two-step mix, max_tokens 48, 64
validation and 32 train tasks x 8: greedy 18.8% (one-step 25%, two-step 0%), all greedy calls use the tool;
temperature 0.7: accuracy 16.0%, mixed groups 53%, tool 79%, tool errors 16%; temperature 1.0: accuracy 3.5%, mixed
25%, tool 43%, errors 25%. 358 prompt + 36-40 response tokens per rollout; 256 rollouts in 46-52 s (0.18-0.20 s
each at 16 concurrent; another benchmark shared the machine), 64 greedy rollouts in 11 s.

Validation since split by (operation, numbers) signature, half of it in held-out wordings (tasks.py), same design
and max_tokens 48: greedy 12.5% (one-step 16.7%, two-step 0%; in_template 18.8%, out_of_template 6.2%, 32 tasks
each), every greedy call using the tool.

Several calls (``multi_call``: ``max_tool_iterations=3``, so after each tool result the model calls the tool again
or answers in text), 2026-11-27, same machine, 64 validation tasks greedy and 32 train tasks x 8, against the
chosen one-call design in the same run: at temperature 0.7 and max_tokens 48 (the config's), greedy 10.9% against
12.5% (one-step 14.6% against 16.7%, two-step 0% for both), sampled 7.4% against 7.8%, mixed groups 34% against
38%, 1.83 LLM calls per rollout against 1.0. After a right first call the untrained model rarely stops: it writes
text around the result, whose last number is then taken as the answer, or calls again. So a second call does not
reach two-step problems by itself; it doubles the tokens to generate and train on.

Worked examples of every two-step form, 2026-11-27, same machine and settings (T=0.7, max_tokens 48, 64
validation tasks greedy, 32 train tasks x 8), the four variants one after another on one server:

    variant          greedy  1-step  2-step  in | out of template  T=0.7 acc  mixed  tool errors  prompt  calls
    two_shots          12.5%  16.7%    0.0%   18.8% | 6.2%            5.5%     22%      15%        359   1.00
    all_forms          25.0%  29.2%   12.5%   31.2% | 18.8%           9.4%     47%      11%        567   1.00
    stepwise_demo       0.0%   0.0%    0.0%    0.0% | 0.0%            4.7%     25%       5%        488   1.15
    stepwise_forms     23.4%  29.2%    6.2%   34.4% | 12.5%           7.4%     41%       2%        967   1.57

``all_forms`` (one worked example per two-step form, each a single expression, then the one-step one) doubles
greedy accuracy, reaches two-step problems untrained (12.5%) and gives twice as many groups with signal, for 208
more prompt tokens. ``stepwise_demo`` (the same two examples solved one operation per call, with the tool results
shown and a text answer after them) leaves the greedy model answering in text without the tool; with every form
shown stepwise it calls the tool 83% of the time greedy, but composes two calls less often than ``all_forms``
writes one expression. ``calc_agent`` runs ``all_forms`` since: trained 15 minutes from the same seed
(``lit train examples/calc/config.toml train.max_minutes=15``), it reached 82.8% held-out (two-step 50%) where
``two_shots`` had reached 73.4% (two-step 37.5%) the same day.

The question with its numbers listed on a line after it (``agent.with_numbers``, every worked example's too; the
agent does so since 2026-11-27, so every variant above now runs with it), same machine and settings, one after the
other on one server, against ``all_forms`` without the line: greedy 25.0% -> 29.7% (in-template 31.2%, out of
template 18.8% -> 28.1%; two-step 12.5% for both), sampled at T=0.7 9.4% -> 12.9% right, mixed groups 41% -> 47%.
Trained 15 minutes from the same seed it makes the larger difference
(docs/experiments/2026-11-27-calc-prompt-and-training-data.md).

Two more worked examples after the five, a division and ``(a+b)/c`` again (``all_forms`` since the night of
2026-11-27; ``five_shots`` is the agent before), same machine and settings, one after the other on one server:

    variant      greedy  1-step  2-step  in | out of template  T=0.7 acc  mixed  tool errors  prompt
    five_shots    29.7%   35.4%   12.5%   31.2% | 28.1%          10.9%     41%      15%        636
    all_forms     56.2%   72.9%    6.2%   65.6% | 46.9%          23.0%     69%      12%        797

The five examples had no division but ``(28+14)/6``, and sampled one-step divisions were right 0-2% of the time.
Trained, two-step problems are where it counts: docs/experiments/2026-11-27-calc-seven-examples.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autogen_core import FunctionCall
from autogen_core.models import (
    AssistantMessage,
    FunctionExecutionResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    UserMessage,
)

import lit_sdk as lit
from examples.calc.agent import SHOTS, Attempt, calc_agent, calculator, solve
from examples.calc.tasks import TWO_STEP_EVERY, make_tasks

TWO_SHOTS = [SHOTS[0], SHOTS[4]]
"""The agent's worked examples before 2026-11-27: the first two-step form and the one-step one."""


def stepwise_history(steps: list[tuple[str, list[str]]]) -> list[LLMMessage]:
    """Worked turns that make one calculator call per step, each followed by its result, then answer in text with
    the last result: (question, expressions). Real tool calls and results, as AutoGen sends them in its tool loop."""
    messages: list[LLMMessage] = []
    for n, (question, expressions) in enumerate(steps):
        messages.append(UserMessage(content=question, source="user"))
        for k, expression in enumerate(expressions):
            call_id = f"call_{n}_{k}"
            messages += [
                AssistantMessage(content=[FunctionCall(id=call_id, name="calculator",
                                                       arguments=json.dumps({"expression": expression}))],
                                 source="calc"),
                FunctionExecutionResultMessage(content=[FunctionExecutionResult(
                    content=calculator(expression), call_id=call_id, name="calculator", is_error=False)])]
        messages.append(AssistantMessage(content=f"The answer is {calculator(expressions[-1])}.", source="calc"))
    return messages


STEPWISE = [(TWO_SHOTS[0][0], ["20+15", "35-8"]), (TWO_SHOTS[1][0], ["3*12"])]
"""The two worked examples of ``TWO_SHOTS``, solved one operation per calculator call."""
STEPWISE_FORMS = [STEPWISE[0],
                  (SHOTS[1][0], ["4*13", "52+9"]),
                  (SHOTS[2][0], ["5*16", "80-7"]),
                  (SHOTS[3][0], ["28+14", "42/6"]),
                  STEPWISE[1]]
"""The agent's ``SHOTS`` (every two-step form) solved one operation per calculator call."""

VARIANTS: dict[str, dict] = {
    "direct": {"tools": False, "shots": [], "system_message": "Solve the problem. End with the answer as a number."},
    "no_shot": {"shots": []},
    "one_shot": {"shots": TWO_SHOTS[1:]},
    "two_shots": {"shots": TWO_SHOTS},
    "two_shots_full_schema": {"shots": TWO_SHOTS, "compact": False},
    "two_shots_reflect": {"shots": TWO_SHOTS, "reflect": True},
    "multi_call": {"shots": TWO_SHOTS, "tool_iterations": 3},  # after each result, call again or answer in text
    "all_forms": {},  # the agent's own design: every two-step form, a multiplication, a division, (a+b)/c again
    "five_shots": {"shots": SHOTS[:5]},  # the agent until the night of 2026-11-27: no division, (a+b)/c once
    "stepwise_demo": {"tool_iterations": 3, "history": stepwise_history(STEPWISE)},  # two calls, then the answer
    "stepwise_forms": {"tool_iterations": 3, "history": stepwise_history(STEPWISE_FORMS)},
    "three_shots": {
        "shots": [*TWO_SHOTS, ("Mia puts 36 pens equally into 4 boxes. How many pens are in each box?", "36/4")]},
}
"""Designs compared; ``all_forms`` is what ``calc_agent`` runs (``two_shots`` until 2026-11-27, ``five_shots``
until that night)."""


async def run_all(tasks: list[dict], llm: lit.LLM, variant: dict, concurrency: int) -> list[Attempt]:
    gate = asyncio.Semaphore(concurrency)

    async def one(task: dict) -> Attempt:
        async with gate:
            return await solve(task, llm, **variant)

    return await asyncio.gather(*(one(task) for task in tasks))


def describe(attempts: list[Attempt]) -> dict[str, float]:
    calls = sum(a.llm_calls for a in attempts) or 1
    return {
        "accuracy": statistics.fmean(a.reward for a in attempts),
        "tool_use": statistics.fmean(a.used_tool for a in attempts),
        "tool_error": statistics.fmean(a.tool_error for a in attempts),
        "prompt_tokens_per_call": sum(a.prompt_tokens for a in attempts) / calls,
        "response_tokens_per_call": sum(a.completion_tokens for a in attempts) / calls,
        "calls_per_rollout": calls / len(attempts),
    }


async def measure(name: str, base_url: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    variant = VARIANTS[name]
    greedy = lit.LLM(base_url=base_url, model=model, temperature=0.0, max_tokens=args.max_tokens)
    sampled = lit.LLM(base_url=base_url, model=model, temperature=args.temperature, max_tokens=args.max_tokens)
    validation = make_tasks("validation", args.validation)
    train = make_tasks("train", args.train_tasks)

    t0 = time.perf_counter()
    val = await run_all(validation, greedy, variant, args.concurrency)
    val_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups = [task for task in train for _ in range(args.samples)]
    sam = await run_all(groups, sampled, variant, args.concurrency)
    sam_s = time.perf_counter() - t0

    rewards = [[a.reward for a in sam[i:i + args.samples]] for i in range(0, len(sam), args.samples)]
    mixed = statistics.fmean(0 < sum(g) < len(g) for g in rewards)
    v, s = describe(val), describe(sam)
    two = [int(t["id"].split("-")[1]) % TWO_STEP_EVERY == TWO_STEP_EVERY - 1 for t in validation]
    one_step = statistics.fmean(a.reward for a, is_two in zip(val, two, strict=True) if not is_two)
    two_step = statistics.fmean(a.reward for a, is_two in zip(val, two, strict=True) if is_two)
    kinds = {f"greedy_{kind}": statistics.fmean(a.reward for a, t in zip(val, validation, strict=True)
                                                if t["kind"] == kind)
             for kind in dict.fromkeys(t["kind"] for t in validation)}
    row = {"greedy": v["accuracy"], "greedy_1step": one_step, "greedy_2step": two_step, **kinds,
           "greedy_tool": v["tool_use"], "acc_t1": s["accuracy"], "mixed_groups": mixed, "tool_t1": s["tool_use"],
           "tool_error_t1": s["tool_error"], "prompt_per_call": s["prompt_tokens_per_call"],
           "response_per_call": s["response_tokens_per_call"], "calls_per_rollout": s["calls_per_rollout"],
           "val_batch_s": val_s, "train_batch_s": sam_s, "s_per_rollout_t1": sam_s / len(sam)}
    print(f"\n== {name} (max_tokens={args.max_tokens}, temperature={args.temperature}) ==")
    for key, value in row.items():
        print(f"  {key:24s} {value:8.3f}")
    if args.show:
        for a in sam[:args.show]:
            print(f"  --- reward={a.reward} tool={a.used_tool} answer={a.answer}\n  {a.final_text[:300]!r}")
    return row


async def check_entry_point(base_url: str, model: str, args: argparse.Namespace) -> None:
    """``calc_agent`` itself, undecorated by instrumentation, on a few tasks: it must return floats in {0, 1}."""
    llm = lit.LLM(base_url=base_url, model=model, temperature=0.0, max_tokens=args.max_tokens)
    rewards = await asyncio.gather(*(calc_agent(t, llm) for t in make_tasks("validation", 4)))
    assert all(r in (0.0, 1.0) for r in rewards), rewards
    print(f"calc_agent on 4 validation tasks: {rewards}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="all_forms", help=f"one of {sorted(VARIANTS)}, a comma list, or all")
    parser.add_argument("--base-url", default="", help="use this running server instead of starting one")
    parser.add_argument("--model", default="policy", help="model name on --base-url")
    parser.add_argument("--validation", type=int, default=64, help="validation tasks (greedy)")
    parser.add_argument("--train-tasks", type=int, default=16, help="train tasks (sampled --samples times each)")
    parser.add_argument("--samples", type=int, default=8, help="samples per train task at temperature 1.0")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled groups")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--show", type=int, default=0, help="print this many sampled final messages")
    args = parser.parse_args()
    names = sorted(VARIANTS) if args.variant == "all" else args.variant.split(",")

    async def run(base_url: str, model: str) -> None:
        await check_entry_point(base_url, model, args)
        for name in names:
            await measure(name, base_url, model, args)

    if args.base_url:
        asyncio.run(run(args.base_url, args.model))
        return
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer

    with InferenceServer(InferenceConfig(model="smollm2-135m")) as server:
        asyncio.run(run(server.openai_url, server.model_name))


if __name__ == "__main__":
    main()
