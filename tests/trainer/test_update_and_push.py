"""One step's update and push in the loop (``loop.update_and_push``): the fleet held throughout, its servers asleep
during the update only (``inference.layout = "colocated"``: they wake before the push, which needs them), the
update's and the push's metrics together. The fleet and the trainers are stand-ins that record the order (the real
loop with a real vLLM: every e2e run, with layout "shared"; vLLM's sleep mode needs a GPU, which CI has not)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from lit_trainer.run import loop, pipeline


def test_the_update_runs_with_vllm_asleep_and_the_push_after_it_wakes(monkeypatch):
    events = []

    @contextlib.contextmanager
    def recorded(name):
        events.append(f"{name} on")
        yield
        events.append(f"{name} off")

    fleet = SimpleNamespace(hold=lambda: recorded("hold"), asleep=lambda: recorded("asleep"))
    trainers = SimpleNamespace(update=lambda job, cfg, store: events.append(f"update {job}") or {"loss": 1.0},
                               gather=lambda: events.append("gather") or {"w": 1})
    monkeypatch.setattr(pipeline, "push", lambda fleet, state, step: events.append(f"push {step}") or {"time/sync": 2})
    metrics = loop.update_and_push("job", None, 3, trainers, SimpleNamespace(fleet=fleet, store=None))
    assert metrics == {"loss": 1.0, "time/sync": 2}
    assert events == ["hold on", "asleep on", "update job", "asleep off", "gather", "push 3", "hold off"]
