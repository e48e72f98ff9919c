"""Real LangChain, AutoGen and OpenAI Agents SDK agents that call a tool, traced by lit, against a local engine
that answers like vLLM. Each rollout must arrive over ZeroMQ as one trace with the expected tree, the engine's
exact token ids on every LLM call, the agent names and the rewards. Attribute checks on lit's spans are
exhaustive: every expected key is popped, then nothing may be left.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import lit_sdk as lit
from lit_sdk import semconv as sc

MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def pop_rollout_ids(attrs: dict[str, Any], rollout_id: str) -> None:
    assert attrs.pop(sc.ROLLOUT_ID) == rollout_id
    assert attrs.pop(sc.TASK_ID) == ""
    assert attrs.pop(sc.ATTEMPT) == 1


def check_llm_span(span: dict, response: dict, request: dict, agent: str, rollout_id: str) -> None:
    assert request["return_token_ids"] is True and request["logprobs"] is True
    choice = response["choices"][0]
    attrs = dict(span["attributes"])
    assert attrs.pop(sc.LLM_API) == "chat"
    assert attrs.pop(sc.AGENT_NAME) == agent
    assert attrs.pop(sc.LLM_PROMPT_TOKEN_IDS) == response["prompt_token_ids"]
    assert attrs.pop(sc.LLM_RESPONSE_TOKEN_IDS) == choice["token_ids"]
    assert attrs.pop(sc.LLM_RESPONSE_LOGPROBS) == [c["logprob"] for c in choice["logprobs"]["content"]]
    assert attrs.pop(sc.LLM_MODEL) == response["model"]
    assert attrs.pop(sc.LLM_RESPONSE_ID) == response["id"]
    assert attrs.pop(sc.LLM_FINISH_REASON) == choice["finish_reason"]
    assert attrs.pop(sc.LLM_CHOICES) == 1
    pop_rollout_ids(attrs, rollout_id)
    assert attrs == {}
    assert span["status"] == 1 and span["rollout_id"] == rollout_id


def check_root(span: dict, name: str, task: str, reward: float, n_spans: int) -> str:
    attrs = dict(span["attributes"])
    rollout_id = span["rollout_id"]
    assert span["name"] == sc.ROLLOUT_SPAN and span["parent_id"] is None and span["status"] == 1
    assert attrs.pop(sc.ROLLOUT_NAME) == name
    assert attrs.pop(sc.ROLLOUT_INPUT) == f'{{"args": ["{task}"], "kwargs": {{}}}}'
    assert attrs.pop(sc.ROLLOUT_OUTPUT) == repr(reward)
    assert attrs.pop(sc.ROLLOUT_RETURN_REWARD) == reward
    assert attrs.pop(sc.ROLLOUT_SPANS) == n_spans  # the rollout's spans that had ended by then, the root included
    pop_rollout_ids(attrs, rollout_id)
    assert attrs == {}
    return rollout_id


def check_reward(span: dict, root: dict, value: float, name: str) -> None:
    attrs = dict(span["attributes"])
    assert span["parent_id"] == root["span_id"]
    assert attrs.pop(sc.REWARD_VALUE) == value
    assert attrs.pop(sc.REWARD_NAME) == name
    pop_rollout_ids(attrs, root["rollout_id"])
    assert attrs == {}


def check_rollout(tracing, name: str, agent: str, n_calls: int) -> dict[str, Any]:
    """The common checks; returns the spans by name for the framework-specific tree checks."""
    spans = tracing.delivered()
    record_golden(spans)
    assert len({s["trace_id"] for s in spans}) == 1, "a rollout is one trace"
    roots = [s for s in spans if s["name"] == sc.ROLLOUT_SPAN]
    assert len(roots) == 1
    root = roots[0]
    ended_first = [s for s in spans if s["end_ns"] <= root["end_ns"]]  # AutoGen ends a span in the background
    rollout_id = check_root(root, name, "2+3?", 1.0, len(ended_first))
    assert all(s["rollout_id"] == rollout_id for s in spans)
    llm_spans = sorted((s for s in spans if s["name"] == sc.LLM_SPAN), key=lambda s: s["start_ns"])
    assert len(llm_spans) == n_calls == len(tracing.llm.responses)
    for span, request, response in zip(llm_spans, tracing.llm.requests, tracing.llm.responses, strict=True):
        check_llm_span(span, response, request, agent, rollout_id)
    rewards = [s for s in spans if s["name"] == sc.REWARD_SPAN]
    assert len(rewards) == 1
    check_reward(rewards[0], root, 0.25, "format")
    by_id = {s["span_id"]: s for s in spans}
    return {"root": root, "llm": llm_spans, "by_id": by_id, "names": [s["name"] for s in spans]}


def record_golden(spans: list[dict]) -> None:
    """With LIT_RECORD_GOLDEN=DIR, keep the delivered spans as DIR/<test name>.json: the trainer's golden trees."""
    folder = os.environ.get("LIT_RECORD_GOLDEN")
    if folder:
        test = re.sub(r"\W+", "_", os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0])
        ordered = sorted(spans, key=lambda s: s["start_ns"])
        Path(folder, f"{test.removeprefix('test_')}.json").write_text(json.dumps(ordered, indent=1))


def ancestry(span: dict, by_id: dict[str, dict]) -> list[str]:
    names = []
    while span["parent_id"] is not None:
        span = by_id[span["parent_id"]]
        names.append(span["name"])
    return names


def test_langchain_create_agent(tracing):
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=tracing.llm.base_url, api_key="unused", model="policy")
    agent = create_agent(model, tools=[tool(add)], name="calc")

    @lit.trace
    def solve(question: str) -> float:
        out = agent.invoke({"messages": [{"role": "user", "content": question}]})
        assert out["messages"][-1].content == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert solve("2+3?") == 1.0
    tree = check_rollout(tracing, "solve", agent="calc", n_calls=2)
    assert {"calc", "model", "tools", "add", "ChatOpenAI"} <= set(tree["names"])
    # The tool ran with the arguments the engine chose.
    assert tracing.llm.requests[1]["messages"][-1]["content"] == "5"


def test_autogen_assistant_agent(tracing):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model="policy", base_url=tracing.llm.base_url, api_key="unused", model_info=MODEL_INFO
    )
    agent = AssistantAgent("calculator", model_client=client, tools=[add], reflect_on_tool_use=True)

    @lit.trace
    async def solve(question: str) -> float:
        result = await agent.run(task=question)
        assert result.messages[-1].content == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert asyncio.run(solve("2+3?")) == 1.0
    tree = check_rollout(tracing, "solve", agent="calculator", n_calls=2)
    for span in tree["llm"]:
        path = ancestry(span, tree["by_id"])
        assert path == ["OpenAIChatCompletionClient.create", "calculator.on_messages_stream", sc.ROLLOUT_SPAN]
    assert "calculator.add" in tree["names"]


def test_openai_agents_sdk_agent(tracing):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI

    model = OpenAIChatCompletionsModel(
        model="policy", openai_client=AsyncOpenAI(base_url=tracing.llm.base_url, api_key="unused")
    )
    agent = Agent(name="calculator", instructions="Use the tool.", tools=[function_tool(add)], model=model)

    @lit.trace
    async def solve(question: str) -> float:
        result = await Runner.run(agent, question)
        assert result.final_output == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert asyncio.run(solve("2+3?")) == 1.0
    tree = check_rollout(tracing, "solve", agent="calculator", n_calls=2)
    for span in tree["llm"]:
        path = ancestry(span, tree["by_id"])
        assert path[:3] == ["generation", "turn", "calculator"] and path[-1] == sc.ROLLOUT_SPAN
    assert "add" in tree["names"]


def test_autogen_two_agents_are_told_apart(tracing):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.teams import RoundRobinGroupChat
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model="policy", base_url=tracing.llm.base_url, api_key="unused", model_info=MODEL_INFO
    )
    planner = AssistantAgent("planner", model_client=client)
    solver = AssistantAgent("solver", model_client=client, tools=[add], reflect_on_tool_use=True)
    team = RoundRobinGroupChat([planner, solver], max_turns=2)

    @lit.trace
    async def solve(question: str) -> float:
        await team.run(task=question)
        return 1.0

    asyncio.run(solve("2+3?"))
    llm = sorted((s for s in tracing.delivered() if s["name"] == sc.LLM_SPAN), key=lambda s: s["start_ns"])
    assert [s["attributes"][sc.AGENT_NAME] for s in llm] == ["planner", "solver", "solver"]


# MCP tools: each framework's own MCP client, a real MCP server over stdio (mcp_calculator.py), traced by lit. vLLM
# needs mcp 2 and these clients need mcp 1, which is why vLLM has an environment of its own (docs/install.md).
MCP_CALCULATOR = [sys.executable, str(Path(__file__).with_name("mcp_calculator.py"))]


def check_mcp_tool_ran(tracing, agent: str) -> dict[str, Any]:
    """The rollout arrived whole and the MCP server's answer (2 + 3) went back to the engine as the tool result."""
    tree = check_rollout(tracing, "solve", agent=agent, n_calls=2)
    tool_results = [m for m in tracing.llm.requests[1]["messages"] if m["role"] == "tool"]
    assert len(tool_results) == 1 and "5" in json.dumps(tool_results[0]["content"])
    return tree


def test_autogen_agent_with_an_mcp_workbench(tracing):
    from autogen_agentchat.agents import AssistantAgent
    from autogen_ext.models.openai import OpenAIChatCompletionClient
    from autogen_ext.tools.mcp import McpWorkbench, StdioServerParams

    client = OpenAIChatCompletionClient(
        model="policy", base_url=tracing.llm.base_url, api_key="unused", model_info=MODEL_INFO
    )

    @lit.trace
    async def solve(question: str) -> float:
        params = StdioServerParams(command=MCP_CALCULATOR[0], args=MCP_CALCULATOR[1:])
        async with McpWorkbench(params) as workbench:
            assert [t["name"] for t in await workbench.list_tools()] == ["add"]
            agent = AssistantAgent("calculator", model_client=client, workbench=workbench, reflect_on_tool_use=True)
            result = await agent.run(task=question)
        assert result.messages[-1].content == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert asyncio.run(solve("2+3?")) == 1.0
    check_mcp_tool_ran(tracing, agent="calculator")


def test_langchain_agent_with_mcp_tools(tracing):
    from langchain.agents import create_agent
    from langchain_mcp_adapters.client import MultiServerMCPClient
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=tracing.llm.base_url, api_key="unused", model="policy")
    servers = {"calculator": {"command": MCP_CALCULATOR[0], "args": MCP_CALCULATOR[1:], "transport": "stdio"}}

    @lit.trace
    async def solve(question: str) -> float:
        tools = await MultiServerMCPClient(servers).get_tools()
        assert [t.name for t in tools] == ["add"]
        out = await create_agent(model, tools=tools, name="calc").ainvoke(
            {"messages": [{"role": "user", "content": question}]}
        )
        assert out["messages"][-1].content == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert asyncio.run(solve("2+3?")) == 1.0
    assert "add" in check_mcp_tool_ran(tracing, agent="calc")["names"]


def test_openai_agents_sdk_agent_with_an_mcp_server(tracing):
    from agents import Agent, OpenAIChatCompletionsModel, Runner
    from agents.mcp import MCPServerStdio
    from openai import AsyncOpenAI

    model = OpenAIChatCompletionsModel(
        model="policy", openai_client=AsyncOpenAI(base_url=tracing.llm.base_url, api_key="unused")
    )

    @lit.trace
    async def solve(question: str) -> float:
        async with MCPServerStdio(params={"command": MCP_CALCULATOR[0], "args": MCP_CALCULATOR[1:]}) as server:
            agent = Agent(name="calculator", instructions="Use the tool.", mcp_servers=[server], model=model)
            result = await Runner.run(agent, question)
        assert result.final_output == tracing.llm.final_text
        lit.reward(0.25, name="format")
        return 1.0

    assert asyncio.run(solve("2+3?")) == 1.0
    check_mcp_tool_ran(tracing, agent="calculator")
