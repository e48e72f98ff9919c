"""Span tree → MDP episode: one rollout's spans become the ordered LLM calls (transitions) of the agents being
trained, with their rewards.

Each LLM call that carries the engine's token ids is one action (Agent Lightning's unified data interface): its
state is the prompt token ids, its action the response token ids, and the behaviour policy's logprobs come with it.
Rules, in order:
- The tree is rebuilt from spans in any arrival order; duplicates (same span id) count once; only the spans
  reachable from the rollout's root through their parent ids belong to it: a span whose parent never arrived (an
  orphan, or a span forged under a made-up parent) never becomes a transition.
- A call recorded by lit's gateway (``lit.engine.call``, written by the trainer itself) is one call with the agent's
  span of it (``with_engine_calls``): the engine's token ids in the agent's place in the tree; without an agent span
  (a process without lit) it is a call of its own under the root, named by its ``X-Lit-Agent`` header.
- LLM calls are ordered by start time (ties: end time, then span id). Calls that failed (error status) or carry no
  token ids are skipped and counted: a retried call therefore contributes only its successful attempt.
- Only calls of the selected agents become transitions (all agents when none are selected).
- Rewards: the traced function's numeric return is the final reward. Each ``lit.reward`` value is an intermediate
  reward on the selected call it follows (the latest one that started before it); a reward before any call is
  kept on the episode, on no call. The episode return is the final reward when there is one, else the sum of all
  ``lit.reward`` values.
- A rollout is unusable — reported, never turned into reward 0 — when its root span has not arrived, the rollout
  failed (root error status), no selected call has token ids, or it has no reward at all.
- Values are checked, since they come from a peer (a buggy agent is one too): a reward that is not a finite number,
  an attempt that is not a positive integer, a token id that is not an integer of the model's vocabulary
  (``vocab_size``), a behaviour logprob that is not a number <= 0 (or a call's whose sum float32 cannot hold), a
  temperature that is not a finite number >= 0 (0: greedy), or sampling settings that are not text make the
  rollout unusable with that reason (``BAD_*``), counted in ``rollouts/unusable_bad_*``: one bad value costs its
  rollout, never the run.
Runtime signals for automatic intermediate rewards are counted per call: errored tool spans and other errored
spans that started after the call and before the next selected call.

SpanRecords in, Episodes out.
"""

from __future__ import annotations

import bisect
import collections
import enum
import math
from array import array
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field, replace
from operator import attrgetter

import numpy

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, SpanRecord


@dataclass(slots=True)
class Transition:
    """One LLM call as an MDP action. Nothing changes one once built; it is not a frozen dataclass only because
    intake builds one per LLM call, and a frozen one's ``__init__`` sets each field through ``object.__setattr__``
    (bench/ingest.py's episode building: about 3 µs a call, a tenth of a two-call rollout's rebuild)."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None
    """The engine's logprob of each response token (None when it sent none: the trainer then has no behaviour
    policy for this call)."""
    reward: float | None
    """The sum of the ``lit.reward`` values that follow this call; None when none does."""
    agent: str
    rollout_id: str
    task_id: str
    index: int
    """Position among the episode's transitions, from 0."""
    span_id: str
    tool_errors: int = 0
    """Tool spans with error status between this call and the next selected one."""
    other_errors: int = 0
    """Other spans with error status in the same interval (not counting skipped LLM calls)."""
    finish_reason: str = ""
    """Why the engine stopped: ``stop``, ``length`` (cut by ``max_tokens``), ``tool_calls``..."""
    temperature: float = 1.0
    """The sampling temperature of the call (1.0 when the request set none: the engine's default). The behaviour
    logprobs are those of softmax(logits / temperature) (lit's vLLM runs with ``--logprobs-mode
    processed_logprobs``), and the trainer computes its own at the same temperature."""
    sampling_unsupported: str = ""
    """The call's other sampling settings that reshape the distribution (``top_p=0.9``...); lit refuses to train
    on such a call (``unsupported_sampling``)."""
    weight_version: int | None = None
    """The policy version (trainer step) the call was served with, from ``semconv.LLM_WEIGHT_VERSION``: the engine's
    version when the request arrived, the oldest weights any of its tokens can come from. None when the span has
    none, or one that is not a decimal integer (episodes stored before the field load with None)."""
    guided: bool = False
    """The response is a task's reference, not sampled (``rollouts/guidance.py``): ``logprobs`` is None and the
    learner takes its own before the update for the behaviour policy's (``learner/schedule.fill_guided_logprobs``)."""
    model: str = ""
    """The served model that answered the call, as the engine named it (``semconv.LLM_MODEL``): the base model's
    name, or with a ``[roles]`` table the adapter that served it; "" when unrecorded."""


@dataclass(frozen=True, slots=True)
class Episode:
    rollout_id: str
    task_id: str
    attempt: int
    transitions: list[Transition]
    final_reward: float | None
    """The traced function's numeric return value, if any."""
    episode_return: float
    rewards: list[tuple[str, float, int]] = field(default_factory=list)
    """Every ``lit.reward`` as (name, value, index of the transition it follows or -1)."""
    skipped_calls: int = 0
    """LLM calls of selected agents left out: failed, or without token ids."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Episode:
        transitions = [Transition(**t) for t in data["transitions"]]
        rewards = [tuple(r) for r in data.get("rewards", [])]
        return cls(**{**data, "transitions": transitions, "rewards": rewards})


REWARD_LIMIT = 1e9
"""The largest reward, return or sum of rewards lit trains on, in magnitude. Larger is almost surely a bug (scale
the rewards down), and far below where the group statistics of advantages would overflow."""


class Unusable(enum.Enum):
    NO_ROOT = "the rollout's root span has not arrived (still running, or the agent died)"
    FAILED = "the rollout failed (its root span has error status)"
    NO_LLM_CALLS = "no LLM call of the selected agents carries token ids"
    NO_REWARD = "the rollout gave no reward (no numeric return value and no lit.reward)"
    BAD_REWARD = f"a reward, the return or the sum of the rewards is not a finite number within ±{REWARD_LIMIT:,.0f}"
    BAD_ATTEMPT = "the root span's attempt is not a positive integer"
    BAD_TOKEN_IDS = "a token id is not an integer of the model's vocabulary"
    BAD_LOGPROBS = "a behaviour logprob is not a number <= 0, or a call's sum of them is not finite in float32"
    BAD_SAMPLING = "a call's temperature is not a finite number >= 0, or its sampling settings are not text"
    BAD_TASK = "the root span's task id or attempt is not the one the trainer handed out with the rollout"
    BAD_LENGTH = "a call's prompt and response are longer than the engine's context (inference.max_model_len)"


@dataclass(frozen=True, slots=True)
class UnusableRollout:
    rollout_id: str
    reason: Unusable
    detail: str = ""


def handed_out(result: Episode | UnusableRollout, task_id: str, attempt: int) -> Episode | UnusableRollout:
    """``result``, or unusable (``BAD_TASK``) when its root names another task id or attempt than the trainer handed
    out with the rollout (grouped under the peer's word, it would move another task's baseline)."""
    if isinstance(result, Episode) and (result.task_id, result.attempt) != (task_id, attempt):
        return UnusableRollout(result.rollout_id, Unusable.BAD_TASK, f"task {result.task_id!r} attempt "
                               f"{result.attempt!r}; handed out: task {task_id!r} attempt {attempt}")
    return result


def build_episode(spans: Iterable[SpanRecord], agents: Collection[str] | None = None, vocab_size: int | None = None,
                  context: int | None = None) -> Episode | UnusableRollout:
    """Rebuild one rollout's episode from its spans (any order, duplicates allowed). ``vocab_size``: the model's
    (its embedding rows); token ids at or above it make the rollout unusable (None: any id in [0, 2**32)).
    ``context``: the engine's ``max_model_len``; a call whose prompt and response together are longer was not
    sampled by it, and makes the rollout unusable (None: any length)."""
    unique = _dedupe(spans)
    roots = [s for s in unique.values() if s.name == sc.ROLLOUT_SPAN and s.parent_id is None]
    rollout_id = roots[0].rollout_id if roots else next((s.rollout_id for s in unique.values()), None) or ""
    if not roots:
        return UnusableRollout(rollout_id, Unusable.NO_ROOT, f"{len(unique)} spans arrived without their root")
    root = roots[0]
    unique = with_engine_calls(unique, root)
    if root.status == STATUS_ERROR:
        return UnusableRollout(rollout_id, Unusable.FAILED, root.status_message)
    members = _descendants(root, unique)
    timeline = sorted(members, key=_TIME_ORDER)
    calls, skipped = _select_calls(timeline, agents)
    if not calls:
        return UnusableRollout(rollout_id, Unusable.NO_LLM_CALLS, _why_no_calls(timeline, agents, skipped))
    rewards = _rewards(timeline, calls)
    bad = _bad_value(root, calls, rewards, vocab_size, context)
    if bad is not None:
        return UnusableRollout(rollout_id, bad[0], bad[1])
    final = root.attributes.get(sc.ROLLOUT_RETURN_REWARD)
    final = float(final) if final is not None else None
    if final is None and not rewards:
        return UnusableRollout(rollout_id, Unusable.NO_REWARD)
    episode_return = final if final is not None else sum(value for _, value, _ in rewards)
    task_id = str(root.attributes.get(sc.TASK_ID, ""))
    attempt = root.attributes.get(sc.ATTEMPT, 1)
    transitions = _transitions(calls, timeline, rewards, rollout_id, task_id)
    return Episode(rollout_id, task_id, attempt, transitions, final, episode_return, rewards, skipped)


def rollout_return(spans: Iterable[SpanRecord]) -> float | None:
    """A rollout's return as ``build_episode`` takes it (the traced function's numeric return, else the sum of the
    root's ``lit.reward`` values), read without its LLM calls: a teacher's carry no token ids, so its rollouts give
    no episode (``rollouts/teacher.py``). None when the root has not arrived or failed, or there is no reward, or
    one that is not finite and within ``REWARD_LIMIT``."""
    unique = _dedupe(spans)
    root = next((s for s in unique.values() if s.name == sc.ROLLOUT_SPAN and s.parent_id is None), None)
    if root is None or root.status == STATUS_ERROR:
        return None
    final = root.attributes.get(sc.ROLLOUT_RETURN_REWARD)
    if final is not None:
        return float(final) if _reward_ok(final) else None
    values = [s.attributes.get(sc.REWARD_VALUE) for s in _descendants(root, with_engine_calls(unique, root))
              if s.name == sc.REWARD_SPAN]
    if not values or not all(_reward_ok(v) for v in values) or not _reward_ok(sum(values)):
        return None
    return float(sum(values))


_TIME_ORDER = attrgetter("start_ns", "end_ns", "span_id")
"""Calls and rewards in time order (ties: end time, then span id)."""


def _dedupe(spans: Iterable[SpanRecord]) -> dict[str, SpanRecord]:
    unique: dict[str, SpanRecord] = {}
    for span in spans:
        unique.setdefault(span.span_id, span)
    return unique


def merged_spans(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """A rollout's spans as ``build_episode`` reads them, once each: the gateway's records merged in
    (``with_engine_calls``); as they are when the root has not arrived."""
    unique = _dedupe(spans)
    root = next((s for s in unique.values() if s.name == sc.ROLLOUT_SPAN and s.parent_id is None), None)
    return list((with_engine_calls(unique, root) if root is not None else unique).values())


_ENGINE_FIELDS = (sc.LLM_PROMPT_TOKEN_IDS, sc.LLM_RESPONSE_TOKEN_IDS, sc.LLM_RESPONSE_LOGPROBS, sc.LLM_WEIGHT_VERSION,
                  sc.LLM_FINISH_REASON, sc.LLM_TEMPERATURE, sc.LLM_SAMPLING_UNSUPPORTED, sc.LLM_MODEL)
"""What a call recorded at the engine gives the agent's span of the same call: the engine's ids and what it sampled
with, in place of the agent's own (which it may not have: a streamed call, the Responses API)."""


def with_engine_calls(unique: dict[str, SpanRecord], root: SpanRecord) -> dict[str, SpanRecord]:
    """The spans with each reward posted to lit's gateway made a ``lit.reward`` under the root, and each call it
    recorded (``lit.engine.call``) one ``lit.llm`` call of the rollout: merged into the agent's span of the same
    call (``LLM_CALL_ID``), which keeps its place in the tree, its agent name and its timing; or, when the agent
    recorded none, a call of its own under the root. Only the trainer writes ``lit.engine.*`` spans (the collector
    refuses them from peers), so they need no parent to belong here."""
    engine = [s for s in unique.values() if s.name.startswith(sc.ENGINE_PREFIX)]
    if not engine:
        return unique
    out = {k: v for k, v in unique.items() if not v.name.startswith(sc.ENGINE_PREFIX)}
    for call in engine:
        if call.name == sc.ENGINE_REWARD_SPAN:  # a reward the program posted: the rollout's, when it arrived
            out[call.span_id] = replace(call, name=sc.REWARD_SPAN, parent_id=root.span_id, trace_id=root.trace_id)
            continue
        sdk = out.get(str(call.attributes.get(sc.LLM_CALL_ID, "")))
        if sdk is not None and sdk.name == sc.LLM_SPAN:
            attrs = sdk.attributes
            if sc.LLM_RESPONSE_TOKEN_IDS in call.attributes:  # the engine's ids and settings replace the agent's
                attrs = {k: v for k, v in attrs.items() if k not in _ENGINE_FIELDS and k != sc.LLM_TOKEN_IDS_MISSING}
                attrs.update((k, v) for k, v in call.attributes.items() if k in _ENGINE_FIELDS)
            failed = call.status == STATUS_ERROR
            out[sdk.span_id] = replace(sdk, attributes=attrs, status=call.status if failed else sdk.status,
                                       status_message=call.status_message if failed else sdk.status_message)
        else:
            out[call.span_id] = replace(call, name=sc.LLM_SPAN, parent_id=root.span_id, trace_id=root.trace_id)
    return out


def _descendants(root: SpanRecord, unique: dict[str, SpanRecord]) -> list[SpanRecord]:
    """The root's subtree: the spans reachable from it through their parent ids (orphans left out). Each span's
    chain of parents is followed up until a span already decided (the root is), and every span on the way takes
    that answer: one step per span in a flat trace, and a chain that loops or breaks off is out."""
    inside: dict[str | None, bool] = {root.span_id: True, None: False}
    for span in unique.values():
        path, parent = [], span.span_id
        while parent not in inside:
            inside[parent] = False  # until decided: a loop back to it ends here, outside
            path.append(parent)
            above = unique.get(parent)
            parent = above.parent_id if above is not None else None
        answer = inside[parent]
        for span_id in path:
            inside[span_id] = answer
    return [span for span in unique.values() if inside[span.span_id]]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]


_ID_LIMIT = 2**32
"""No token id is this large (``array("I")`` holds ids below it)."""


def _token_ids_ok(calls: list[SpanRecord], high: int) -> bool:
    """Every prompt and response id of the calls an int in [0, high) (a bool is the 0 or 1 it is in Python),
    ``high`` <= ``_ID_LIMIT``. Hundreds per call, so the checks run in C: ``array("I")`` takes only ints in
    [0, 2**32), and numpy's ``max`` over its buffer finds an id at or above a smaller ``high``."""
    ids = array("I")
    try:
        for call in calls:
            ids.fromlist(call.attributes[sc.LLM_PROMPT_TOKEN_IDS])  # lists (_select_calls): fromlist is C's
            ids.fromlist(call.attributes[sc.LLM_RESPONSE_TOKEN_IDS])
    except (TypeError, OverflowError):
        return False
    return high >= _ID_LIMIT or not ids or int(numpy.frombuffer(ids, numpy.uint32).max()) < high


def _wrong_token_id(calls: list[SpanRecord], high: int) -> str:
    """Which call has which wrong id (asked only once ``_token_ids_ok`` has refused them: one pass in Python)."""
    for call in calls:
        ids = call.attributes[sc.LLM_PROMPT_TOKEN_IDS] + call.attributes[sc.LLM_RESPONSE_TOKEN_IDS]
        wrong = next((i for i in ids if not (type(i) in (int, bool) and 0 <= i < high)), None)
        if wrong is not None:
            return f"LLM call {call.span_id}: token id {wrong!r}"
    return "a token id"


_LOWEST_LOGPROB = float(numpy.finfo(numpy.float32).min)
"""About -3.4e38: a logprob, or a sum of them, below it is -inf in float32."""


def _logprobs_ok(logprobs: list) -> bool:
    """Every logprob a number <= 0, and their sum finite in float32, as the trainer holds them (each one then is:
    none is below the sum). Checked in C: a text or a list makes ``sum`` raise, a NaN makes the sum NaN, -inf or a
    value float32 makes -inf (the importance ratio would be infinite) makes it too low; ``max`` finds one above 0."""
    try:
        total = sum(logprobs)
    except TypeError:
        return False
    return isinstance(total, (int, float)) and total >= _LOWEST_LOGPROB and (not logprobs or max(logprobs) <= 0)


def _reward_ok(value: object) -> bool:
    return _is_finite(value) and abs(value) <= REWARD_LIMIT  # type: ignore[arg-type]


def _bad_value(root: SpanRecord, calls: list[SpanRecord], rewards: list[tuple[str, float, int]],
               vocab_size: int | None, context: int | None) -> tuple[Unusable, str] | None:
    """The first value of the rollout that lit cannot train on, as (reason, what), or None."""
    final = root.attributes.get(sc.ROLLOUT_RETURN_REWARD)
    if final is not None and not _reward_ok(final):
        return Unusable.BAD_REWARD, f"the return value {final!r}"
    for name, value, _ in rewards:
        if not _reward_ok(value):
            return Unusable.BAD_REWARD, f"lit.reward({value!r}{f', name={name!r}' if name else ''})"
    if final is None and not _reward_ok(total := sum(value for _, value, _ in rewards)):
        return Unusable.BAD_REWARD, f"the sum of its {len(rewards)} lit.reward values, {total!r}"
    attempt = root.attributes.get(sc.ATTEMPT, 1)
    if not (type(attempt) is int and attempt >= 1):
        return Unusable.BAD_ATTEMPT, f"attempt {attempt!r}"
    high = min(vocab_size, _ID_LIMIT) if vocab_size is not None else _ID_LIMIT
    if not _token_ids_ok(calls, high):
        return Unusable.BAD_TOKEN_IDS, f"{_wrong_token_id(calls, high)} (vocabulary size {vocab_size})"
    for call in calls:
        attrs = call.attributes
        prompt, response = attrs[sc.LLM_PROMPT_TOKEN_IDS], attrs[sc.LLM_RESPONSE_TOKEN_IDS]
        if context is not None and len(prompt) + len(response) > context:
            return Unusable.BAD_LENGTH, (f"LLM call {call.span_id}: {len(prompt)} prompt and {len(response)} "
                                       f"response tokens, over {context}")
        logprobs = attrs.get(sc.LLM_RESPONSE_LOGPROBS)
        if isinstance(logprobs, list) and not _logprobs_ok(logprobs):
            wrong = next((x for x in logprobs if not (_is_number(x) and _LOWEST_LOGPROB <= x <= 0)), "their sum")
            return Unusable.BAD_LOGPROBS, f"LLM call {call.span_id}: logprob {wrong!r}"
        temperature = attrs.get(sc.LLM_TEMPERATURE)
        unsupported = attrs.get(sc.LLM_SAMPLING_UNSUPPORTED, "")
        if (temperature is not None and not (_is_finite(temperature) and temperature >= 0)) or \
                not isinstance(unsupported, str):
            return (Unusable.BAD_SAMPLING,
                    f"LLM call {call.span_id}: temperature {temperature!r}, other settings {unsupported!r}")
    return None


def _is_llm_call(span: SpanRecord) -> bool:
    return span.name == sc.LLM_SPAN


def _select_calls(timeline: list[SpanRecord], agents: Collection[str] | None) -> tuple[list[SpanRecord], int]:
    calls, skipped = [], 0
    for span in timeline:
        if not _is_llm_call(span):
            continue
        if agents is not None and span.attributes.get(sc.AGENT_NAME, "") not in agents:
            continue
        has_ids = isinstance(span.attributes.get(sc.LLM_PROMPT_TOKEN_IDS), list) and isinstance(
            span.attributes.get(sc.LLM_RESPONSE_TOKEN_IDS), list
        )
        if span.status == STATUS_ERROR or not has_ids or not span.attributes[sc.LLM_RESPONSE_TOKEN_IDS]:
            skipped += 1
            continue
        calls.append(span)
    return calls, skipped


def _why_no_calls(timeline: list[SpanRecord], agents: Collection[str] | None, skipped: int) -> str:
    """What a rollout without a usable call did call: the words that point at the fix."""
    if skipped:
        return (f"{skipped} LLM call(s) of the selected agents failed or carry no token ids (token ids are recorded "
                "for calls to the engine's base_url with lit.instrument() on)")
    others = collections.Counter(str(s.attributes.get(sc.AGENT_NAME, "")) for s in timeline if _is_llm_call(s))
    if not others:
        return "the rollout made no LLM call that lit recorded (lit.instrument() off, or the engine not called)"
    names = ", ".join(f"{name or '(no name)'!r} x{n}" for name, n in sorted(others.items()))
    return (f"its LLM calls are by other agents: {names}; the agents selected for training (agent.agents): "
            f"{', '.join(map(repr, sorted(agents or ())))}")


def _preceding_call(start_ns: int, call_starts: list[int]) -> int:
    """Index of the latest call that started at or before ``start_ns``; -1 when none did."""
    return bisect.bisect_right(call_starts, start_ns) - 1


def _rewards(timeline: list[SpanRecord], calls: list[SpanRecord]) -> list[tuple[str, float, int]]:
    starts = [c.start_ns for c in calls]
    rewards = []
    for span in timeline:
        if span.name == sc.REWARD_SPAN and _is_number(span.attributes.get(sc.REWARD_VALUE)):
            value = float(span.attributes[sc.REWARD_VALUE])
            name = str(span.attributes.get(sc.REWARD_NAME, ""))
            rewards.append((name, value, _preceding_call(span.start_ns, starts)))
    return rewards


def _transitions(
    calls: list[SpanRecord],
    timeline: list[SpanRecord],
    rewards: list[tuple[str, float, int]],
    rollout_id: str,
    task_id: str,
) -> list[Transition]:
    per_call: dict[int, float] = {}
    for _, value, index in rewards:
        if index >= 0:
            per_call[index] = per_call.get(index, 0.0) + value
    starts = [c.start_ns for c in calls]
    tool_errors, other_errors = [0] * len(calls), [0] * len(calls)
    for span in timeline:
        if span.status != STATUS_ERROR or _is_llm_call(span) or span.name == sc.ROLLOUT_SPAN:
            continue
        index = _preceding_call(span.start_ns, starts)
        if index >= 0:
            if span.attributes.get(sc.OI_SPAN_KIND) == "TOOL":
                tool_errors[index] += 1
            else:
                other_errors[index] += 1
    transitions = []
    for i, call in enumerate(calls):
        attrs = call.attributes
        logprobs = attrs.get(sc.LLM_RESPONSE_LOGPROBS)
        if not isinstance(logprobs, list) or len(logprobs) != len(attrs[sc.LLM_RESPONSE_TOKEN_IDS]):
            logprobs = None
        transitions.append(
            Transition(
                prompt_ids=list(attrs[sc.LLM_PROMPT_TOKEN_IDS]),
                response_ids=list(attrs[sc.LLM_RESPONSE_TOKEN_IDS]),
                logprobs=list(map(float, logprobs)) if logprobs is not None else None,
                reward=per_call.get(i),
                agent=str(attrs.get(sc.AGENT_NAME, "")),
                rollout_id=rollout_id,
                task_id=task_id,
                index=i,
                span_id=call.span_id,
                tool_errors=tool_errors[i],
                other_errors=other_errors[i],
                finish_reason=str(attrs.get(sc.LLM_FINISH_REASON, "")),
                temperature=_temperature(attrs.get(sc.LLM_TEMPERATURE)),
                sampling_unsupported=str(attrs.get(sc.LLM_SAMPLING_UNSUPPORTED, "")),
                weight_version=_weight_version(attrs.get(sc.LLM_WEIGHT_VERSION)),
                model=str(attrs.get(sc.LLM_MODEL, "")),
            )
        )
    return transitions


def _temperature(value: object) -> float:
    """A call's recorded temperature (checked by ``_bad_value``); 1.0 (the engine's default) when it set none."""
    return float(value) if _is_number(value) else 1.0


_VERSION_DIGITS = 18
"""The longest weight version taken (a step number; ``int`` of a much longer text is slow, and refused past 4300
digits)."""


def _weight_version(value: object) -> int | None:
    """A call's recorded weight version as a step number; None when it has none or it is no decimal integer of at
    most ``_VERSION_DIGITS`` digits."""
    if isinstance(value, str) and len(value) <= _VERSION_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    return None


def unsupported_sampling(episodes: Iterable[Episode]) -> Transition | None:
    """The first transition sampled with settings beyond temperature (top-p, top-k, penalties...), or None. The
    trainer cannot compute the logprobs of such a distribution, so it refuses to train on it."""
    return next((t for e in episodes for t in e.transitions if t.sampling_unsupported), None)
