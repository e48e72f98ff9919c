"""The SQL example: its databases and questions, the grading, and the real LangGraph agent traced by lit against a
vLLM-shaped local server (tests/fake_llm.py scripts the model's replies; the graph, the SQLite databases, the ZeroMQ
delivery, the trainer's collector, store and episode builder are real)."""

import asyncio
import sqlite3

import pytest

from examples.sql.agent import (
    JOIN_SHOT_POOL,
    MAX_REWRITES,
    closest_shots,
    execution_match,
    extract_sql,
    sql_agent,
    writer_messages,
)
from examples.sql.databases import (
    DOMAINS,
    HELD_OUT_DOMAINS,
    TRAIN_DOMAINS,
    columns,
    lookup_columns,
    lookup_rows,
    rows_of,
    run_query,
    schema_text,
)
from examples.sql.tasks import FORMS, JOIN_FORMS, make_tasks
from lit_sdk import semconv as sc
from lit_trainer.intake.episodes import Episode, build_episode


def vocabulary(table: str) -> set[str]:
    """Every table, column and value name of a domain."""
    domain = DOMAINS[table]
    words = {table, domain.lookup.table, *(c for c, _ in columns(domain) + lookup_columns(domain))}
    words |= {v for c in domain.categories for v in c.values} | set(domain.names) | set(domain.lookup.texts)
    return words - {"name"}


def test_held_out_databases_share_no_table_column_or_value_with_training():
    train_words = set().union(*(vocabulary(t) for t in TRAIN_DOMAINS))
    for table in HELD_OUT_DOMAINS:
        assert not vocabulary(table) & train_words, table
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    assert {t["db"] for t in train} == set(TRAIN_DOMAINS) and {t["db"] for t in val} == set(HELD_OUT_DOMAINS)
    for task in val:  # no validation question mentions anything of a training database
        assert not set(task["question"].rstrip("?").split()) & (train_words - {"age", "price", "year"}), task


def test_tasks_are_deterministic_distinct_and_every_gold_query_runs():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    assert train == make_tasks("train", 2000) and val == make_tasks("validation", 64)
    assert len(val) == 64 and len(train) > 200
    assert len({(t["db"], t["question"]) for t in train}) == len(train)
    assert {t["kind"] for t in val} == {f.__name__ for f in FORMS}
    # sft.source = "references": the writer answers the gold query; held-out tasks teach nothing
    assert all(t["reference"] == {"writer": t["gold"]} for t in train)
    assert not any("reference" in t for t in val)
    for task in train + val:
        assert run_query(task["db"], task["gold"]), task  # every gold answer is a non-empty result


def test_each_database_has_a_lookup_table_behind_a_foreign_key_and_join_questions_need_it():
    assert schema_text("students") == ("Table students: name, city, age, score\n"
                                       "Table cities: name, country, population\n"
                                       "Key: students.city = cities.name")
    for domain in DOMAINS.values():
        lookups = lookup_rows(domain)
        assert [r["name"] for r in lookups] == list(domain.categories[0].values)
        assert len({r[domain.lookup.text] for r in lookups}) == 4
        assert len({r[domain.lookup.number.column] for r in lookups}) == 4
    joins = [t for t in make_tasks("validation", 64) if t["kind"] in {f.__name__ for f in JOIN_FORMS}]
    assert len(joins) >= 16
    for task in joins:  # the main table alone cannot answer: the condition is on the lookup table's columns
        lookup = DOMAINS[task["db"]].lookup.table
        assert f"JOIN {lookup} ON" in task["gold"] and f"WHERE {lookup}." in task["gold"], task
        with pytest.raises(sqlite3.Error, match="no such column"):
            run_query(task["db"], task["gold"].split(" JOIN ")[0] + " WHERE " + task["gold"].split(" WHERE ")[1])


def test_the_writer_sees_a_join_example_on_a_database_with_a_key():
    question = "How many movies have a rating with viewers above 30?"
    messages = writer_messages("movies", question)
    shown = [m.content for m in messages[2::2]]  # the worked examples' answers
    assert len(shown) == 2 and sum(" JOIN homes ON " in sql for sql in shown) == 1
    assert messages[-1].content == f"{schema_text('movies')}\nQuestion: {question}"
    assert {sql for _, sql in JOIN_SHOT_POOL} & set(shown)


def test_numbers_are_distinct_so_extremes_have_one_answer():
    for domain in DOMAINS.values():
        rows = rows_of(domain)
        assert len(rows) == 16 and len({r["name"] for r in rows}) == 16
        for number in domain.numbers:
            if number.high - number.low >= 16:
                assert len({r[number.column] for r in rows}) == 16, (domain.table, number.column)


def test_queries_run_read_only():
    with pytest.raises(sqlite3.Error, match="refused: the query may only read, and changing the schema is not allowed"):
        run_query("students", "DROP TABLE students")
    assert run_query("students", "SELECT COUNT(*) FROM students") == [(16,)]
    with pytest.raises(sqlite3.Error, match="interrupted"):  # a runaway cross join is cut short
        run_query("students", "SELECT COUNT(*) FROM students a, students b, students c, students d, students e")


@pytest.mark.parametrize(("reply", "query"), [
    ("SELECT COUNT(*) FROM pets;", "SELECT COUNT(*) FROM pets"),
    ("```sql\nSELECT name\nFROM pets\n```\nThis lists them.", "SELECT name FROM pets"),
    ("Here it is: select max(age) from pets; DROP TABLE pets;", "select max(age) from pets"),
    ("I do not know.", ""),
])
def test_extract_sql_takes_the_first_query(reply, query):
    assert extract_sql(reply) == query


def test_execution_match_ignores_row_order_and_float_noise():
    def match(query: str, gold: str = "SELECT name FROM students WHERE age > 20") -> bool:
        return asyncio.run(execution_match("students", query, gold))

    assert match("SELECT name FROM students WHERE age > 20 ORDER BY name DESC")
    assert match("SELECT AVG(score) * 1.0 FROM students", "SELECT AVG(score) FROM students")
    assert not match("SELECT name FROM students")
    assert not match("SELECT nonsense")
    assert not match("")


def test_the_closest_worked_example_matches_the_question_form():
    [(question, _)] = closest_shots("How many movies are rated R?")
    assert question == "How many pets are dogs?"
    [(question, _)] = closest_shots("Which hotel has the lowest rooms?")
    assert question == "Which pet has the lowest age?"


TASK = {"id": "t1", "db": "movies", "question": "How many movies are rated R?",
        "gold": "SELECT COUNT(*) FROM movies WHERE rating = 'R'"}


def test_a_rejected_draft_is_rewritten_and_only_writer_and_rewriter_calls_are_trained(traced_rollout):
    # writer drafts a query that runs but is wrong; checker objects ("yes, it is wrong"); rewriter fixes it.
    script = ["SELECT name FROM movies WHERE rating = 'R'", "Yes.", "SELECT COUNT(*) FROM movies WHERE rating = 'R'"]
    reward, spans, llm = traced_rollout(sql_agent, TASK, script)
    assert reward == 1.0 and len(llm.requests) == 3 == 1 + 2 * MAX_REWRITES
    llm_spans = sorted((s for s in spans if s.name == sc.LLM_SPAN), key=lambda s: s.start_ns)
    assert [s.attributes[sc.AGENT_NAME] for s in llm_spans] == ["writer", "checker", "rewriter"]

    everything = build_episode(spans)
    assert isinstance(everything, Episode) and [t.agent for t in everything.transitions] == [
        "writer", "checker", "rewriter"]
    trained = build_episode(spans, agents={"writer", "rewriter"})
    assert isinstance(trained, Episode) and trained.final_reward == 1.0
    assert [t.agent for t in trained.transitions] == ["writer", "rewriter"]
    assert [t.response_ids for t in trained.transitions] == [
        llm.responses[i]["choices"][0]["token_ids"] for i in (0, 2)]
    # The rewriter saw the checker's objection and the draft's rows.
    assert "Brazil" in llm.requests[2]["messages"][-1]["content"]


def test_an_accepted_draft_ends_the_graph(traced_rollout):
    reward, spans, llm = traced_rollout(sql_agent, TASK, ["SELECT COUNT(*) FROM movies", "No."])
    assert reward == 0.0 and len(llm.requests) == 2  # writer, checker; no rewrite
    trained = build_episode(spans, agents={"writer", "rewriter"})
    assert isinstance(trained, Episode) and [t.agent for t in trained.transitions] == ["writer"]


def test_a_failing_query_goes_to_the_rewriter_without_asking_the_checker(traced_rollout):
    script = ["SELECT title FROM nowhere", "SELECT COUNT(*) FROM movies WHERE rating = 'R'"]
    reward, spans, llm = traced_rollout(sql_agent, TASK, script)
    assert reward == 1.0 and len(llm.requests) == 2
    assert "no such table" in llm.requests[1]["messages"][-1]["content"]
    trained = build_episode(spans, agents={"writer", "rewriter"})
    assert [t.agent for t in trained.transitions] == ["writer", "rewriter"]
