"""One rollout rendered as a self-contained HTML page, as it was trained on (what ``lit show`` writes).

The page holds the rollout's span tree (with where each reward attaches), then every LLM call with its prompt and
response tokens, decoded one by one with the run's tokenizer. Response tokens are coloured by the advantage their
call got in the update (green above 0, red below, full colour at |A| >= 1), or, with the switch at the top, by the
engine's logprob of each token (the darker, the less likely the sampled token was), or by the gap between the
trainer's logprob of the token (kept by the update for the calls it trained on, before its first optimizer step on
them) and the engine's: where vLLM and the trainer disagree on the same weights (the run's mean is the metric
``policy/vllm_logprob_gap``).

Everything is inline: CSS only (the colour switch is a pair of radio buttons), no script, no external link, so the
page opens from a file and displays in a notebook (``RolloutView._repr_html_``).

Every value from the store is an agent's data, so a hostile or broken one must neither run in the page nor stop it:
all of it reaches the HTML through ``_esc`` (element text) or ``_attrs`` (attribute values), both
``html.escape(quote=True)``, and a value that should be a number and is not (a string, None, a list, NaN, an
integer too large for a float) is shown as text and left uncoloured (``_num``, ``_finite``).
"""

from __future__ import annotations

import bisect
import html
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_sdk import semconv as sc
from lit_sdk.protocol import STATUS_ERROR, SpanRecord
from lit_trainer import steps
from lit_trainer.intake.episodes import (
    Episode,
    Transition,
    UnusableRollout,
    build_episode,
    handed_out,
    merged_spans,
)
from lit_trainer.intake.rows import RolloutRow, RolloutStatus, Store

Decode = Callable[[object], str | None]
"""A token id → its text, or None where it has none (the page shows the id)."""

ADVANTAGE_FULL = 1.0
"""|advantage| at and above which a token has its full colour."""
GAP_FULL = 0.1
"""|trainer − engine logprob| (nats) at and above which a token has its full colour in the gap view."""
PROMPT_TAIL = 48
"""Prompt tokens shown while the prompt is folded: its last ones, where the newest message is."""

_CSS = """
.lit-view{font:13px/1.45 system-ui,-apple-system,sans-serif;color:#1f2328;max-width:1150px}
.lit-view h2{font-size:17px;margin:2px 0 6px}.lit-view h3{font-size:14px;margin:14px 0 4px}
.lit-view table.meta td{padding:0 14px 0 0;vertical-align:top}
.lit-view td.k{white-space:nowrap;color:#57606a}
.lit-view .tree ul{list-style:none;margin:0;padding-left:16px;border-left:1px solid #d0d7de}
.lit-view .tree>ul{padding-left:0;border:0}.lit-view .tree li{margin:1px 0}
.lit-view .err{color:#cf222e}.lit-view .dim{color:#57606a}
.lit-view .tag{display:inline-block;padding:0 6px;border-radius:9px;background:#eaeef2;font-size:11px;margin-left:4px}
.lit-view .rew{background:#fff1a8}.lit-view .pos{background:#c9f0d3}.lit-view .neg{background:#ffd5d2}
.lit-view .call{border:1px solid #d0d7de;border-radius:6px;padding:4px 10px 8px;margin:8px 0}
.lit-view .toks{font:12px/1.75 ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-word}
.lit-view .tok{background:var(--a);box-shadow:inset -1px 0 rgba(0,0,0,.22)}
.lit-view .prompt .tok,.lit-view .prompt-tail .tok{background:none;color:#57606a}
.lit-view .response{border-left:3px solid #8c959f;padding-left:6px}
.lit-view details[open]+.prompt-tail{display:none}
.lit-view input.lit-lp:checked~.lit-body .tok{background:var(--l)}
.lit-view input.lit-gap:checked~.lit-body .tok{background:var(--g)}
.lit-view .lg-l,.lit-view .lg-g,.lit-view input.lit-lp:checked~.lit-body .lg-a{display:none}
.lit-view input.lit-gap:checked~.lit-body .lg-a{display:none}
.lit-view input.lit-lp:checked~.lit-body .lg-l,.lit-view input.lit-gap:checked~.lit-body .lg-g{display:inline}
.lit-view .legend .tok{padding:0 6px;margin-right:4px}.lit-view summary{cursor:pointer;color:#57606a}
"""


@dataclass(frozen=True)
class RolloutView:
    """One rollout's page. Displays itself in a notebook; ``save`` writes it as a standalone HTML file."""

    rollout_id: str
    body: str
    """The page's HTML fragment (its CSS inside): what a notebook displays."""

    def _repr_html_(self) -> str:
        return self.body

    def html(self) -> str:
        """The whole HTML document."""
        return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>rollout {_esc(self.rollout_id)}'
                f"</title></head><body>\n{self.body}\n</body></html>\n")

    def save(self, path: str | Path) -> Path:
        """Write the document to ``path`` (its folder is created); the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path


def view_rollout(store: Store, rollout_id: str, tokenizer: Any = None) -> RolloutView:
    """The page of rollout ``rollout_id`` in ``store``; tokens decoded with ``tokenizer`` (None: shown as their
    ids). A run's folder: ``lit_trainer.open_run(dir).show(rollout_id)``, which finds its store and tokenizer."""
    return _view(store, rollout_id, _decoder(tokenizer))


def _view(store: Store, rollout_id: str, decode: Decode | None) -> RolloutView:
    spans = merged_spans(store.spans_of_rollout(rollout_id))  # the calls lit's gateway recorded among them
    rollout = store.get_rollout(rollout_id)
    if not spans and rollout is None:
        raise ValueError(f"no rollout {rollout_id!r} in the store (`lit show --run RUN_DIR` lists the last "
                         "training step's)")
    stored = store.get_episode(rollout_id)
    episode = Episode.from_dict(stored.data) if stored is not None else _as_trained(_rebuild_episode(spans), rollout)
    body = render_rollout(rollout_id, spans, rollout, episode, store.advantages_of_rollout(rollout_id), decode,
                          stored=stored is not None, trainer_logprobs=store.trainer_logprobs_of_rollout(rollout_id),
                          superseded_from=store.superseded([rollout_id]).get(rollout_id))
    return RolloutView(rollout_id, body)


def _rebuild_episode(spans: Sequence[SpanRecord]) -> Episode | UnusableRollout | str:
    """The episode the spans make, or why they make none: spans the trainer never stored an episode of may hold
    values it cannot read (a string where a logprob belongs), and the page shows them all the same."""
    try:
        return build_episode(spans)
    except (TypeError, ValueError, OverflowError) as e:
        return f"the spans make no episode: {type(e).__name__}: {e}"


def _as_trained(episode: Episode | UnusableRollout | str, rollout: RolloutRow | None
                ) -> Episode | UnusableRollout | str:
    """The rebuilt ``episode``, or why the trainer refused to train it: its attempt ended without succeeding (a root
    may still have come after it ended, from a slow agent or a peer holding its secret, and been stored), or its
    root names another task or attempt than the one handed out (``episodes.handed_out``)."""
    if rollout is None or isinstance(episode, str):
        return episode
    if rollout.status in (RolloutStatus.FAILED, RolloutStatus.TIMED_OUT):
        return (f"never trained: its attempt ended {rollout.status.value} (only attempts that succeeded are "
                "trained); the spans below are shown as stored, and a root among them, which may have come after "
                "the attempt ended, decides nothing")
    return handed_out(episode, rollout.task_id, rollout.attempt)


def _decoder(tokenizer: Any) -> Decode | None:
    """Token id → its text; None for an id the tokenizer cannot decode (no integer, negative, beyond the
    vocabulary), which the page then shows as the id it is."""
    if tokenizer is None:
        return None
    vocabulary = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    cache: dict[int, str | None] = {}

    def decode(token_id: object) -> str | None:
        if type(token_id) is not int or token_id < 0 or (vocabulary is not None and token_id >= vocabulary):
            return None
        if token_id not in cache:
            try:
                cache[token_id] = tokenizer.decode([token_id])
            except (OverflowError, IndexError, KeyError, TypeError, ValueError):  # what tokenizers raise for it
                cache[token_id] = None
        return cache[token_id]

    return decode


# -- the page, from store rows --------------------------------------------------------------------------------------


def render_rollout(rollout_id: str, spans: Sequence[SpanRecord], rollout: RolloutRow | None,
                   episode: Episode | UnusableRollout | str, advantages: dict[int, float],
                   decode: Decode | None, stored: bool = True,
                   trainer_logprobs: dict[int, list[float]] | None = None,
                   superseded_from: int | None = None) -> str:
    """The page's HTML fragment. ``advantages`` maps transition index → advantage; ``decode`` turns one token id
    into text (None: show ids); ``episode`` is a string where the spans make none (why); ``stored`` says
    whether ``episode`` is the one the trainer kept;
    ``trainer_logprobs`` maps transition index → the trainer's token logprobs (for the gap); ``superseded_from``:
    the step a later run restarted from, which trained this rollout's step again (store ``supersede``)."""
    transitions = {t.span_id: t for t in episode.transitions} if isinstance(episode, Episode) else {}
    calls = [s for s in sorted(spans, key=lambda s: (s.start_ns, s.end_ns, s.span_id)) if s.name == sc.LLM_SPAN]
    numbers = {s.span_id: k for k, s in enumerate(calls, 1)}
    attach = _reward_targets(spans, [s for s in calls if s.span_id in transitions], numbers)
    uid = f"lit{uuid.uuid4().hex[:12]}"  # the colour switch's radio names: one per view among a notebook's outputs
    parts = [f'<div class="lit-view"><style>{_CSS}</style>',
             _header(rollout_id, spans, rollout, episode, stored, decode,
                     {t.index: numbers.get(t.span_id, 0) for t in transitions.values()}, superseded_from),
             _switch(uid),
             '<div class="lit-body">', _legend(),
             "<h3>Span tree</h3>", _tree(spans, uid, numbers, transitions, advantages, attach),
             f"<h3>LLM calls ({len(calls)})</h3>"]
    for call in calls:
        parts.append(_call(call, uid, numbers[call.span_id], transitions.get(call.span_id), advantages, decode,
                           trainer_logprobs or {}))
    parts.append("</div></div>")
    return "\n".join(parts)


def _switch(uid: str) -> str:
    """The colour switch: three radio buttons named ``uid``, the first checked."""
    return " ".join(f'<input type="radio"{_attrs({"class": kind, "name": uid, "id": uid + key})}'
                    f'{" checked" if key == "a" else ""}><label{_attrs({"for": uid + key})}>colour by {_esc(what)}'
                    "</label>" for kind, key, what in (("lit-adv", "a", "advantage"),
                                                       ("lit-lp", "l", "engine logprob"),
                                                       ("lit-gap", "g", "trainer − engine logprob gap")))


def _header(rollout_id: str, spans: Sequence[SpanRecord], rollout: RolloutRow | None,
            episode: Episode | UnusableRollout | str, stored: bool, decode: Decode | None,
            call_of: dict[int, int], superseded_from: int | None = None) -> str:
    """Who, what, how it ended; ``call_of`` maps a transition index to its call's number."""
    root = next((s for s in spans if s.name == sc.ROLLOUT_SPAN and s.parent_id is None), None)
    attrs = root.attributes if root is not None else {}
    rows = [("task", rollout.task_id if rollout else attrs.get(sc.TASK_ID, "")),
            ("step", f"{_step(rollout)}, attempt {rollout.attempt}" if rollout else "not in the store"),
            ("status", rollout.status.value + (f": {rollout.error}" if rollout and rollout.error else "")
             if rollout else "unknown")]
    if superseded_from is not None:
        again = f"resumed from step {superseded_from}" if superseded_from else "started again from the beginning"
        rows.append(("superseded", f"yes: its run stopped before its next checkpoint, and the run {again} trained "
                                   "this step anew, without it"))
    if isinstance(episode, Episode):
        source = "" if stored else " (not stored by the trainer: rebuilt from the spans for this page)"
        rows += [("return", f"{_num(episode.episode_return)}{source}"),
                 ("final reward", "none" if episode.final_reward is None else _num(episode.final_reward)),
                 ("rewards", ", ".join(f"{_name(n)} {_num(v)} → " + (f"call #{call_of.get(i)}" if i >= 0 else
                                                                      "the episode") for n, v, i in episode.rewards)
                  or "none besides the final reward")]
    elif isinstance(episode, str):
        rows.append(("episode", episode))
    else:
        rows.append(("episode", f"unusable: {episode.reason.value}" + (f" ({episode.detail})" if episode.detail
                                                                           else "")))
    rows += [("input", attrs.get(sc.ROLLOUT_INPUT, "")), ("output", attrs.get(sc.ROLLOUT_OUTPUT, ""))]
    if decode is None:
        rows.append(("tokens", "shown as ids: no tokenizer (none given, or the run's model was not found)"))
    cells = "".join(f'<tr><td class="k">{_esc(k)}</td><td>{_esc(v)}</td></tr>' for k, v in rows)
    name = attrs.get(sc.ROLLOUT_NAME, "")
    return (f"<h2>Rollout {_esc(rollout_id)} <span class='dim'>{_esc(name)}</span></h2>"
            f"<table class='meta'>{cells}</table>")


def _step(rollout: RolloutRow) -> str:
    """The rollout's step as the console names it (``training step 3``): the store counts otherwise (steps.py)."""
    kind = steps.kind_of(rollout.rollout_id)
    if kind is None:  # not a training or validation rollout (a Playground's)
        return f"none (recorded under {rollout.step})"
    if kind == "demonstrations":
        return "collecting demonstrations ([sft]), before step 1"
    validation = kind == "validation"
    return steps.step_name(steps.shown_step(rollout.step, validation), validation)


def _legend() -> str:
    advantage = "".join(f'<span class="tok" style="--a:{_adv_colour(a)}">A = {a:+g}</span>'
                        for a in (-1, -0.5, 0.5, 1))
    logprob = "".join(f'<span class="tok" style="--l:{_logprob_colour(math.log(p))}">p = {p:g}</span>'
                      for p in (0.99, 0.5, 0.1, 0.01))
    gap = "".join(f'<span class="tok" style="--g:{_gap_colour(g)}">{g:g} nats</span>' for g in (0.001, 0.01, 0.05, 0.1))
    return (f'<div class="legend dim"><span class="lg-a">{advantage} the advantage of the call in its update (full '
            f'colour at |A| ≥ {ADVANTAGE_FULL:g})</span><span class="lg-l">{logprob} the engine\'s probability of '
            f'the sampled token</span><span class="lg-g">{gap} |trainer − engine logprob| of the sampled token '
            "(calls the update trained on; none: not trained on)</span>. Hover a token for its id and values.</div>")


def _tree(spans: Sequence[SpanRecord], uid: str, numbers: dict[str, int], transitions: dict[str, Transition],
          advantages: dict[int, float], attach: dict[str, int]) -> str:
    """Nested lists, children by start time; a span whose parent is not stored hangs under the root."""
    ids = {s.span_id for s in spans}
    root = next((s.span_id for s in spans if s.name == sc.ROLLOUT_SPAN and s.parent_id is None), None)
    children: dict[str | None, list[SpanRecord]] = {}
    for s in sorted(spans, key=lambda s: (s.start_ns, s.end_ns, s.span_id)):
        parent = s.parent_id if s.parent_id in ids else (root if s.span_id != root else None)
        children.setdefault(parent, []).append(s)

    def branch(parent: str | None) -> str:
        items = "".join(f"<li>{_span_line(s, uid, numbers, transitions, advantages, attach)}"
                        f"{branch(s.span_id)}</li>" for s in children.get(parent, []))
        return f"<ul>{items}</ul>" if items else ""

    return f'<div class="tree">{branch(None)}</div>'


def _span_line(s: SpanRecord, uid: str, numbers: dict[str, int], transitions: dict[str, Transition],
               advantages: dict[int, float], attach: dict[str, int]) -> str:
    a = s.attributes
    text = f"<b>{_esc(s.name)}</b> <span class='dim'>{(s.end_ns - s.start_ns) / 1e6:.0f} ms</span>"
    if s.name == sc.ROLLOUT_SPAN:
        text += _tag(a.get(sc.ROLLOUT_NAME, ""))
        if sc.ROLLOUT_RETURN_REWARD in a:
            text += _tag(f"returned {_num(a[sc.ROLLOUT_RETURN_REWARD])}", "rew")
    elif s.name == sc.LLM_SPAN:
        text += _call_link(uid, numbers[s.span_id]) + _tag(f"agent {_str(a.get(sc.AGENT_NAME, ''))}")
        t = transitions.get(s.span_id)
        text += _advantage_tag(advantages.get(t.index) if t else None, t is not None)
    elif s.name == sc.REWARD_SPAN:
        value = a.get(sc.REWARD_VALUE)
        text += _tag(f"{_name(a.get(sc.REWARD_NAME, ''))} {_num(value)}", "rew")
        target = attach.get(s.span_id)
        text += " →" + (_call_link(uid, target) if target else " the episode (no call before)")
    else:
        kind = a.get(sc.OI_SPAN_KIND) or ""
        agent = a.get(sc.OI_GRAPH_NODE_ID) or a.get(sc.OI_AGENT_NAME) or ""
        text += (_tag(kind) if kind else "") + (_tag(f"agent {_str(agent)}") if agent else "")
    if s.status == STATUS_ERROR:
        text += f" <span class='err'>error: {_esc(s.status_message)}</span>"
    return text


def _call(span: SpanRecord, uid: str, k: int, t: Transition | None, advantages: dict[int, float],
          decode: Decode | None, trainer_logprobs: dict[int, list[float]]) -> str:
    a = span.attributes
    prompt, response = a.get(sc.LLM_PROMPT_TOKEN_IDS), a.get(sc.LLM_RESPONSE_TOKEN_IDS)
    advantage = advantages.get(t.index) if t is not None else None
    head = (f'<div class="call"{_attrs({"id": f"{uid}c{k}"})}><b>call #{k}</b>'
            + _tag(f"agent {_str(a.get(sc.AGENT_NAME, ''))}") + _tag(f"finish {_str(a.get(sc.LLM_FINISH_REASON, '?'))}")
            + _tag(f"temperature {_str(a.get(sc.LLM_TEMPERATURE, 'default'))}")
            + (_tag(f"served by {_str(a[sc.LLM_MODEL])}") if a.get(sc.LLM_MODEL) else ""))
    if t is not None:
        head += _tag(f"transition {t.index}") + _advantage_tag(advantage, True)
        head += _tag(f"reward {_num(t.reward)} attached", "rew") if t.reward is not None else ""
    else:
        head += _tag("not trained on: agent not selected, failed, or no token ids")
    if span.status == STATUS_ERROR:
        head += f" <span class='err'>error: {_esc(span.status_message)}</span>"
    if not isinstance(prompt, list) or not isinstance(response, list):
        return head + "<div class='dim'>no token ids recorded</div></div>"
    logprobs = a.get(sc.LLM_RESPONSE_LOGPROBS)
    logprobs = logprobs if isinstance(logprobs, list) and len(logprobs) == len(response) else [None] * len(response)
    prompt_html = "".join(_token(i, decode) for i in prompt)
    tail = "".join(_token(i, decode) for i in prompt[-PROMPT_TAIL:])
    tail = f"<div class='toks prompt-tail'>{'… ' if len(prompt) > PROMPT_TAIL else ''}{tail}</div>"
    trainer = trainer_logprobs.get(t.index) if t is not None else None
    trainer = trainer if trainer is not None and len(trainer) == len(response) else [None] * len(response)
    response_html = "".join(_token(i, decode, lp, advantage, tr)
                            for i, lp, tr in zip(response, logprobs, trainer, strict=True))
    return (f"{head}<details class='prompt'><summary>prompt: {len(prompt)} tokens (folded: the last "
            f"{min(len(prompt), PROMPT_TAIL)})</summary>"
            f"<div class='toks'>{prompt_html}</div></details>{tail}"
            f"<div class='dim'>response: {len(response)} tokens</div>"
            f"<div class='toks response'>{response_html}</div></div>")


def _token(token_id: object, decode: Decode | None, logprob: object = None, advantage: object = None,
           trainer_logprob: object = None) -> str:
    """One token as a span: its text (or id), its colours as CSS variables, its values as data attributes. The id
    and logprob are the agent's: one that is no number shows as text, uncoloured."""
    text = decode(token_id) if decode is not None else None
    text = (f"[{_str(token_id)}]" if text is None else text).replace("\n", "↵\n")  # a newline token stays visible
    lp, tr, adv = _finite(logprob), _finite(trainer_logprob), _finite(advantage)
    title, data, style = [f"id {_str(token_id)}"], {}, ""
    if logprob is not None:
        title.append(f"engine logprob {_num(logprob, '.4f')}"
                     + (f" (p {math.exp(lp):.3f})" if lp is not None and lp <= 0 else ""))
        data["data-lp"] = _num(logprob, ".4f")
        style += f"--l:{_logprob_colour(lp)};" if lp is not None else ""
    if trainer_logprob is not None and logprob is not None:
        gap = tr - lp if tr is not None and lp is not None else None
        title.append(f"trainer logprob {_num(trainer_logprob, '.4f')}"
                     + (f" (gap {gap:+.2e})" if gap is not None else ""))
        if gap is not None:
            data["data-gap"], style = f"{gap:.3e}", style + f"--g:{_gap_colour(gap)};"
    if advantage is not None:
        title.append(f"advantage {_num(advantage, '+.4f')}")
        data["data-adv"] = _num(advantage, ".4f")
        style += f"--a:{_adv_colour(adv)};" if adv is not None else ""
    attributes = _attrs({**data, "style": style or None, "title": " · ".join(title)})
    return f'<span class="tok"{attributes}>{_esc(text)}</span>'


def _adv_colour(advantage: float) -> str:
    """Green above 0, red below, more opaque the larger |advantage| (full at ``ADVANTAGE_FULL``)."""
    if advantage == 0.0:
        return "transparent"
    strength = min(abs(advantage) / ADVANTAGE_FULL, 1.0)
    rgb = "26,127,55" if advantage > 0 else "207,34,46"
    return f"rgba({rgb},{0.1 + 0.5 * strength:.3f})"


def _gap_colour(gap: float) -> str:
    """Clear where trainer and engine agree, purple as |gap| grows (full at ``GAP_FULL`` nats)."""
    return f"rgba(130,80,223,{0.7 * min(abs(gap) / GAP_FULL, 1.0):.3f})"


def _logprob_colour(logprob: float) -> str:
    """Clear for a token the engine was sure of, dark orange for one it sampled against the odds."""
    surprise = 1.0 - math.exp(min(logprob, 0.0))
    return f"rgba(219,109,40,{0.65 * surprise:.3f})"


def _advantage_tag(advantage: float | None, is_transition: bool) -> str:
    if not is_transition:
        return _tag("not trained on")
    if advantage is None:
        return _tag("no advantage saved (not in an update)")
    number = _finite(advantage) or 0.0
    return _tag(f"advantage {_num(advantage, '+.4f')}", "pos" if number > 0 else "neg" if number < 0 else "")


def _reward_targets(spans: Sequence[SpanRecord], transition_calls: list[SpanRecord], numbers: dict[str, int]
                    ) -> dict[str, int]:
    """Reward span id → the number of the call it attaches to: the latest trained call that started at or before
    it (episodes.py's rule). A reward before every such call is the episode's and is absent here."""
    starts = [c.start_ns for c in transition_calls]
    out = {}
    for s in spans:
        if s.name == sc.REWARD_SPAN:
            index = bisect.bisect_right(starts, s.start_ns) - 1
            if index >= 0:
                out[s.span_id] = numbers[transition_calls[index].span_id]
    return out


def _tag(text: object, kind: str = "") -> str:
    """A pill holding ``text`` (escaped here)."""
    return f' <span{_attrs({"class": f"tag {kind}"})}>{_esc(text)}</span>'


def _call_link(uid: str, k: int) -> str:
    return f' <a{_attrs({"href": f"#{uid}c{k}"})}>call #{k}</a>'


def _name(name: object) -> str:
    return f"'{_str(name)}'" if name else "(unnamed)"


def _finite(value: object) -> float | None:
    """``value`` as a float where it is a finite real number (a boolean is none); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer beyond a float's range
        return None
    return number if math.isfinite(number) else None


def _num(value: object, spec: str = "+.4g") -> str:
    """A number formatted by ``spec`` (NaN and infinities as such); anything else as its repr, so that a string
    where a number belongs reads as one."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return format(value, spec)
        except OverflowError:  # an integer beyond a float's range
            pass
    return _str(value, repr)


def _str(value: object, show: Callable[[object], str] = str) -> str:
    """``show(value)``; a note instead where Python refuses to write an integer that long (its digit limit)."""
    try:
        return show(value)
    except ValueError:
        return f"(a {type(value).__name__} too long to show)"


def _esc(value: object) -> str:
    """``value`` as HTML text, escaped (quotes too): the one way an element's text enters the page."""
    return html.escape(_str(value), quote=True)


def _attrs(values: dict[str, object]) -> str:
    """`` name="value"`` for each item whose value is not None, the value escaped: the one way an attribute's
    value enters the page (``_esc`` keeps it inside its quotes)."""
    return "".join(f' {name}="{_esc(value)}"' for name, value in values.items() if value is not None)
