"""The calc agent: an AutoGen ``AssistantAgent`` with a ``calculator`` tool that answers arithmetic word problems;
lit trains the model behind it without changing this code.

    import lit_sdk as lit
    lit.instrument(...)                          # the trainer's worker does this
    reward = await calc_agent(task, llm)         # 1.0 if the final answer equals task["answer"], else 0.0

Design (measured with ``measure_baseline.py``; its docstring has the numbers): one LLM call per rollout. The model
either calls ``calculator`` and the tool's result is the answer (``reflect_on_tool_use=False``: a second call could
only copy the number, and would double the tokens to generate and train on), or it answers in text and the last
number in its text is the answer. Seven worked examples sit in the chat history as earlier user/assistant turns: one
of each two-step form written as a single expression, a multiplication, a division and ``(a+b)/c`` again; their
assistant text is the ``<tool_call>`` exactly as lit's ChatML template renders one, with no tool result after it:
the 135M model copies the latest pattern it saw, so it then calls the tool almost always, whereas a tool result
shown last makes it write ``<tool_response>`` itself (0-2% tool use), and instructions alone give 0%. Every two-step
form shown as one expression doubles the untrained model's accuracy against two examples (greedy 12.5 -> 25%,
two-step 0 -> 12.5%), and solving them one operation per calculator call (several calls, results shown) does worse;
the division and the second ``(a+b)/c`` took it from 29.7 to 56.2% (``SHOTS``). What it still gets wrong, and what
RL has to teach, is which numbers and which operator to put in the expression.

The question reaches the model with its numbers listed on a line after it (``with_numbers``; the worked examples'
questions too): "...then uses 65. How many marbles does the class still have?\nNumbers: 58, 19, 65". The trained
model's commonest mistake on problems in wordings never trained on had been to leave a number out (``58+19``); in
15-minute runs from the same seed on the same day, they went from 68.8 % right without the line to 87.5-93.8 % in
three runs with it, and held-out accuracy from 81.2 % to 87.5-93.8 %
(docs/experiments/2026-11-27-calc-numbers-line.md has the runs).

A tool call that fails (bad expression, unknown tool, bad JSON) or a reply without a number is a wrong answer
(reward 0). Errors of the infrastructure (connection refused, HTTP errors from the server) propagate, so the
trainer retries the rollout. Knows nothing of the trainer; ``lit.trace`` is a pass-through without
``lit.instrument``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent, ToolCallSummaryMessage
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import AssistantMessage, LLMMessage, UserMessage
from autogen_core.tools import FunctionTool, ToolSchema
from autogen_ext.models.openai import OpenAIChatCompletionClient

import lit_sdk as lit
from examples.calc.tasks import make_tasks

SYSTEM_MESSAGE = "Solve the problem with the calculator tool."
SHOTS = [
    ("Ana has 20 coins, gets 15 more, then spends 8. How many coins does Ana have?", "20+15-8"),
    ("Ben buys 4 boxes of 13 pens and already had 9. How many pens does Ben have?", "4*13+9"),
    ("Kim has 5 jars with 16 beads each and drops 7. How many beads are left?", "5*16-7"),
    ("Leo puts 28 red and 14 blue caps equally into 6 cups. How many caps are in each cup?", "(28+14)/6"),
    ("Tom has 3 bags with 12 apples each. How many apples does Tom have?", "3*12"),
    ("Sam shares 84 shells equally among 7 friends. How many shells does each friend get?", "84/7"),
    ("Mia has 27 red and 18 blue pens and puts them equally into 5 cups. How many pens are in each cup?", "(27+18)/5"),
]
"""Worked examples shown as earlier turns of the chat: (question, calculator expression). One of each two-step
form as a single expression, a multiplication, a division, and last the form the untrained model almost never
writes, ``(a+b)/c``, once more. Without the division the model used ``/`` almost never, one-step divisions were
right in 0-2 % of sampled rollouts, and untrained greedy accuracy was 29.7 % instead of 56.2 %
(``measure_baseline.py``). Each two-step one has a number outside what ``tasks.py`` draws for its form (a last
number below 10, a quotient below 11); the one-step ones are training problems; none is a validation problem
(tests/examples/test_calc.py)."""
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
              "structured_output": False}
"""What AutoGen needs to know of a model it has no entry for (the vLLM-served policy)."""
MAX_EXPRESSION_CHARS = 64
"""Longer calculator input is refused: word problems here need a handful of tokens."""
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(expression: str) -> float:
    """The value of an expression of numbers, + - * / and parentheses; anything else raises ValueError.
    Walks the parsed tree itself: no ``eval``, no names, no calls, no powers."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("÷", "/").replace("x", "*"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses are allowed: {expression!r}")

    return value(tree.body)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. 3*12+5."""
    result = evaluate(expression)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


@dataclass
class Attempt:
    """One rollout's outcome, with what ``measure_baseline.py`` reports about it."""

    reward: float
    answer: float | None
    """The number taken as the final answer; None when there was none."""
    final_text: str
    used_tool: bool
    tool_error: bool
    llm_calls: int
    prompt_tokens: int
    completion_tokens: int


def with_numbers(question: str) -> str:
    """The question as the model sees it: its numbers listed on a line of their own after it."""
    return f"{question}\nNumbers: {', '.join(NUMBER.findall(question))}"


def final_number(text: str) -> float | None:
    """The last number in ``text`` (the final answer), or None."""
    numbers = NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def tool_call_text(expression: str) -> str:
    """A calculator call exactly as lit's chat template renders an assistant's tool call."""
    return f'<tool_call>\n{{"name": "calculator", "arguments": {json.dumps({"expression": expression})}}}\n</tool_call>'


def demonstration(shots: list[tuple[str, str]]) -> list[LLMMessage]:
    """Earlier turns in which the agent answered each shot with a calculator call. The call is given as the
    assistant's text and no tool result follows: the model copies the latest pattern it saw, and a tool result
    last would teach it to write ``<tool_response>`` itself (measured: tool use 0-2% instead of 97-100%)."""
    messages: list[LLMMessage] = []
    for question, expression in shots:
        messages += [UserMessage(content=with_numbers(question), source="user"),
                     AssistantMessage(content=tool_call_text(expression), source="calc")]
    return messages


class CompactTool(FunctionTool):
    """``calculator`` with a minimal JSON schema: AutoGen's own adds titles, a copy of the parameter name as
    its description, ``additionalProperties`` and ``strict`` (about 20 prompt tokens the model does not need)."""

    @property
    def schema(self) -> ToolSchema:
        return ToolSchema(name=self.name, description=self.description, parameters={
            "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})


def make_client(llm: lit.LLM) -> OpenAIChatCompletionClient:
    return OpenAIChatCompletionClient(model=llm.model, base_url=llm.base_url, api_key=llm.api_key,
                                      model_info=MODEL_INFO, temperature=llm.temperature, max_tokens=llm.max_tokens)


async def solve(task: dict, llm: lit.LLM, *, system_message: str = SYSTEM_MESSAGE, reflect: bool = False,
                tools: bool = True, shots: list[tuple[str, str]] = SHOTS, compact: bool = True,
                tool_iterations: int = 1, history: list[LLMMessage] | None = None) -> Attempt:
    """Run the agent once on ``task`` and grade it. The keywords exist for ``measure_baseline.py``'s variants;
    ``calc_agent`` uses the defaults. ``history`` replaces the worked turns made from ``shots``."""
    client = make_client(llm)
    try:
        tool = (CompactTool if compact else FunctionTool)(calculator, calculator.__doc__ or "")
        agent = AssistantAgent("calc", model_client=client, tools=[tool] if tools else None,
                               system_message=system_message, reflect_on_tool_use=reflect,
                               max_tool_iterations=tool_iterations,
                               model_context=UnboundedChatCompletionContext(
                                   demonstration(shots) if history is None else list(history)))
        result = await agent.run(task=with_numbers(task["question"]))
    finally:
        await client.close()
    final = result.messages[-1]
    text = final.content if isinstance(final.content, str) else str(final.content)
    executions = [m for m in result.messages if isinstance(m, ToolCallExecutionEvent)]
    tool_error = any(r.is_error for m in executions for r in m.content)
    # A failed call's error text is no answer, even if it ends with a number.
    answer = None if tool_error and isinstance(final, ToolCallSummaryMessage) else final_number(text)
    usages = [m.models_usage for m in result.messages if m.models_usage is not None]
    return Attempt(
        reward=float(answer is not None and answer == task["answer"]),
        answer=answer,
        final_text=text,
        used_tool=any(isinstance(m, ToolCallRequestEvent) for m in result.messages),
        tool_error=tool_error,
        llm_calls=len(usages),
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
    )


def tasks_with_references(split: str, n: int) -> list[dict]:
    """``tasks.make_tasks``, each task with the ``reference`` lit's off-policy guidance needs (``rollouts.guidance``):
    the calculator call of the task's expression, as the model writes one (``tool_call_text``)."""
    return [{**task, "reference": tool_call_text(task["expression"])} for task in make_tasks(split, n)]


@lit.trace(agent="calc")
async def calc_agent(task: dict, llm: lit.LLM) -> float:
    """One rollout: 1.0 if the agent's final answer equals ``task["answer"]``, else 0.0."""
    return (await solve(task, llm)).reward
