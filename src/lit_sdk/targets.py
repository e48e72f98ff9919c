"""Where the user's functions come from: ``module:function`` names (the agent, the tasks), imported as ``python -m``
would, and checked for what lit calls them with."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from lit_sdk.trace import is_traced


def load_target(target: str, what: str = "agent") -> Callable[..., Any]:
    """``module:function`` → the function; the current directory is importable, as with ``python -m``. ``what``
    the function is for the messages (``agent``, ``tasks``)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        example = "examples.calc.agent:calc_agent" if what == "agent" else "examples.calc.tasks:make_tasks"
        raise ValueError(f"the {what} function must be given as module:function (e.g. {example}), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import the {what} module {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"the {what} module {module_name!r} has no function {attr!r}")
    return fn


def load_agent(target: str) -> Callable[..., Any]:
    """``load_target`` for the agent function, which must be marked by ``@lit.trace`` (without it a rollout
    records no root span, and every one fails) and take ``(task, llm)``: ValueError naming the fix otherwise."""
    fn = load_target(target, "agent")
    if not is_traced(fn):
        raise ValueError(f"the agent function {target} is not decorated with @lit.trace: its rollouts would record "
                         "nothing the trainer can use, and every one would fail. Put @lit.trace on the line above "
                         f"`def {getattr(fn, '__name__', target)}`")
    check_takes(fn, ("task", "llm"), f"the agent function {target}")
    return fn


def check_takes(fn: Callable[..., Any], params: tuple[str, ...], subject: str, note: str = "") -> None:
    """ValueError ``<subject> must take (<params>), as lit calls it; its signature is ...<note>`` unless ``fn`` can
    be called with ``len(params)`` positional arguments; nothing when it has no signature to read (a builtin, a C
    callable: the call will tell)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*params)
    except TypeError:
        raise ValueError(f"{subject} must take ({', '.join(params)}), as lit calls it; its signature is "
                         f"{signature}{note}") from None
