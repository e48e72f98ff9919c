"""Every span attribute key and span name that lit writes or reads: the one place a ``lit.*`` string may appear.

The SDK writes them, the trainer reads them; neither spells a key out anywhere else. Attributes of other
conventions (openinference's ``graph.node.id`` and ``agent.name``) are named here too when lit reads them.
"""

# Span names lit creates.
ROLLOUT_SPAN = "lit.rollout"
"""The root span of one rollout, opened by ``@lit.trace``."""
LLM_SPAN = "lit.llm"
"""One call to the LLM engine (chat or text completion) with the engine's token ids."""
ENGINE_CALL_SPAN = "lit.engine.call"
"""One LLM call as lit's gateway saw it reach the engine under a rollout's URL: written by the trainer into its own
store, never sent by an agent (the collector refuses a span of this name). It carries the engine's token ids; the
episode builder merges it into the agent's ``lit.llm`` span of the same call (``LLM_CALL_ID``) or, when the agent
recorded none, makes it a call of the rollout on its own."""
ENGINE_REWARD_SPAN = "lit.engine.reward"
"""A reward a program posted to its rollout's URL at lit's gateway (``POST .../reward``): written by the trainer,
never sent by an agent; the episode builder makes it a ``lit.reward`` of the rollout, at the time it arrived."""
ENGINE_PREFIX = "lit.engine."
"""The names of the spans only the trainer writes (the collector refuses them from peers)."""
REWARD_SPAN = "lit.reward"
"""A reward given with ``lit.reward(value, name=...)``, placed in the tree where it was given."""

# Attributes every span of a rollout carries (stamped by lit's span processor).
ROLLOUT_ID = "lit.rollout.id"
"""The rollout this span belongs to (a string; assigned by the trainer, or made up when run outside it)."""
TASK_ID = "lit.task.id"
"""The task the rollout works on (a string; empty when run outside the trainer)."""
ATTEMPT = "lit.rollout.attempt"
"""Which attempt at the rollout this is, starting at 1."""

# Rollout root span.
ROLLOUT_NAME = "lit.rollout.name"
"""The traced function's name (or ``@lit.trace(name=...)``)."""
ROLLOUT_INPUT = "lit.rollout.input"
"""The traced function's arguments as JSON (truncated to a bounded length)."""
ROLLOUT_OUTPUT = "lit.rollout.output"
"""The traced function's return value as JSON (truncated to a bounded length)."""
ROLLOUT_RETURN_REWARD = "lit.rollout.return_reward"
"""The traced function's numeric return value: the rollout's final reward. Absent when it returned no number."""
ROLLOUT_SECRET = "lit.rollout.secret"
"""The secret the trainer handed out with this attempt (``Run.secret``), on the root span only: the trainer stores a
root only when it carries the secret of a rollout it dispatched, so a peer that learned a rollout id cannot add a
root of its own (and with it a reward). Absent when run outside the trainer."""
ROLLOUT_SPANS = "lit.rollout.spans"
"""How many spans of the rollout had ended when its root ended, the root included: the trainer builds an episode
only when that many are stored (a span lost anywhere on the way makes the rollout incomplete, never quietly
shorter). Stamped by lit's span processor."""

# LLM-call span.
AGENT_NAME = "lit.agent.name"
"""Which agent made this LLM call (LangGraph node, AutoGen agent, Agents SDK agent, or ``@lit.trace(agent=)``)."""
LLM_API = "lit.llm.api"
"""Which API the call used: ``chat``, ``completion`` (OpenAI's), ``responses`` (OpenAI's Responses API) or
``messages`` (Anthropic's)."""
LLM_CALL_ID = "lit.llm.call_id"
"""On an engine call: the span id of the agent's ``lit.llm`` span of the same call (the SDK sends it in the
``X-Lit-Call`` header), which makes the two one transition. Absent when the agent's process runs no lit."""
LLM_STREAMED = "lit.llm.streamed"
"""True when the client asked for a streamed answer."""
LLM_MODEL = "lit.llm.model"
"""The model name the engine answered with."""
LLM_RESPONSE_ID = "lit.llm.response_id"
"""The engine's response id."""
LLM_WEIGHT_VERSION = "lit.llm.weight_version"
"""The policy weight version the call was served with, a string (the trainer's step): the engine's version when
the request reached it (lit's vLLM adds it to its answer), else the one the trainer gave the rollout at dispatch;
absent when neither says. With weights synced in flight, later tokens of the call may come from newer weights:
this is the oldest that can have served it."""
LLM_PROMPT_TOKEN_IDS = "lit.llm.prompt_token_ids"
"""The engine's token ids of the whole prompt, as it tokenised it (chat template applied)."""
LLM_RESPONSE_TOKEN_IDS = "lit.llm.response_token_ids"
"""The engine's sampled token ids of the response (choice 0)."""
LLM_RESPONSE_LOGPROBS = "lit.llm.response_logprobs"
"""The engine's logprob of each sampled response token (same length as the response token ids)."""
LLM_FINISH_REASON = "lit.llm.finish_reason"
"""Why the engine stopped: ``stop``, ``length``, ``tool_calls``..."""
LLM_TEMPERATURE = "lit.llm.temperature"
"""The sampling temperature the request asked for (a float); absent when it set none (the engine's default, 1.0 on
a lit-managed vLLM). The trainer computes its logprobs at this temperature."""
LLM_SAMPLING_UNSUPPORTED = "lit.llm.sampling_unsupported"
"""The request's other settings that reshape the sampled distribution, as ``name=value`` pairs (``top_p=0.9,
top_k=20``): top-p, top-k, min-p, presence/frequency/repetition penalties, logit bias. Absent when none is set.
lit trains only on plain temperature sampling and refuses calls that carry any of these."""
LLM_CHOICES = "lit.llm.choices"
"""How many choices the engine returned; only choice 0's ids are recorded."""
LLM_TOKEN_IDS_MISSING = "lit.llm.token_ids_missing"
"""True when the engine did not return token ids (not a lit-managed engine, or an old vLLM)."""
LLM_REQUEST_MESSAGES = "lit.llm.request_messages"
"""On an engine call to a teacher (an API lit does not train): the chat request's ``messages`` as a JSON string (the
translated chat request for the Responses and Messages APIs), from which the trainer tokenizes a demonstration."""
LLM_REQUEST_TOOLS = "lit.llm.request_tools"
"""On an engine call to a teacher: the chat request's ``tools`` as a JSON string; absent when it offered none."""
LLM_RESPONSE_MESSAGE = "lit.llm.response_message"
"""On an engine call to a teacher: the answer's assistant message (choice 0) as a JSON string
``{"content": ..., "tool_calls": [...]}``, streamed answers put together."""

# Reward span.
REWARD_VALUE = "lit.reward.value"
"""The reward, a float."""
REWARD_NAME = "lit.reward.name"
"""The reward's name (``lit.reward(x, name=...)``); empty when unnamed."""

# Keys of other conventions that lit reads to find agent names.
OI_GRAPH_NODE_ID = "graph.node.id"
"""openinference: the agent/node a span belongs to (AutoGen-AgentChat sets it when the span starts)."""
OI_AGENT_NAME = "agent.name"
"""openinference: the agent's name."""
OI_SPAN_KIND = "openinference.span.kind"
"""openinference: what a span is (``LLM``, ``TOOL``, ``AGENT``, ``CHAIN``...); lit counts errored ``TOOL`` spans."""
