"""The calc example: its task generator, its calculator, and the real AutoGen agent against a vLLM-shaped local
server (tests/fake_llm.py scripts the model's reply; everything else is real)."""

import asyncio

import pytest
from fake_llm import FakeLLM

import lit_sdk as lit
from examples.calc.agent import calc_agent, calculator, evaluate, final_number
from examples.calc.tasks import make_tasks


def test_tasks_are_deterministic_integral_and_the_splits_are_disjoint():
    train, val = make_tasks("train", 2000), make_tasks("validation", 64)
    assert train == make_tasks("train", 2000) and val == make_tasks("validation", 64)
    assert len({t["id"] for t in train}) == 2000 and len(val) == 64
    assert not {t["question"] for t in train} & {t["question"] for t in val}
    assert all(isinstance(t["answer"], int) and t["answer"] >= 0 for t in train + val)


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


@pytest.mark.parametrize(("tool_args", "answer", "reward"), [
    ({"expression": "3*12"}, 36, 1.0),
    ({"expression": "3*12"}, 35, 0.0),
    ({"expression": "__import__('os').system('true')"}, 0, 0.0),  # a refused expression is a wrong answer
])
def test_the_agent_grades_the_tool_result(tool_args, answer, reward):
    with FakeLLM(tool_args=tool_args) as llm:
        got = run({"id": "t", "question": "Tom has 3 bags with 12 apples each. How many?", "answer": answer},
                  llm.base_url)
        assert got == reward
        [request] = llm.requests  # one LLM call per rollout, with the calculator offered
        assert [t["function"]["name"] for t in request["tools"]] == ["calculator"]


def test_an_unreachable_server_raises_so_the_trainer_retries():
    with pytest.raises(Exception, match="(?i)connect"):
        run({"id": "t", "question": "1+1?", "answer": 2}, "http://127.0.0.1:9/v1")
