"""The trainer processes of a run and what they do together.

One process (the main one) runs the loop, the services and the pushes into vLLM. Under ``torchrun --nproc_per_node
N`` the others wait in ``follow`` and join each call that needs them: every update (each takes its share), and,
with the policy sharded (each holds a part of the weights), every other use of the weights: gathering them for a
push, scoring the sync check, writing a checkpoint. The loop calls a ``Trainers`` method and need not know which
of these it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from lit_trainer.engine.weight_sync import Adapters
from lit_trainer.intake.rows import Store
from lit_trainer.learner import checkpoint as ckpt
from lit_trainer.learner import distributed
from lit_trainer.learner.policy import Policy
from lit_trainer.results.runs import Checkpoint
from lit_trainer.run import pipeline

T = TypeVar("T")


class Trainers:
    """The policy in every trainer process. ``dtype``, ``device``: how the weights are gathered for vLLM (its
    serving dtype; the CPU for the ``shm`` transport, where the gathered copy need not take room on the GPU)."""

    def __init__(self, policy: Policy, dtype: torch.dtype | None = None, device: str | None = None,
                 served: dict[str, str] | None = None) -> None:
        """``served``: with one adapter per role, each adapter's served name in vLLM."""
        self.policy, self.dtype, self.device, self.served = policy, dtype, device, served or {}
        self.main = policy.accelerator.is_main_process
        self._last: dict[str, Any] | None = None

    def restore(self, start: Checkpoint | None) -> ckpt.TrainState:
        """In every process: the checkpoint ``start`` into the policy (``learner/checkpoint.restore``); its
        training state, or a fresh one without a checkpoint."""
        return ckpt.restore(start, self.policy) if start else ckpt.TrainState()

    def update(self, job: pipeline.UpdateJob, cfg: Any, store: Store) -> dict[str, float]:
        """One step's update, each process taking its share; its metrics."""
        return self._together(pipeline.update, job, cfg, main_only={"store": store})

    def gather(self) -> dict[str, Any] | Adapters:
        """The policy's whole weights for vLLM, or its adapters by served name with one per role. Unsharded they
        are the policy's own tensors; sharded, every process takes part and the main process keeps the copy
        (``latest``)."""
        if self.policy.adapters:
            return Adapters({self.served[name]: state for name, state in self.policy.adapter_states().items()})
        if not self.policy.sharded:
            return self.policy.state_dict()
        self._last = self._together(pipeline.weights, self.dtype, self.device)
        return self._last

    def latest(self) -> dict[str, Any] | Adapters:
        """The weights last gathered, for a vLLM started again between two pushes: from whatever thread notices the
        death, without the other processes (which may be anywhere in their loop): the main process gathers once
        before the services start. Sharded, that copy costs the main process one whole model in the serving dtype
        (learner/memory.py, ``gathered``)."""
        if self.policy.adapters:
            return self.gather()
        return self._last if self._last is not None else self.policy.state_dict()

    def score(self, samples: Sequence[Any], adapter: str | None = None) -> list[Any]:
        """The trainer's logprobs of vLLM's samples (by ``adapter``, one role's), for the sync check
        (``pipeline.score``)."""
        return self._together(pipeline.score, samples, adapter)

    def save(self, output_dir: Path, base_dir: Path, state: ckpt.TrainState, keep: int) -> None:
        """The checkpoint of ``state.step`` (``learner/checkpoint.save``)."""
        self._together(_save, output_dir, base_dir, state, keep)

    def follow(self) -> None:
        """A process other than the main one: run what the main process asks of every process until it ends the
        run (``finish``)."""
        while (call := distributed.broadcast()) is not None:
            fn, args = call
            fn(self.policy, *args)
        distributed.leave()

    def finish(self) -> None:
        """The main process's end of the run: the other processes' ``follow`` returns."""
        distributed.broadcast(None)
        distributed.leave()

    def _together(self, fn: Callable[..., T], *args: Any, main_only: dict[str, Any] | None = None) -> T:
        """``fn(policy, *args)`` here and, where the other processes must join, in each of them too: always for the
        update, and for every use of the weights when they are sharded. ``main_only``: keyword arguments for this
        process's call alone (the store)."""
        if self.policy.accelerator.num_processes > 1 and (self.policy.sharded or fn is pipeline.update):
            distributed.broadcast((fn, args))
        return fn(self.policy, *args, **(main_only or {}))


def _save(policy: Policy, output_dir: Path, base_dir: Path, state: ckpt.TrainState, keep: int) -> None:
    """``learner/checkpoint.save`` with the policy first, as ``Trainers._together`` calls it in every process."""
    ckpt.save(output_dir, policy, base_dir, state, keep)
