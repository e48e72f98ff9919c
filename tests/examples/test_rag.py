"""The RAG example: its generated worlds and questions, BM25 search, the grading, and the real OpenAI Agents SDK
agent traced by lit against a vLLM-shaped local server (tests/fake_llm.py scripts the model's replies; the SDK, the
search tool, the ZeroMQ delivery, the trainer's collector, store and episode builder are real)."""

import re

import pytest

from examples.rag.agent import AGENT_NAME, MAX_SEARCHES, USEFUL_RETRIEVAL, f1, grade, max_searches, rag_agent
from examples.rag.corpus import encyclopedia, make_tasks, search, worlds
from lit_sdk import semconv as sc
from lit_trainer.intake.episodes import Episode, build_episode

NAME = re.compile(r"[A-Z][a-z]+")


@pytest.fixture(autouse=True)
def _agents_sdk_stays_on_this_machine():
    import agents

    agents.set_trace_processors([])  # the SDK uploads traces to OpenAI by default; lit.instrument adds its own


def names_in(tasks: list[dict]) -> set[str]:
    return {w for t in tasks for w in NAME.findall(t["question"] + " " + t["answer"])} - {"In"}


def test_validation_questions_name_nothing_that_training_names():
    train, val = make_tasks("train", 2000), make_tasks("validation", 2000)
    assert len(train) == 600 and len(val) == 240
    assert not names_in(train) & names_in(val)
    assert train == make_tasks("train", 2000) and make_tasks("validation", 64) == val[:64]
    assert {t["kind"] for t in val[:64]} == {"birth_country", "founder_city"}
    assert all(p in encyclopedia() for t in train + val for p in t["supporting"])


def test_every_question_needs_two_retrievals():
    for task in make_tasks("train", 100):
        first, second = task["supporting"]
        assert task["answer"] not in task["question"] and task["answer"] not in first
        assert task["answer"] in second


def test_bm25_finds_the_first_hop_for_the_questions_entity():
    found = 0
    tasks = make_tasks("validation", 240)
    for task in tasks:
        entity = task["question"].removeprefix("In which country was ").removeprefix(
            "In which city was the founder of ").removesuffix(" born?")
        found += task["supporting"][0] in search(entity)
    # 90% measured: a founder's name is in three passages (birth, job, company) and a search returns two.
    assert found / len(tasks) >= 0.85, found
    assert search("") == [] and search("zzzz qqqq") == []


@pytest.mark.parametrize(("prediction", "gold", "score"), [
    ("Lomania", "Lomania", 1.0), ("the lomania.", "Lomania", 1.0), ("Lomania city", "Lomania", 2 / 3),
    ("Tesbury", "Lomania", 0.0), ("", "Lomania", 0.0)])
def test_f1_is_squads_token_f1(prediction, gold, score):
    assert f1(prediction, gold) == pytest.approx(score)


@pytest.mark.parametrize(("final", "reward"), [
    ("Answer: Lomania", 1.0),                   # right, in format
    ("Lomania", 0.9),                           # right, no format
    ("Answer: Lomania city", 0.9 * 2 / 3 + 0.1),
    ("Answer: Tesbury", 0.1),                   # wrong, in format
    ('Answer: <tool_call>\n{"name": "search"}', 0.0),
    ("", 0.0)])
def test_reward_is_0_9_f1_plus_0_1_format(final, reward):
    assert grade(final, "Lomania")[0] == pytest.approx(reward)


def test_one_rollout_is_three_calls_of_the_researcher_with_a_reward_per_useful_search(traced_rollout):
    world = worlds()["validation"]
    person = next(iter(world.born))
    city = world.born[person]
    country = world.country[city]
    task = {"id": "q1", "question": f"In which country was {person} born?", "answer": country,
            "supporting": [f"{person} was born in {city}.", f"{city} is a city in {country}."]}
    script = [("search", {"query": person}), ("search", {"query": city}), f"Answer: {country}"]
    reward, spans, llm = traced_rollout(rag_agent, task, script)

    assert reward == 1.0 and len(llm.requests) == 3
    assert [bool(r.get("tools")) for r in llm.requests] == [True, True, False]  # the answer call has no tool
    assert task["supporting"][0] in llm.requests[1]["messages"][-1]["content"]  # the notes carry what was found
    assert task["supporting"][1] in llm.requests[2]["messages"][-1]["content"]
    calls = sorted((s for s in spans if s.name == sc.LLM_SPAN), key=lambda s: s.start_ns)
    assert [s.attributes[sc.AGENT_NAME] for s in calls] == [AGENT_NAME] * 3

    episode = build_episode(spans, agents={AGENT_NAME})
    assert isinstance(episode, Episode) and episode.final_reward == 1.0
    assert [t.index for t in episode.transitions] == [0, 1, 2]
    assert [t.response_ids for t in episode.transitions] == [r["choices"][0]["token_ids"] for r in llm.responses]
    # Each search found a supporting passage new to the notes: its call earns the intermediate reward.
    assert [t.reward for t in episode.transitions] == [USEFUL_RETRIEVAL, USEFUL_RETRIEVAL, None]


def test_a_search_that_finds_nothing_new_earns_nothing_and_a_wrong_answer_earns_the_format(traced_rollout):
    task = make_tasks("validation", 1)[0]
    script = [("search", {"query": "zzzz"}), ("search", {"query": "zzzz"}), "Answer: Nowhere"]
    reward, spans, _ = traced_rollout(rag_agent, task, script)
    assert reward == pytest.approx(0.1)
    episode = build_episode(spans, agents={AGENT_NAME})
    assert [t.reward for t in episode.transitions] == [None, None, None]


def test_search_reads_a_corpus_of_your_own_from_jsonl_or_a_folder(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"title": "Ada Lovelace", "text": "She wrote the first program for the Analytical Engine."}\n'
                    '\n{"text": "Charles Babbage designed the Analytical Engine in London."}\n'
                    '{"text": "The Jacquard loom read punched cards."}\n')
    found = search("Who designed the Analytical Engine", corpus=str(docs))
    assert found[0] == "Charles Babbage designed the Analytical Engine in London." and len(found) == 2
    assert search("Lovelace", corpus=str(docs)) == [
        "Ada Lovelace: She wrote the first program for the Analytical Engine."]
    assert search("Lovelace") == []  # the generated encyclopedia is untouched
    folder = tmp_path / "notes"
    (folder / "deep").mkdir(parents=True)
    (folder / "deep" / "loom.md").write_text("# Looms\n\nThe Jacquard loom\nread punched cards.\n\n\n")
    (folder / "skip.csv").write_text("Jacquard,loom\n")
    assert search("Jacquard punched", corpus=str(folder)) == ["The Jacquard loom read punched cards."]


@pytest.mark.parametrize("content, words", [
    (None, "does not exist"), ("", "holds no passage"), ('{"text": "fine"}\n["no", "map"]\n', "line 2"),
    ('{"body": "no text key"}\n', "line 1"), ('{"text": null}\n', r"line 1: \"text\" .* must be text, got NoneType"),
    (b'{"text": "Caf\xe9"}\n', r"line 1: not UTF-8 \(byte 0xe9\)")])
def test_a_corpus_that_cannot_be_read_is_named_with_what_is_wrong(tmp_path, content, words):
    path = tmp_path / "corpus.jsonl"
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=words):
        search("anything", corpus=str(path))


def test_a_task_that_names_a_corpus_is_answered_from_it(traced_rollout, tmp_path):
    docs = tmp_path / "company.jsonl"
    docs.write_text('{"text": "Orbital Pies was founded by Dana Ruiz."}\n{"text": "Dana Ruiz was born in Quito."}\n')
    task = {"id": "mine-1", "question": "In which city was the founder of Orbital Pies born?", "answer": "Quito",
            "corpus": str(docs), "supporting": ["Dana Ruiz was born in Quito."]}
    script = [("search", {"query": "Orbital Pies"}), ("search", {"query": "Dana Ruiz"}), "Answer: Quito"]
    reward, spans, llm = traced_rollout(rag_agent, task, script)
    assert reward == 1.0
    assert "Orbital Pies was founded by Dana Ruiz." in llm.requests[1]["messages"][-1]["content"]
    assert "Dana Ruiz was born in Quito." in llm.requests[2]["messages"][-1]["content"]
    episode = build_episode(spans, agents={AGENT_NAME})
    assert [t.reward for t in episode.transitions] == [None, USEFUL_RETRIEVAL, None]  # the supporting one, found


def test_the_agent_may_answer_before_its_last_search(traced_rollout):
    """The number of searches is the agent's choice up to the limit: an answer after one search ends the rollout."""
    task = make_tasks("validation", 1)[0]
    script = [("search", {"query": "anything"}), f"Answer: {task['answer']}"]
    reward, spans, llm = traced_rollout(rag_agent, task, script)
    assert reward == 1.0 and len(llm.requests) == 2
    assert [bool(r.get("tools")) for r in llm.requests] == [True, True]  # it could have searched again
    episode = build_episode(spans, agents={AGENT_NAME})
    assert isinstance(episode, Episode) and len(episode.transitions) == 2 and episode.final_reward == 1.0


def test_a_task_may_allow_more_searches(traced_rollout):
    task = {**make_tasks("validation", 1)[0], "max_searches": 3}
    script = [("search", {"query": "a"}), ("search", {"query": "b"}), ("search", {"query": "c"}),
              f"Answer: {task['answer']}"]
    reward, spans, llm = traced_rollout(rag_agent, task, script)
    assert reward == 1.0 and [bool(r.get("tools")) for r in llm.requests] == [True, True, True, False]
    assert len(build_episode(spans, agents={AGENT_NAME}).transitions) == 4


@pytest.mark.parametrize("value", [0, 11, 2.5, "3", True])
def test_a_wrong_max_searches_is_named(value):
    with pytest.raises(ValueError, match=f"max_searches must be a whole number from 1 to 10, got {value!r}"):
        max_searches({"max_searches": value})
    assert max_searches({}) == MAX_SEARCHES == 2
