"""What the examples' ``measure_baseline.py`` scripts share: their command line, running an agent over many tasks
at a bounded concurrency, and a vLLM server of the untrained model when none is given."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


def arguments(description: str, max_tokens: int = 48, temperature: float = 0.7) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default="", help="use this running server instead of starting one")
    parser.add_argument("--model", default="policy", help="model name on --base-url")
    parser.add_argument("--validation", type=int, default=64, help="validation tasks (greedy)")
    parser.add_argument("--train-tasks", type=int, default=16, help="train tasks (sampled --samples times each)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature, help="temperature of the sampled groups")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--show", type=int, default=0, help="print this many rollouts")
    return parser


async def run_all(tasks: list[dict], solve: Callable[[dict], Awaitable[T]], concurrency: int) -> list[T]:
    """``solve`` on every task, ``concurrency`` at a time, results in task order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: dict) -> T:
        async with gate:
            return await solve(task)

    return await asyncio.gather(*(one(task) for task in tasks))


def main(measure: Callable[[str, str, Any], Awaitable[None]], args: argparse.Namespace) -> None:
    """``measure(base_url, model, args)`` on ``--base-url``, or on a vLLM server of the default model started here."""
    if args.base_url:
        asyncio.run(measure(args.base_url, args.model, args))
        return
    from lit_trainer.engine.config import InferenceConfig
    from lit_trainer.engine.server import InferenceServer

    with InferenceServer(InferenceConfig(model="smollm2-135m")) as server:
        asyncio.run(measure(server.openai_url, server.model_name, args))
