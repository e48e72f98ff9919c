"""The agent of ``rollout_throughput.py``: three chat calls per rollout through the real openai client, traced by
lit; the rollout returns its reward (1.0), which lands on the root span: four spans per rollout. Importable by
worker processes (``load_agent:three_calls`` with bench/ on the path).
"""

from __future__ import annotations

from openai import AsyncOpenAI

import lit_sdk as lit

CALLS = 3
_clients: dict[str, AsyncOpenAI] = {}


def _client(llm: lit.LLM) -> AsyncOpenAI:
    """One client per endpoint and process: its connection pool is reused across rollouts, as an agent would."""
    client = _clients.get(llm.base_url)
    if client is None:
        client = _clients[llm.base_url] = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0)
    return client


async def calls(task: dict, llm: lit.LLM) -> float:
    """The rollout itself, untraced: what the baseline runs."""
    messages = [{"role": "user", "content": f"task {task['id']}"}]
    for _ in range(CALLS):
        response = await _client(llm).chat.completions.create(model=llm.model, messages=messages,
                                                              temperature=llm.temperature, max_tokens=8)
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        messages.append({"role": "user", "content": "go on"})
    return 1.0


@lit.trace
async def three_calls(task: dict, llm: lit.LLM) -> float:
    return await calls(task, llm)
