"""The calc example: its task generator, its calculator, and the real AutoGen agent against a vLLM-shaped local
server (tests/fake_llm.py scripts the model's reply; everything else is real)."""

import asyncio
import json
import re
from collections import Counter

import pytest
from fake_llm import FakeLLM

import lit_sdk as lit
from examples.calc.agent import (
    SHOTS,
    calc_agent,
    calculator,
    evaluate,
    final_number,
    tasks_with_references,
    tool_call_text,
    with_numbers,
)
from examples.calc.tasks import (
    HELD_OUT,
    KINDS,
    NAMES,
    TEMPLATES,
    THINGS,
    TWO_STEP,
    TWO_STEP_EVERY,
    make_tasks,
    split_of,
)


def test_tasks_are_deterministic_integral_and_the_splits_are_disjoint():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    assert train == make_tasks("train", 2000) and val == make_tasks("validation", 64)
    assert val[:16] == make_tasks("validation", 16)  # a shorter list is a prefix
    assert len({t["id"] for t in train}) == 2000 and len(val) == 64
    assert len({t["question"] for t in train}) == 2000
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert all(isinstance(t["answer"], int) and t["answer"] >= 0 for t in train + val)


NUMBER = re.compile(r"\d+")


def numbers_of(question: str) -> tuple[int, ...]:
    """The question's numbers, sorted."""
    return tuple(sorted(int(x) for x in NUMBER.findall(question)))


def numbers_signature(task: dict) -> tuple[str, tuple[int, ...]]:
    """(operation, the question's numbers sorted), read from the text: equal for two problems that differ only in
    the name, the object, the order of the numbers or the wording."""
    return task["operation"], numbers_of(task["question"])


def skeleton(question: str) -> str:
    """The wording alone: numbers, names and objects blanked."""
    text = NUMBER.sub("#", question)
    for word in NAMES + THINGS:
        text = re.sub(rf"\b{word}\b", "_", text)
    return text


def test_no_validation_problem_is_a_training_problem_with_another_name_or_object():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    train_signatures = {numbers_signature(t) for t in train}
    assert not [t["question"] for t in val if numbers_signature(t) in train_signatures]
    for kind in ("in_template", "out_of_template"):  # nor one of validation's own, within a kind
        signatures = [numbers_signature(t) for t in val if t["kind"] == kind]
        assert len(set(signatures)) == len(signatures)


def test_out_of_template_wordings_never_occur_in_train():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    train_wordings = {skeleton(t["question"]) for t in train}
    assert len(train_wordings) == len(TEMPLATES)  # the blanking leaves one wording per template
    held_out = {skeleton(t["question"]) for t in val if t["kind"] == "out_of_template"}
    in_template = {skeleton(t["question"]) for t in val if t["kind"] == "in_template"}
    assert len(held_out) == len(HELD_OUT) and not held_out & train_wordings
    assert in_template <= train_wordings


def test_no_worked_example_is_a_validation_problem():
    """The agent's worked examples are in every prompt: none may be a validation problem with other names or
    objects, which would hand the model its answer."""
    shots = {numbers_of(question) for question, _ in SHOTS}
    assert not shots & {numbers_of(t["question"]) for t in make_tasks("validation", 64)}


ONE_STEP_OPERATIONS = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}


def test_one_step_worked_examples_are_training_problems_and_two_step_ones_no_problem_at_all():
    """A one-step worked example is a problem training shows anyway; a two-step one has a number its form never
    draws, so it is neither a training nor a validation problem."""
    problems = {numbers_signature(t) for t in make_tasks("train", 2000) + make_tasks("validation", 64)}
    operators = {question: re.findall(r"[-+*/]", expression) for question, expression in SHOTS}
    one_step = {q: ONE_STEP_OPERATIONS[ops[0]] for q, ops in operators.items() if len(ops) == 1}
    assert set(one_step.values()) == {"multiply", "divide"}
    for question, operation in one_step.items():  # split_of reads only the numbers, not their field names
        assert split_of(operation, dict(zip("ab", numbers_of(question), strict=True))) == "train", question
    two_step = [q for q in operators if q not in one_step]
    assert len(two_step) == 5
    assert not {(op.__name__, numbers_of(q)) for q in two_step for op in TWO_STEP} & problems


def word_runs(wording: str, n: int = 6) -> set[tuple[str, ...]]:
    text = skeleton(wording.format(name="Ana", thing="apples", a=1, b=2, c=3, total=4))
    words = re.findall(r"[a-z_#]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_held_out_wordings_share_no_six_word_run_with_a_training_wording():
    """Not near-duplicates either: a held-out wording has no run of six words (numbers, names and objects blanked)
    that a training wording has."""
    train = set().union(*(word_runs(w) for w in TEMPLATES.values()))
    shared = {op: word_runs(w) & train for op, w in HELD_OUT.items()}
    assert not any(shared.values()), shared


def test_kinds_alternate_by_blocks_and_keep_three_one_step_to_one_two_step():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    assert {t["kind"] for t in train} == {"in_template"}
    two_step = {op.__name__ for op in TWO_STEP}
    for kind in ("in_template", "out_of_template"):
        tasks = [(int(t["id"].split("-")[1]), t) for t in val if t["kind"] == kind]
        assert len(tasks) == 32
        assert sum(t["operation"] in two_step for _, t in tasks) == 8
        # measure_baseline.py tells two-step tasks by their index
        assert all((t["operation"] in two_step) == (i % TWO_STEP_EVERY == TWO_STEP_EVERY - 1) for i, t in tasks)
    assert [t["kind"] for t in val[:12]] == ["in_template"] * 4 + ["out_of_template"] * 4 + ["in_template"] * 4
    mix = {kind: Counter(t["operation"] for t in val if t["kind"] == kind) for kind in KINDS}
    assert mix["in_template"] == mix["out_of_template"]  # the kinds differ in wording only


@pytest.mark.parametrize(("expression", "value"), [("3*12", 36), ("20+15-8", 27), ("(90)/6", 15), ("-4+2", -2),
                                                   ("7 x 3", 21)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value
    assert calculator(expression) == str(value)


@pytest.mark.parametrize("expression", ["__import__('os')", "2**100", "abs(3)", "1/0", "x", "1" * 80, "3 +"])
def test_calculator_refuses_everything_else(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_final_number_is_the_last_number():
    assert final_number("12 and then 7.5") == 7.5 and final_number("no number") is None


def run(task, base_url):
    return asyncio.run(calc_agent(task, lit.LLM(base_url, "policy", temperature=0.0, max_tokens=48)))


def test_the_question_reaches_the_model_with_its_numbers_listed():
    assert with_numbers("Ana has 20 coins, gets 15 more, then spends 8. How many?") == (
        "Ana has 20 coins, gets 15 more, then spends 8. How many?\nNumbers: 20, 15, 8")
    assert with_numbers("How many?") == "How many?\nNumbers: "


@pytest.mark.parametrize(("tool_args", "answer", "reward"), [
    ({"expression": "3*12"}, 36, 1.0),
    ({"expression": "3*12"}, 35, 0.0),
    ({"expression": "__import__('os').system('true')"}, 0, 0.0),  # a refused expression is a wrong answer
])
def test_the_agent_grades_the_tool_result(tool_args, answer, reward):
    question = "Tom has 3 bags with 12 apples each. How many?"
    with FakeLLM(tool_args=tool_args) as llm:
        got = run({"id": "t", "question": question, "answer": answer}, llm.base_url)
        assert got == reward
        [request] = llm.requests  # one LLM call per rollout, with the calculator offered
        assert [t["function"]["name"] for t in request["tools"]] == ["calculator"]
        messages = request["messages"]  # the question and every worked example's, each with its numbers listed
        assert messages[-1]["content"] == f"{question}\nNumbers: 3, 12"
        assert sum(m["role"] == "user" and "\nNumbers: " in m["content"] for m in messages) == len(SHOTS) + 1


def test_an_unreachable_server_raises_so_the_trainer_retries():
    with pytest.raises(Exception, match="(?i)connect"):
        run({"id": "t", "question": "1+1?", "answer": 2}, "http://127.0.0.1:9/v1")


def test_every_tasks_reference_is_the_calculator_call_that_solves_it():
    """``rollouts.guidance``'s references (``tasks_with_references``): each task's expression has the task's answer,
    uses each of its numbers once, and its reference is the calculator call of it as the model writes one; run as
    the agent's tool call, a sample of them (one of each operation) earns the reward."""
    tasks = tasks_with_references("train", 400) + tasks_with_references("validation", 64)
    by_operation = {}
    for task in tasks:
        assert evaluate(task["expression"]) == task["answer"], task
        assert sorted(re.findall(r"\d+", task["expression"])) == sorted(re.findall(r"\d+", task["question"])), task
        assert task["reference"] == tool_call_text(task["expression"])
        by_operation.setdefault(task["operation"], task)
    assert len(by_operation) == 8
    for task in by_operation.values():
        call = json.loads(task["reference"].split("\n")[1])  # as vLLM's tool parser reads the model's text
        assert call["name"] == "calculator"
        with FakeLLM(tool_args=call["arguments"]) as llm:
            assert run(task, llm.base_url) == 1.0, task
