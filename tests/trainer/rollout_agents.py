"""Agent functions for the dispatcher tests: each behaves in one way a real agent can (returns, raises, hangs,
takes its worker down). They make no LLM call: the worker and dispatcher are what is under test."""

import asyncio
import os
import signal

import lit_sdk as lit
from lit_sdk import _context


@lit.trace
async def returns_task_value(task, llm):
    await asyncio.sleep(0.05)
    return float(task["value"])


@lit.trace
async def raises(task, llm):
    raise RuntimeError("agent bug on purpose")


@lit.trace
async def fails_first_attempt(task, llm):
    if _context.current_rollout().attempt == 1:
        raise ConnectionError("the first attempt loses its connection")
    return 1.0


@lit.trace
async def hangs(task, llm):
    await asyncio.sleep(3600)


@lit.trace
def kills_its_worker(task, llm):
    os.kill(os.getpid(), signal.SIGKILL)
