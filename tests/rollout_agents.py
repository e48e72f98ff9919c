"""Agent functions for the dispatcher tests: each behaves in one way a real agent can (returns, raises, hangs,
takes its worker down, has a tool that raises). They make no LLM call: the worker and dispatcher are what is under
test."""

import asyncio
import os
import signal
import time

import lit_sdk as lit
from lit_sdk import _context

if os.environ.get("LIT_TEST_INSTRUMENT_DELAY_S"):  # a worker whose lit.instrument() takes this much longer
    import lit_sdk.worker

    _instrument = lit_sdk.worker.instrument

    def _slow_instrument(*args, **kwargs):
        time.sleep(float(os.environ["LIT_TEST_INSTRUMENT_DELAY_S"]))
        return _instrument(*args, **kwargs)

    lit_sdk.worker.instrument = _slow_instrument


@lit.trace
async def returns_task_value(task, llm):
    await asyncio.sleep(0.05)
    return float(task["value"])


@lit.trace
async def returns_after_its_seconds(task, llm):
    await asyncio.sleep(task.get("seconds", 0.05))
    return float(task["value"])


@lit.trace
async def slower_on_a_slow_server(task, llm):
    """Takes 2 s when its LLM's URL names a slow server, else 0.05 s; its reward says which (1: the slow one)."""
    slow = "slow" in llm.base_url
    await asyncio.sleep(2.0 if slow else 0.05)
    return 1.0 if slow else 0.0


@lit.trace
async def rewards_where_it_runs(task, llm):
    """Gives its reward with ``lit.reward`` and returns where it ran: its process and its network namespace, which
    the stored root span keeps as the rollout's output."""
    await asyncio.sleep(0.05)
    lit.reward(float(task["value"]))
    return {"pid": os.getpid(), "net": os.readlink("/proc/self/ns/net")}


@lit.trace
async def raises(task, llm):
    raise RuntimeError("agent bug on purpose")


def _failing_tool():
    """A real LangChain tool (traced by openinference's LangChain instrumentor) that raises."""
    from langchain_core.tools import tool

    @tool
    def lookup(query: str) -> str:
        """Look something up."""
        raise LookupError("the tool failed on purpose")

    return lookup


@lit.trace
async def tool_raises_and_agent_goes_on(task, llm):
    """The agent's tool raises; the agent hands the error back as the tool's answer (as LangGraph's ToolNode does)
    and finishes: reward 1 when it saw the error."""
    try:
        answer = await _failing_tool().ainvoke({"query": str(task["id"])})
    except LookupError as exc:
        answer = f"error: {exc}"
    return float(answer.startswith("error"))


@lit.trace
async def tool_raises_through_the_agent(task, llm):
    return await _failing_tool().ainvoke({"query": str(task["id"])})


@lit.trace
async def fails_first_attempt(task, llm):
    if _context.current_rollout().attempt == 1:
        raise ConnectionError("the first attempt loses its connection")
    return 1.0


@lit.trace
async def hangs(task, llm):
    await asyncio.sleep(3600)


@lit.trace
def sync_hangs(task, llm):
    """A sync agent stuck in a call that never returns (Python cannot stop its thread); it creates the file
    ``task["mark"]`` once in the call."""
    open(task["mark"], "w").close()
    time.sleep(3600)


@lit.trace
def kills_its_worker(task, llm):
    os.kill(os.getpid(), signal.SIGKILL)


@lit.trace(agent="parity")
async def reply_length_parity(task, llm):
    """A real LLM call on the trainer's vLLM; reward 1 when the reply has an even number of characters. Sampled
    at temperature 1 the rewards of a group almost always differ, so every step has something to train on."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    chat = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}],
        temperature=llm.temperature, max_tokens=llm.max_tokens)
    await client.close()
    if task.get("solved"):  # a task every rollout solves: its group has nothing to teach (dynamic sampling)
        return 1.0
    if task.get("unsolvable"):  # a task no rollout solves: its group teaches nothing without guidance
        return 0.0
    return float(len(chat.choices[0].message.content or "") % 2 == 0)


def parity_tasks(split, n):
    return [{"id": f"{split}{i}", "question": f"Say a word that starts with the letter {chr(97 + i % 26)}."}
            for i in range(n)]


def guided_parity_tasks(split, n):
    """``parity_tasks`` of which one in three (``train0``, ``train3``...) is ``unsolvable`` (reward 0 whatever the
    reply) and carries a ``reference`` reply, for off-policy guidance (``rollouts.guidance``)."""
    return [{**task, "unsolvable": True, "reference": "Apple."} if i % 3 == 0 else task
            for i, task in enumerate(parity_tasks(split, n))]


def some_solved_parity_tasks(split, n):
    """``parity_tasks`` of which one in seven is ``solved`` (reward 1 whatever the reply): ``train4``, ``train11``,
    ``train18``. Their ``family`` is ``"solved"``, every other task's its own (a curriculum's category). Each has a
    ``reference`` reply (an even one), for demonstrations (``sft.source = "references"``)."""
    return [{**task, "solved": i % 7 == 4, "family": "solved" if i % 7 == 4 else task["id"], "reference": "Apple!"}
            for i, task in enumerate(parity_tasks(split, n))]


@lit.trace
async def two_framework_parity(task, llm):
    """Two agents as their frameworks' docs show them, neither asking for anything lit needs: the OpenAI Agents
    SDK's default agent (its Responses API model), then a streamed LangChain chat (``ChatOpenAI(streaming=True)``,
    ``astream``). Reward 1 when the two replies together have an even number of characters."""
    from agents import Agent, ModelBehaviorError, ModelSettings, OpenAIResponsesModel, Runner
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    writer = Agent(name="writer", instructions="Answer in one word.",
                   model=OpenAIResponsesModel(model=llm.model, openai_client=client),
                   model_settings=ModelSettings(temperature=llm.temperature, max_tokens=llm.max_tokens))
    try:
        first = (await Runner.run(writer, task["question"])).final_output
    except ModelBehaviorError:  # the SDK refuses an answer cut at max_tokens (`response.incomplete`), as OpenAI's
        first = ""
    chat = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key, streaming=True,
                      temperature=llm.temperature, max_tokens=llm.max_tokens)
    second = "".join([chunk.content async for chunk in chat.astream(f"Repeat: {first}")])
    await client.close()
    return float(len(first + second) % 2 == 0)


@lit.trace
async def posts_a_reward_to_its_url(task, llm):
    """Posts its reward to the rollout's URL at lit's gateway (as a program without the SDK does) and returns the
    URL, which the stored root span keeps as the rollout's output."""
    import json
    import urllib.request

    url = llm.base_url.removesuffix("/v1") + "/reward"
    body = json.dumps({"value": 1.0}).encode()
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).read())
    return url


async def _say(llm, agent_prompt: str) -> str:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    chat = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": agent_prompt}],
        temperature=llm.temperature, max_tokens=llm.max_tokens)
    await client.close()
    return chat.choices[0].message.content or ""


@lit.trace(agent="writer")
async def _writer(task, llm):
    return await _say(llm, task["question"])


@lit.trace(agent="rewriter")
async def _rewriter(draft, llm):
    return await _say(llm, f"Say it again, shorter: {draft}")


@lit.trace(agent="checker")
async def _checker(text, llm):
    return await _say(llm, f"Is this a word? {text}")


@lit.trace
async def three_role_parity(task, llm):
    """Three agents, each named by a nested ``@lit.trace(agent=...)``: a writer, a rewriter of its draft, and a
    checker whose answer does not count. Every call passes the one ``llm.model`` it was given: which adapter serves
    it is lit's business ([roles]). Reward 1 when the rewritten reply has an even number of characters."""
    draft = await _writer(task, llm)
    final = await _rewriter(draft, llm)
    await _checker(final, llm)
    return float(len(final) % 2 == 0)
