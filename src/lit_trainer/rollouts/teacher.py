"""Demonstrations from a teacher (issue #65): the user's agent, unchanged, runs against another OpenAI-compatible
endpoint (a stronger model, an API) through lit's gateway, which records each call's chat request and answer
(``Gateway(..., teachers=[teacher.upstream])``). The rollouts whose return reaches ``success_reward`` become
supervised demonstrations for an SFT phase, in the TRAINED model's tokens:

- the prompt: the trained model's chat template (the one its vLLM serves with) over the request's messages and
  tools, with the generation prompt, tokenized as the engine tokenizes a chat prompt;
- the response: the answer's assistant message as the same template renders it after that prompt (prompt and answer
  rendered together, the prompt's rendering checked to be its prefix, the rest kept up to and with the end-of-turn
  token), tokenized on its own as the engine's responses are sampled after their prompt.

Only calls of the trained agents (``agent.agents``; all when empty) count. A call the template cannot render, whose
prompt is not a prefix of prompt and answer, or that is no chat call, is skipped and counted
(``sft/teacher_untokenizable``), and an answer cut by ``max_tokens`` too (``sft/teacher_truncated``): it would teach
the model to stop mid-answer. A rollout's return is read from its spans (``intake.episodes.rollout_return``): a
teacher's calls carry no token ids, so they give no episode.
"""

from __future__ import annotations

import collections
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, SpanRecord
from lit_sdk.resources import LLM
from lit_trainer.engine.served_model import chat_template_for
from lit_trainer.intake.episodes import Transition, rollout_return
from lit_trainer.intake.rows import RolloutStatus
from lit_trainer.rollouts.guidance import tokenizer_with_end
from lit_trainer.rollouts.runner import RolloutRunner

Encode = Callable[[list, list | None, dict], tuple[list[int], list[int]] | None]
"""(request messages, request tools or None, assistant message) -> (prompt ids, response ids), or None when the
call cannot be tokenized."""


@dataclass(frozen=True)
class Teacher:
    """An OpenAI-compatible endpoint whose answers are demonstrations."""

    url: str
    """Its base URL, ending in ``/v1``."""
    model: str
    """The ``model`` name the agent puts in its requests."""
    api_key_env: str = ""
    """The environment variable of the trainer's process that holds its API key (sent by lit's gateway only, never
    to a worker); empty: none is sent."""

    @property
    def upstream(self) -> tuple[str, str]:
        """What ``Gateway(..., teachers=[...])`` takes for it."""
        return self.url, self.api_key_env


def collect(runner: RolloutRunner, tasks: list[dict], teacher: Teacher, temperature: float, success_reward: float,
            model_dir: str | Path, step: int = 0) -> tuple[list[Transition], dict[str, float]]:
    """One rollout per task with ``teacher`` as the agent's LLM, and the demonstrations of those whose return
    reaches ``success_reward`` (module docstring); ``model_dir``: the trained model's folder (tokenizer, chat
    template). Metrics: ``sft/teacher_rollouts`` (asked for), ``sft/teacher_failed``, ``sft/teacher_kept``,
    ``sft/teacher_demonstrations``, ``sft/teacher_untokenizable``, ``sft/teacher_truncated``. The runner's gateway
    must know the teacher, and no group of the training rollouts may be running ahead (their episodes would come
    back here and be lost)."""
    gateway = runner.dispatcher.gateway
    if gateway is None or teacher.url.rstrip("/") not in gateway.upstreams:
        raise ValueError(f"lit's gateway does not know the teacher at {teacher.url}: build it with "
                         "Gateway(..., teachers=[teacher.upstream]) (run/services.py)")
    if runner.dispatcher.carried:
        raise RuntimeError("teacher.collect was called while training rollouts run ahead (dispatcher.carried): "
                           "call it before the step feed starts, or after it has drained")
    encode = demonstration_encoder(model_dir, chat_template_for(runner.fleet.inference, Path(model_dir)))
    llm = LLM(teacher.url, teacher.model, temperature=temperature, max_tokens=runner.agent.max_tokens)
    label = f"teacher{step}-{secrets.token_hex(3)}"  # rollout ids stay unique when a step collects twice
    batch = runner.run(tasks, 1, temperature, step, label, version=0, llm=llm)  # no weight version serves a teacher
    demonstrations: list[Transition] = []
    skipped: collections.Counter[str] = collections.Counter()
    kept = 0
    for outcome in batch.outcomes:
        if outcome.status is not RolloutStatus.SUCCEEDED:
            continue
        spans = runner.store.spans_of_rollout(outcome.rollout_id)
        episode_return = rollout_return(spans)
        if episode_return is None or episode_return < success_reward:
            continue
        kept += 1
        found, why = demonstrations_of(spans, runner.agent.agents, encode, outcome.rollout_id,
                                       outcome.request.task_id)
        demonstrations += found
        skipped += why
    metrics = {"sft/teacher_rollouts": float(len(batch.outcomes)),
               "sft/teacher_failed": float(sum(o.status is not RolloutStatus.SUCCEEDED for o in batch.outcomes)),
               "sft/teacher_kept": float(kept), "sft/teacher_demonstrations": float(len(demonstrations)),
               "sft/teacher_untokenizable": float(skipped["untokenizable"]),
               "sft/teacher_truncated": float(skipped["truncated"])}
    return demonstrations, metrics


def demonstrations_of(spans: list[SpanRecord], agents: tuple[str, ...], encode: Encode, rollout_id: str,
                      task_id: str) -> tuple[list[Transition], collections.Counter[str]]:
    """The demonstrations of one rollout: its teacher calls recorded by the gateway, in time order, of the agents
    in ``agents`` (all when empty), and how many were skipped, by why (``untokenizable``, ``truncated``). A call's
    agent is the one the agent's own span of it names (``LLM_CALL_ID``), as in an episode, else its header's."""
    own = {s.span_id: s for s in spans if s.name == sc.LLM_SPAN}
    calls = sorted((s for s in spans if s.name == sc.ENGINE_CALL_SPAN and s.status != STATUS_ERROR
                    and sc.LLM_RESPONSE_MESSAGE in s.attributes), key=lambda s: (s.start_ns, s.end_ns, s.span_id))
    found: list[Transition] = []
    skipped: collections.Counter[str] = collections.Counter()
    for call in calls:
        attrs = call.attributes
        sdk = own.get(str(attrs.get(sc.LLM_CALL_ID, "")))
        agent = str((sdk.attributes.get(sc.AGENT_NAME) if sdk is not None else None) or attrs.get(sc.AGENT_NAME)
                    or "")
        if agents and agent not in agents:
            continue
        if attrs.get(sc.LLM_FINISH_REASON) == "length":
            skipped["truncated"] += 1
            continue
        ids = _encode_call(attrs, encode)
        if ids is None:
            skipped["untokenizable"] += 1
            continue
        found.append(Transition(ids[0], ids[1], None, None, agent, rollout_id, task_id, len(found), call.span_id,
                                finish_reason="stop"))
    return found, skipped


def _encode_call(attrs: dict[str, Any], encode: Encode) -> tuple[list[int], list[int]] | None:
    """A recorded teacher call's (prompt ids, response ids), or None when it is no chat call or cannot be
    tokenized."""
    try:
        messages = json.loads(attrs[sc.LLM_REQUEST_MESSAGES])
        tools = json.loads(attrs[sc.LLM_REQUEST_TOOLS]) if sc.LLM_REQUEST_TOOLS in attrs else None
        answer = json.loads(attrs[sc.LLM_RESPONSE_MESSAGE])
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(messages, list) or not messages or not isinstance(answer, dict):
        return None  # a text completion has no messages
    return encode(messages, tools if isinstance(tools, list) and tools else None, answer)


def demonstration_encoder(model_dir: str | Path, template: Path | None = None) -> Encode:
    """``Encode`` for the model in ``model_dir`` with the chat template in ``template`` (None: the model's own), as
    its vLLM serves it (``engine.served_model.chat_template_for``); see the module docstring."""
    tokenizer = tokenizer_with_end(model_dir)
    if template is not None:
        tokenizer.chat_template = template.read_text()
    end, end_id = tokenizer.eos_token, tokenizer.eos_token_id

    def encode(messages: list, tools: list | None, answer: dict) -> tuple[list[int], list[int]] | None:
        try:
            conversation = [_template_message(m) for m in messages]
            prompt = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True,
                                                   tokenize=False)
            whole = tokenizer.apply_chat_template(conversation + [_answer_message(answer)], tools=tools,
                                                  tokenize=False)
        except Exception:  # a chat template is the model authors' code: whatever it raises, it cannot render this
            return None
        if not isinstance(prompt, str) or not isinstance(whole, str) or not whole.startswith(prompt):
            return None
        cut = whole.find(end, len(prompt))
        if cut < 0:
            return None
        response = tokenizer.encode(whole[len(prompt):cut + len(end)], add_special_tokens=False)
        if not response or response[-1] != end_id:
            return None
        return tokenizer.encode(prompt, add_special_tokens=False), response

    return encode


def _template_message(message: Any) -> dict:
    """A chat message as chat templates take it, as vLLM gives it to them: text parts joined into one text, a tool
    call's JSON arguments as an object. ValueError for a message that is not text (an image...)."""
    if not isinstance(message, dict):
        raise ValueError("a message is not a JSON object")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ValueError("a message has a part that is not text")
        out["content"] = "\n".join(p["text"] for p in content)
    if out.get("tool_calls"):
        out["tool_calls"] = [_parsed_arguments(call) for call in out["tool_calls"]]
    return out


def _answer_message(answer: dict) -> dict:
    """The teacher's answer as the conversation's last assistant message."""
    if answer.get("tool_calls"):
        return _template_message({"role": "assistant", "content": answer.get("content"),
                                  "tool_calls": answer["tool_calls"]})
    return {"role": "assistant", "content": answer.get("content") or ""}


def _parsed_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call
