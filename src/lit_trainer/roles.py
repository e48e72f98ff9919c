"""The ``[roles]`` table: which LoRA adapter each agent of a multi-agent system trains and is served by.

    [roles]
    writer = "own"        # an adapter of its own, trained on the writer's calls alone
    rewriter = "own"
    checker = "base"      # the base model, never trained
    judge = "adapters/judge"   # a fixed adapter folder (peft's format), served, never trained
    # "shared": one adapter that every "shared" agent trains and is served by

Names are the agents' as lit records them (LangGraph node, AutoGen agent, Agents SDK agent, ``@lit.trace(agent=)``):
the names ``agent.agents`` selects by. An agent the table does not name is served by the base model and not trained.
vLLM serves the base model and one LoRA adapter per trained or fixed adapter (``--enable-lora``); lit's gateway puts
the adapter of the calling agent in each request's ``model``, so the agent's code never names one. Without a table,
every selected agent trains one policy, as before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

OWN, SHARED, BASE = "own", "shared", "base"
SHARED_ADAPTER = "shared"
"""The adapter every ``shared`` agent trains."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class Roles:
    """A checked role table and the names it gives: adapters (peft's names, ``adapters/<name>/`` in a checkpoint)
    and the served model names of vLLM (``<served>-<adapter>``)."""

    table: Mapping[str, str]
    """Agent name -> ``own``, ``shared``, ``base`` or an adapter folder."""
    served: str = "policy"
    """The base model's served name (``inference.served_model_name``)."""

    def __post_init__(self) -> None:
        names: dict[str, str] = {}
        for agent, value in self.table.items():
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"roles.{agent} must be \"own\", \"shared\", \"base\" or an adapter folder, got "
                                 f"{value!r}")
            if value not in (OWN, SHARED, BASE) and not (Path(value).expanduser() / "adapter_config.json").is_file():
                raise ValueError(f"roles.{agent} = {value!r} is neither \"own\", \"shared\" nor \"base\", and no "
                                 "adapter folder (peft's format: adapter_config.json) is there")
            adapter = self.adapter_of(agent) or self._fixed_name(agent)
            if adapter is None:
                continue
            other = names.get(adapter)
            if other is not None and self.table[other] != value:
                raise ValueError(f"roles.{agent} and roles.{other} would both be served as adapter {adapter!r}: "
                                 "rename one agent, or give the folders different names")
            names[adapter] = agent

    def adapter_of(self, agent: str) -> str | None:
        """The trained adapter ``agent``'s calls train and are served by; None when it trains none."""
        value = self.table.get(agent)
        if value == OWN:
            name = _UNSAFE.sub("_", agent)
            return name if name != SHARED_ADAPTER else "shared_"
        return SHARED_ADAPTER if value == SHARED else None

    def _fixed_name(self, agent: str) -> str | None:
        value = self.table.get(agent)
        return _UNSAFE.sub("_", Path(value).expanduser().name) if value not in (None, OWN, SHARED, BASE) else None

    @property
    def trained_agents(self) -> tuple[str, ...]:
        """The agents whose calls are trained (``own`` and ``shared``), as ``agent.agents`` selects them."""
        return tuple(agent for agent in self.table if self.adapter_of(agent))

    @property
    def adapters(self) -> tuple[str, ...]:
        """The trained adapters, in table order."""
        return tuple(dict.fromkeys(a for agent in self.table if (a := self.adapter_of(agent))))

    @property
    def fixed(self) -> dict[str, str]:
        """Served name -> folder of each fixed adapter (vLLM's ``--lora-modules``)."""
        return {self.served_name(agent): str(Path(value).expanduser().resolve()) for agent, value in self.table.items()
                if self._fixed_name(agent)}

    @property
    def served_adapters(self) -> int:
        """How many adapters vLLM serves at once (``inference.max_loras`` must allow them)."""
        return len(self.adapters) + len(self.fixed)

    def served_name(self, agent: str | None) -> str:
        """The ``model`` a call of ``agent`` is served by: its adapter's name, or the base model's."""
        adapter = (self.adapter_of(agent) or self._fixed_name(agent)) if agent is not None else None
        return self.adapter_served_name(adapter) if adapter else self.served

    def adapter_served_name(self, adapter: str) -> str:
        """The served name of trained adapter ``adapter``."""
        return f"{self.served}-{adapter}"

    def routes(self) -> dict[str, str]:
        """Agent name -> served model name, for lit's gateway (an agent not named goes to the base model)."""
        return {agent: self.served_name(agent) for agent in self.table}

    def adapter_map(self) -> dict[str, str]:
        """Agent name -> trained adapter, for the learner."""
        return {agent: adapter for agent in self.table if (adapter := self.adapter_of(agent))}

    def on_base(self) -> Roles:
        """This table with every trained agent served by the base model (``lit eval`` of the base model)."""
        return Roles({agent: BASE if self.adapter_of(agent) else value for agent, value in self.table.items()},
                     self.served)

    def frozen_into(self, folders: Mapping[str, Path]) -> Roles:
        """This table with each trained adapter replaced by its saved folder (``folders``: adapter -> folder, a
        checkpoint's): what ``lit eval`` serves."""
        table = {agent: str(folders[a]) if (a := self.adapter_of(agent)) else value
                 for agent, value in self.table.items()}
        return Roles(table, self.served)
