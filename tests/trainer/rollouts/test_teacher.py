"""A teacher's recorded calls turned into demonstrations (``rollouts/teacher.py``), without vLLM: the records are
the gateway's own (``calls.Call`` fed an OpenAI-shaped answer), the tokenizer and chat template the default model's
as lit serves it. The whole path, rollouts and gateway included, is in tests/e2e/test_teacher_demonstrations.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, STATUS_OK, SpanRecord
from lit_trainer.engine.served_model import TOOL_TEMPLATE
from lit_trainer.intake.episodes import rollout_return
from lit_trainer.intake.gateway import calls
from lit_trainer.rollouts.teacher import demonstration_encoder, demonstrations_of

MESSAGES = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
TOOL_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}


@pytest.fixture(scope="module")
def tokenizer(prepared_model: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared_model)
    tokenizer.chat_template = TOOL_TEMPLATE.read_text()  # SmolLM2's own has no tools: lit serves it with its own
    return tokenizer


@pytest.fixture(scope="module")
def encode(prepared_model: Path):
    return demonstration_encoder(prepared_model, TOOL_TEMPLATE)


def teacher_call(messages: list, message: dict, agent: str | None = "calc", finish: str = "stop",
                 tools: list | None = None, call_id: str | None = None) -> SpanRecord:
    """The gateway's record of a teacher's call answered with ``message``."""
    call = calls.Call("chat", "r1", {}, agent, call_id, teacher=True)
    call.engine_body({"model": "big", "messages": messages, **({"tools": tools} if tools else {})})
    call.take_answer({"id": "x", "model": "big", "choices": [{"index": 0, "message": message,
                                                               "finish_reason": finish}]})
    return call.record()


def test_a_tool_call_answer_becomes_the_models_own_rendering_ended_by_its_end_of_turn(encode, tokenizer):
    prompt, response = encode(MESSAGES, TOOLS, {"content": None, "tool_calls": [TOOL_CALL]})
    assert prompt == tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert tokenizer.decode(response) == ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}'
                                          '\n</tool_call><|im_end|>')
    assert response[-1] == tokenizer.eos_token_id


def test_a_text_answer_after_a_tool_round_is_tokenized_after_the_whole_conversation(encode, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    prompt, response = encode(messages, TOOLS, {"content": "It is 5.", "tool_calls": []})
    text = tokenizer.decode(prompt)
    assert text.endswith("<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert '"arguments": {"expression": "2+3"}' in text  # the history's arguments rendered as an object, as vLLM does
    assert tokenizer.decode(response) == "It is 5.<|im_end|>"


def test_a_call_of_a_trained_agent_becomes_a_demonstration_and_the_rest_are_skipped_and_counted(encode, tokenizer):
    right = teacher_call(MESSAGES, {"role": "assistant", "content": "5"}, call_id="00000000000000aa")
    sdk = SpanRecord("t", "00000000000000aa", "root", sc.LLM_SPAN, 1, 2, STATUS_OK, "", "r1",
                     {sc.AGENT_NAME: "solver"})  # the agent's own span of the call names the agent
    other = teacher_call(MESSAGES, {"role": "assistant", "content": "5"}, agent="judge")
    cut = teacher_call(MESSAGES, {"role": "assistant", "content": "5 and"}, agent="solver", finish="length")
    image = teacher_call([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                         {"role": "assistant", "content": "a cat"}, agent="solver")
    failed = teacher_call(MESSAGES, {"role": "assistant", "content": "5"}, agent="solver")
    failed = SpanRecord(*[getattr(failed, f) for f in failed.__dataclass_fields__][:6], STATUS_ERROR, "cut",
                        failed.rollout_id, failed.attributes)
    found, skipped = demonstrations_of([right, sdk, other, cut, image, failed], ("solver",), encode, "r1", "t1")
    assert skipped == {"truncated": 1, "untokenizable": 1}
    [demo] = found
    assert (demo.agent, demo.rollout_id, demo.task_id, demo.index, demo.span_id) == ("solver", "r1", "t1", 0,
                                                                                     right.span_id)
    assert (demo.logprobs, demo.reward, demo.finish_reason) == (None, None, "stop")
    assert demo.prompt_ids == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert tokenizer.decode(demo.response_ids) == "5<|im_end|>"
    found, _ = demonstrations_of([right, sdk, other], (), encode, "r1", "t1")
    assert [d.agent for d in found] == ["solver", "judge"] and [d.index for d in found] == [0, 1]


THINKING = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>' }}{%- endif %}")
"""A template whose generation prompt opens a thought that the assistant's turn, rendered, does not have."""


def test_an_answer_the_template_cannot_render_after_its_prompt_is_untokenizable(encode, prepared_model, tmp_path):
    assert encode([{"role": "tool", "content": None}], None, {"content": "5"}) is None  # the template raises
    assert encode(MESSAGES, None, {"content": None, "tool_calls": [{"type": "function"}]}) is None
    (tmp_path / "thinking.jinja").write_text(THINKING)
    thinking = demonstration_encoder(prepared_model, tmp_path / "thinking.jinja")
    assert thinking(MESSAGES, None, {"content": "<think>sum</think>5"}) is not None
    assert thinking(MESSAGES, None, {"content": "5"}) is None  # the prompt's rendering is no prefix of the whole
    record = teacher_call(MESSAGES, {"role": "assistant", "content": "5"})
    broken = SpanRecord(*[getattr(record, f) for f in record.__dataclass_fields__][:9],
                        {**record.attributes, sc.LLM_REQUEST_MESSAGES: json.dumps("not a list")})
    assert demonstrations_of([broken], (), encode, "r1", "t1")[1] == {"untokenizable": 1}


def root(attributes: dict, status: int = STATUS_OK) -> SpanRecord:
    return SpanRecord("t", "root", None, sc.ROLLOUT_SPAN, 0, 10, status, "", "r1", attributes)


def test_a_rollouts_return_is_read_without_its_calls():
    assert rollout_return([root({sc.ROLLOUT_RETURN_REWARD: 1.0})]) == 1.0
    reward = SpanRecord("t", "w", "root", sc.REWARD_SPAN, 5, 5, STATUS_OK, "", "r1", {sc.REWARD_VALUE: 0.25})
    posted = calls.reward_record("r1", {"value": 0.5})
    orphan = SpanRecord("t", "o", "nowhere", sc.REWARD_SPAN, 5, 5, STATUS_OK, "", "r1", {sc.REWARD_VALUE: 9.0})
    assert rollout_return([root({}), reward, posted, orphan]) == 0.75
    assert rollout_return([root({}, STATUS_ERROR), reward]) is None
    assert rollout_return([root({})]) is None and rollout_return([reward]) is None
    assert rollout_return([root({sc.ROLLOUT_RETURN_REWARD: float("nan")})]) is None
