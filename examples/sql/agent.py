"""The SQL agent: a LangGraph graph of three roles that answers a question about a SQLite database; lit trains the
model behind two of them without changing this code.

    reward = await sql_agent(task, llm)   # 1.0 if the final query's rows equal the gold query's, else 0.0

    writer ──> checker ──(objects, rounds left)──> rewriter ──> checker ...
                  └──(accepts, or no rounds left)──> end

- ``writer`` drafts a query from the table's schema and the question (an LLM call).
- ``checker`` runs the query on the database, in ``sandbox.py`` and off the event loop. A query that fails or
  returns no rows is an objection by itself (no LLM call is needed to see that); one that returns rows is judged
  by an LLM call that sees the question, the query and its rows.
- ``rewriter`` writes a corrected query from the question, the query and the checker's objection (an LLM call).
  ``MAX_REWRITES`` bounds the rounds; the last rewrite goes to the end unchecked.

All three roles use the served model (the policy being trained). ``examples/sql/config.toml`` trains only the
writer's and the rewriter's calls (``agents = ["writer", "rewriter"]``): the checker's judgement shapes the episode
but is never a training target, as in Agent Lightning's SQL experiment. lit names each call after its LangGraph node.

Design (``measure_baseline.py`` has the numbers): worked examples as earlier chat turns on two tables that no split
uses (``pets`` and ``homes``), one of them a join when the database has a foreign key; the query alone as the
answer; the schema read from the database, a line per table and per key (``databases.format_schema``), so any
SQLite file works: the generated ones or the user's (``spider.py``).

Reward: execution match, the rows of the final query against the gold query's, as multisets (row order ignored,
numbers compared to 4 decimals). A query that fails, tries to write, runs past a limit of the sandbox, or is empty
earns 0: its error is a line the checker and rewriter show the model, never an exception. Errors of the
infrastructure (connection refused, HTTP errors) and a failing gold query propagate so the trainer retries the
rollout.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TypedDict

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, StateGraph

import lit_sdk as lit
from examples.sql.databases import database, format_schema, run_query, schema, schema_text
from examples.sql.sandbox import query_rows

MAX_REWRITES = 1
"""Rounds of checking and rewriting after the first draft (each round costs a checker and a rewriter call)."""
CHECKER_MAX_TOKENS = 4
"""The checker answers yes or no."""
RESULT_ROWS_SHOWN = 5
"""Rows of a result shown to the checker and the rewriter."""

WRITER_SYSTEM = "Write one SQLite query that answers the question. Reply with the query only."
REWRITER_SYSTEM = "Fix the SQLite query. Reply with the corrected query only."
CHECKER_SYSTEM = "You check SQLite queries. Answer yes or no."
CHECKER_QUESTION = "Is the query wrong?"
"""Asked this way, not "is it right?": the untrained model answers "no" to nearly any yes/no question, so asked
whether the query is right it objected to 98-100% of them and the rewriter replaced correct drafts."""
DEMO_SCHEMA = format_schema(([("pets", ["name", "kind", "age", "weight", "home"]),
                               ("homes", ["name", "street", "rent"])], [("pets", "home", "homes", "name")]))
"""The schema of the worked examples: two tables that no split uses."""
SHOT_POOL = [
    ("How many pets are there?", "SELECT COUNT(*) FROM pets"),
    ("How many pets are dogs?", "SELECT COUNT(*) FROM pets WHERE kind = 'dog'"),
    ("Which pets are cats?", "SELECT name FROM pets WHERE kind = 'cat'"),
    ("Which pet has the highest weight?", "SELECT name FROM pets ORDER BY weight DESC LIMIT 1"),
    ("Which pet has the lowest age?", "SELECT name FROM pets ORDER BY age ASC LIMIT 1"),
    ("Which pets have a weight above 12?", "SELECT name FROM pets WHERE weight > 12"),
    ("What is the average age of the pets?", "SELECT AVG(age) FROM pets"),
    ("What is the highest weight of any pet?", "SELECT MAX(weight) FROM pets"),
    ("What is the total weight of the pets that are dogs?", "SELECT SUM(weight) FROM pets WHERE kind = 'dog'"),
]
"""Worked examples on one table: (question, query)."""
JOIN_SHOT_POOL = [
    ("Which pets live in a home with a rent above 40?",
     "SELECT pets.name FROM pets JOIN homes ON pets.home = homes.name WHERE homes.rent > 40"),
    ("How many pets live in a home on Elm street?",
     "SELECT COUNT(*) FROM pets JOIN homes ON pets.home = homes.name WHERE homes.street = 'Elm'"),
    ("What is the total weight of the pets that live in a home on Oak street?",
     "SELECT SUM(pets.weight) FROM pets JOIN homes ON pets.home = homes.name WHERE homes.street = 'Oak'"),
]
"""Worked examples that join the two tables through their key. A database with a foreign key gets the closest
example of each pool, the closer one last (the small model follows the latest example it saw); one without, the
closest one-table example alone (example selection by wording, as DAIL-SQL does)."""
SHOTS_SHOWN = 1
"""Examples of each pool shown."""
_WORD = re.compile(r"[a-z]+")
REWRITE_SHOT = ("How many pets are dogs?", "SELECT name FROM pets WHERE kind = 'dog'",
                "its result (Rex; Bo) does not answer the question", "SELECT COUNT(*) FROM pets WHERE kind = 'dog'")
"""A worked fix for the rewriter: (question, wrong query, objection, fixed query)."""

_FENCE = re.compile(r"```(?:sql)?", re.IGNORECASE)
_SELECT = re.compile(r"\b(SELECT|WITH)\b", re.IGNORECASE)


class State(TypedDict, total=False):
    db: str
    question: str
    query: str
    objection: str
    """Empty when the checker accepted the query."""
    rewrites: int


def extract_sql(text: str) -> str:
    """The query in a reply: from its first SELECT (or WITH) to the first ``;`` or blank line; "" if none."""
    text = _FENCE.sub("\n", text)
    found = _SELECT.search(text)
    if not found:
        return ""
    query = text[found.start():]
    query = query.split(";")[0].split("\n\n")[0]
    return " ".join(query.split())


async def execute(db: str, query: str) -> tuple[list[tuple] | None, str]:
    """(rows, "") or (None, the error in a line), the query run in the sandbox in a thread: a slow one never
    holds the event loop, where the worker's heartbeats and the other rollouts run."""
    if not query:
        return None, "there is no SQL query in the reply"
    return await query_rows(database(db), query)


def normalise(rows: list[tuple]) -> Counter:
    return Counter(tuple(round(v, 4) if isinstance(v, float) else v for v in row) for row in rows)


async def execution_match(db: str, query: str, gold: str) -> bool:
    """Whether ``query`` returns ``gold``'s rows; a gold query that fails raises (the task is wrong, not the model)."""
    rows, error = await execute(db, query)
    return not error and normalise(rows) == normalise(await asyncio.to_thread(run_query, db, gold))


def show_rows(rows: list[tuple]) -> str:
    shown = "; ".join(", ".join(str(v) for v in row) for row in rows[:RESULT_ROWS_SHOWN])
    more = f" (and {len(rows) - RESULT_ROWS_SHOWN} more rows)" if len(rows) > RESULT_ROWS_SHOWN else ""
    return (shown or "no rows") + more


def closest_shots(question: str, pool: list[tuple[str, str]] = SHOT_POOL, k: int = SHOTS_SHOWN
                  ) -> list[tuple[str, str]]:
    """The ``k`` examples whose words overlap the question's most (Jaccard), the closest last."""
    return sorted(pool, key=lambda shot: _overlap(question, shot[0]))[-k:]


def _overlap(question: str, other: str) -> float:
    words, others = set(_WORD.findall(question.lower())), set(_WORD.findall(other.lower()))
    return len(words & others) / len(words | others)


Shots = list[tuple[str, str]] | int
"""Worked examples: a fixed list, or how many of the closest of each pool to show."""


def writer_shots(db: str, question: str, shots: Shots = SHOTS_SHOWN) -> list[tuple[str, str]]:
    """The worked examples the writer sees for ``question`` (see ``JOIN_SHOT_POOL``)."""
    if not isinstance(shots, int):
        return shots
    chosen = closest_shots(question, k=shots)
    _, keys = schema(db)
    if keys:
        chosen += closest_shots(question, JOIN_SHOT_POOL, shots)
    return sorted(chosen, key=lambda shot: _overlap(question, shot[0]))


def writer_messages(db: str, question: str, shots: Shots = SHOTS_SHOWN) -> list[BaseMessage]:
    messages: list[BaseMessage] = [SystemMessage(WRITER_SYSTEM)]
    for q, sql in writer_shots(db, question, shots):
        messages += [HumanMessage(f"{DEMO_SCHEMA}\nQuestion: {q}"), AIMessage(sql)]
    return [*messages, HumanMessage(f"{schema_text(db)}\nQuestion: {question}")]


def rewriter_messages(db: str, question: str, query: str, objection: str) -> list[BaseMessage]:
    q, wrong, why, fixed = REWRITE_SHOT
    return [SystemMessage(REWRITER_SYSTEM),
            HumanMessage(f"{DEMO_SCHEMA}\nQuestion: {q}\nQuery: {wrong}\nProblem: {why}"), AIMessage(fixed),
            HumanMessage(f"{schema_text(db)}\nQuestion: {question}\nQuery: {query or '(none)'}\n"
                         f"Problem: {objection}")]


def checker_messages(db: str, question: str, query: str, rows: list[tuple]) -> list[BaseMessage]:
    return [SystemMessage(CHECKER_SYSTEM),
            HumanMessage(f"{schema_text(db)}\nQuestion: {question}\nQuery: {query}\n"
                         f"Result: {show_rows(rows)}\n{CHECKER_QUESTION}")]


@dataclass
class Attempt:
    """One rollout's outcome, with what ``measure_baseline.py`` reports about it."""

    reward: float
    query: str
    draft_correct: bool
    """Whether the writer's first draft was already right."""
    rewrites: int
    checker_calls: int
    checker_accepts: int
    llm_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replies: list[str] = field(default_factory=list)


def build_graph(llm: lit.LLM, attempt: Attempt | None = None, shots: Shots = SHOTS_SHOWN):
    """The compiled graph for one rollout's model; ``attempt`` collects statistics when given."""
    model = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key or "unused",
                       temperature=llm.temperature, max_tokens=llm.max_tokens, max_retries=0)
    judge = ChatOpenAI(model=llm.model, base_url=llm.base_url, api_key=llm.api_key or "unused",
                       temperature=llm.temperature, max_tokens=CHECKER_MAX_TOKENS, max_retries=0)

    async def ask(chat: ChatOpenAI, messages: list[BaseMessage]) -> str:
        reply = await chat.ainvoke(messages)
        text = reply.content if isinstance(reply.content, str) else str(reply.content)
        if attempt is not None:
            usage = reply.usage_metadata or {}
            attempt.llm_calls += 1
            attempt.prompt_tokens += usage.get("input_tokens", 0)
            attempt.completion_tokens += usage.get("output_tokens", 0)
            attempt.replies.append(text)
        return text

    async def writer(state: State) -> State:
        text = await ask(model, writer_messages(state["db"], state["question"], shots))
        return {"query": extract_sql(text), "rewrites": 0}

    async def checker(state: State) -> State:
        rows, error = await execute(state["db"], state["query"])
        if error:
            return {"objection": f"it fails with {error}"}
        if not rows:
            return {"objection": "it returns no rows"}
        text = await ask(judge, checker_messages(state["db"], state["question"], state["query"], rows))
        accepted = not text.strip().lower().startswith("yes")
        if attempt is not None:
            attempt.checker_calls += 1
            attempt.checker_accepts += accepted
        return {"objection": "" if accepted else f"its result ({show_rows(rows)}) does not answer the question"}

    async def rewriter(state: State) -> State:
        text = await ask(model, rewriter_messages(state["db"], state["question"], state["query"],
                                                  state["objection"]))
        return {"query": extract_sql(text), "rewrites": state["rewrites"] + 1}

    def after_check(state: State) -> str:
        return "rewriter" if state["objection"] and state["rewrites"] < MAX_REWRITES else END

    def after_rewrite(state: State) -> str:
        return "checker" if state["rewrites"] < MAX_REWRITES else END

    graph = StateGraph(State)
    graph.add_node("writer", writer)
    graph.add_node("checker", checker)
    graph.add_node("rewriter", rewriter)
    graph.set_entry_point("writer")
    graph.add_edge("writer", "checker")
    graph.add_conditional_edges("checker", after_check, ["rewriter", END])
    graph.add_conditional_edges("rewriter", after_rewrite, ["checker", END])
    return graph.compile()


async def solve(task: dict, llm: lit.LLM, shots: Shots = SHOTS_SHOWN) -> Attempt:
    """Run the graph once on ``task`` and grade the final query (``shots`` for ``measure_baseline.py``)."""
    attempt = Attempt(reward=0.0, query="", draft_correct=False, rewrites=0, checker_calls=0, checker_accepts=0)
    state = await build_graph(llm, attempt, shots).ainvoke({"db": task["db"], "question": task["question"]})
    attempt.query = state["query"]
    attempt.rewrites = state["rewrites"]
    attempt.reward = float(await execution_match(task["db"], state["query"], task["gold"]))
    draft = extract_sql(attempt.replies[0]) if attempt.replies else ""
    attempt.draft_correct = await execution_match(task["db"], draft, task["gold"])
    return attempt


@lit.trace(agent="sql")
async def sql_agent(task: dict, llm: lit.LLM) -> float:
    """One rollout: 1.0 if the final query returns the gold query's rows, else 0.0."""
    state = await build_graph(llm).ainvoke({"db": task["db"], "question": task["question"]})
    return float(await execution_match(task["db"], state["query"], task["gold"]))
