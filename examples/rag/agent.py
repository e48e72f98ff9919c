"""The RAG agent: an OpenAI Agents SDK agent that answers two-hop questions by searching a local encyclopedia
(``corpus.py``) with a ``search`` tool, then answering; lit trains the model behind it without changing this code.

    reward = await rag_agent(task, llm)   # 0.9 x answer F1 + 0.1 x format

One rollout is up to ``max_searches`` + 1 LLM calls of the agent ``researcher`` (three by default), each a
``Runner.run`` of one turn:

1. to ``max_searches``. The agent sees the question and its notes (every passage its searches found so far) and
   chooses: it calls ``search`` (the run stops at the tool: ``tool_use_behavior="stop_on_first_tool"``), or it
   answers, which ends the rollout.
2. After ``max_searches`` searches, the same agent without the tool writes the answer: ``Answer: <answer>``.

``max_searches`` is ``MAX_SEARCHES`` (2: every generated question needs two), or the task's own ``"max_searches"``
for questions that need more hops.

Design (``measure_baseline.py`` has the numbers). Each call shows worked turns of one question about another world
(``DEMO``) in the exact ``<tool_call>`` form lit's chat template renders, then the real question with its notes.
The 135M model copies the latest pattern it saw: with the tool results left in the chat as tool turns (the SDK's
usual loop), it wrote ``<tool_response>`` itself and never answered; with notes it searches the right entity, then
the bridge entity, but keeps searching; shown only the answer turn, the third call answers.

Rewards. The return is 0.9 x token F1 of the answer against the gold one (SQuAD normalisation) + 0.1 x format
(the final message is one line ``Answer: ...`` without tool tags). Each search that finds a supporting passage not
in the notes yet records ``lit.reward(USEFUL_RETRIEVAL)``: lit's ``intermediate`` and ``discounted`` credit modes
add it to that call's reward, ``identical`` (the default) ignores it, since the return is the episode's verdict.
A model reply the SDK cannot use (a malformed or unknown tool call) ends the rollout with what it has. Errors of
the infrastructure (connection refused, HTTP errors) propagate so the trainer retries the rollout.
"""

from __future__ import annotations

import collections
import json
import re
import string
from dataclasses import dataclass, field

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

import lit_sdk as lit
from examples.rag.corpus import search as search_corpus

AGENT_NAME = "researcher"
INSTRUCTIONS = "Answer the question. Search for each person, company or city you need, then give the answer."
MAX_SEARCHES = 2
"""The most searches before the answer call, unless a task says ``"max_searches"``: every generated question needs
two. The agent may answer sooner."""
SEARCH_LIMIT = 10
"""The most a task may ask for (each search is one more LLM call of ~350 prompt tokens)."""
USEFUL_RETRIEVAL = 0.1
"""Intermediate reward for a search that finds a supporting passage not already in the notes."""
DEMO = ("In which country was Mira Kolt born?",
        [("Mira Kolt", ["Mira Kolt was born in Tesbury.", "Mira Kolt works as a nurse."]),
         ("Tesbury", ["Tesbury is a city in Lomania.", "Arno Tesk was born in Tesbury."])],
        "Lomania")
"""A worked question about names no world uses: (question, [(search query, passages found)], answer)."""
_ANSWER = re.compile(r"\s*Answer:\s*(.+?)\s*", re.DOTALL)


def prompt(question: str, notes: list[str], final: bool = False) -> str:
    return (f"Question: {question}\nNotes: {' '.join(notes) if notes else 'none'}"
            + ("\nGive the answer." if final else ""))


def tool_call_text(query: str) -> str:
    """A search call exactly as lit's chat template renders an assistant's tool call."""
    return f'<tool_call>\n{{"name": "search", "arguments": {json.dumps({"query": query})}}}\n</tool_call>'


def demonstration() -> tuple[list[dict], list[dict]]:
    """The worked turns before a search call (each search, then the answer) and before the answer call (the
    answer turn alone)."""
    question, hops, answer = DEMO
    turns: list[dict] = []
    notes: list[str] = []
    for query, found in hops:
        turns += [{"role": "user", "content": prompt(question, notes)},
                  {"role": "assistant", "content": tool_call_text(query)}]
        notes += [p for p in found if p not in notes]
    answer_turns = [{"role": "user", "content": prompt(question, notes, final=True)},
                    {"role": "assistant", "content": f"Answer: {answer}"}]
    return turns + answer_turns, answer_turns


def normalise(text: str) -> list[str]:
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def f1(prediction: str, gold: str) -> float:
    """SQuAD's token F1 after lower-casing and removing punctuation and articles."""
    pred, ref = normalise(prediction), normalise(gold)
    same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def grade(final: str, gold: str) -> tuple[float, float, float]:
    """(reward, F1, format) of a final message: F1 of the text after ``Answer:`` (else of the whole message);
    format 1 when the message is one line ``Answer: ...`` without tags."""
    found = _ANSWER.fullmatch(final)
    answer = found.group(1) if found else final
    good_format = float(bool(found) and "\n" not in answer and "<" not in final)
    score = f1(answer, gold)
    return 0.9 * score + 0.1 * good_format, score, good_format


@dataclass
class Attempt:
    """One rollout's outcome, with what ``measure_baseline.py`` reports about it."""

    reward: float = 0.0
    f1: float = 0.0
    format: float = 0.0
    final: str = ""
    searches: list[str] = field(default_factory=list)
    useful: int = 0
    """Searches that found a supporting passage new to the notes."""
    answered_early: bool = False
    """The agent answered while it could still search."""
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def max_searches(task: dict) -> int:
    """The task's ``"max_searches"`` (a whole number from 1 to ``SEARCH_LIMIT``), else ``MAX_SEARCHES``."""
    value = task.get("max_searches", MAX_SEARCHES)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SEARCH_LIMIT:
        raise ValueError(f"the task's max_searches must be a whole number from 1 to {SEARCH_LIMIT}, got {value!r}")
    return value


async def solve(task: dict, llm: lit.LLM) -> Attempt:
    """Run the agent once on ``task`` and grade its answer."""
    limit = max_searches(task)
    attempt = Attempt()
    notes: list[str] = []
    supporting = set(task.get("supporting", ()))

    @function_tool
    async def search(query: str) -> str:
        """Search the encyclopedia for a person, company or city."""
        found = search_corpus(query, corpus=task.get("corpus"))  # a task may name a corpus of your own
        new = [p for p in found if p not in notes]
        attempt.searches.append(query)
        if supporting & set(new):
            attempt.useful += 1
            lit.reward(USEFUL_RETRIEVAL, name="useful_retrieval")
        notes.extend(new)
        return "\n".join(found) or "no results"

    client = AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key or "unused", max_retries=0)
    settings = ModelSettings(temperature=llm.temperature, max_tokens=llm.max_tokens)
    searcher = Agent(name=AGENT_NAME, instructions=INSTRUCTIONS, tools=[search],
                     tool_use_behavior="stop_on_first_tool", model_settings=settings,
                     model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client))
    answerer = searcher.clone(tools=[])
    search_turns, answer_turns = demonstration()
    try:
        for call in range(limit + 1):
            final = call == limit
            before = len(attempt.searches)
            turns = answer_turns if final else search_turns
            user = {"role": "user", "content": prompt(task["question"], notes, final)}
            try:
                result = await Runner.run(answerer if final else searcher, [*turns, user], max_turns=1)
            except (MaxTurnsExceeded, ModelBehaviorError):
                break  # a tool call the SDK cannot run (an unknown tool, bad JSON, or one in the answer call)
            attempt.llm_calls += 1
            for response in result.raw_responses:
                attempt.prompt_tokens += response.usage.input_tokens
                attempt.completion_tokens += response.usage.output_tokens
            if len(attempt.searches) == before:  # it answered instead of searching
                attempt.final = str(result.final_output or "")
                attempt.answered_early = not final
                break
    finally:
        await client.close()
    attempt.reward, attempt.f1, attempt.format = grade(attempt.final, task["answer"])
    return attempt


@lit.trace(agent="rag")
async def rag_agent(task: dict, llm: lit.LLM) -> float:
    """One rollout: 0.9 x answer F1 + 0.1 x format, with an intermediate reward per useful search."""
    return (await solve(task, llm)).reward
