"""The vLLM server(s) the training loop trains, as the loop uses them: the policy's weights go into every server
through ``Engine.push_weights`` (one ``WeightSync`` each), and a server dying is recovered from wherever the loop
notices it."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, replace
from typing import Any

from lit_trainer.config import TrainConfig
from lit_trainer.engine.server import ServerDiedError
from lit_trainer.engine.weight_sync import SyncReport, WeightSync, WeightSyncError


@dataclass
class PushReport:
    """One push of the weights into every server, one after the other: each server's ``SyncReport``."""

    version: str
    reports: list[SyncReport]

    @property
    def total_s(self) -> float:
        """The whole push (the servers were synced one after the other)."""
        return sum(r.total_s for r in self.reports)

    @property
    def slowest_s(self) -> float:
        """The slowest server's sync."""
        return max((r.total_s for r in self.reports), default=0.0)


class Engine:
    """The vLLM servers the loop trains (``svc.servers``), as the loop uses them: the policy's weights go into
    every one through ``push_weights`` (a ``WeightSync`` each; with the ``shm`` transport each writes its own copy
    of the weights to shared memory, one per server). A server dying is recovered from wherever it is noticed:
    it alone is started again on the same port with the policy's current weights (``restart``), the others are
    left alone, and ``restarts`` counts the servers started again."""

    def __init__(self, svc: Any, policy: Any, cfg: TrainConfig):
        self.svc, self.policy, self.cfg = svc, policy, cfg
        self.syncs = [self._open_sync(i) for i in range(len(svc.servers))]
        self.restarts = 0
        self.version = "0"
        """The weight version the servers hold: the last one pushed (the base model's is 0)."""
        # With asynchronous rollouts (loop.Rollouts) the rollouts' thread may restart a server while the loop's
        # thread updates the policy and pushes its weights (``hold``): one at a time.
        self._lock = threading.RLock()

    def hold(self) -> threading.RLock:
        """Held by the loop while it changes the policy's weights and pushes them, so that a server started again
        meanwhile by the rollouts' thread (``restart``) gets whole weights of a version the others hold."""
        return self._lock

    @property
    def sync(self) -> WeightSync:
        """The first server's."""
        return self.syncs[0]

    @property
    def base_url(self) -> str:
        """The first server's."""
        return self.syncs[0].base_url

    @property
    def base_urls(self) -> list[str]:
        """Every server's, in server order."""
        return [s.base_url for s in self.syncs]

    def push_weights(self, state: Any, version: str) -> PushReport | None:
        """``WeightSync.push_weights`` into every server in turn; a server that has died (during the update, or
        during this push) is started again with the policy's weights of ``version`` instead. The report; None
        when a server was started again (that took the time)."""
        with self._lock:
            report = self._push_weights(state, version)
            self.version = version
            return report

    def _push_weights(self, state: Any, version: str) -> PushReport | None:
        reports, died = [], []
        for index, sync in enumerate(self.syncs):
            server = self.svc.servers[index]
            try:
                server.check_alive()
                reports.append(sync.push_weights(state, version=version))
            except (ServerDiedError, WeightSyncError) as exc:
                if not server.exited(within_s=5.0):  # an error of a live server is no death: it stops the run
                    raise
                died.append((index, exc))
        for index, exc in died:
            self.restart_server(index, version, f"before the weights of step {version} reached it "
                                                f"({first_line(exc)})")
        return None if died else PushReport(version, reports)

    def restart(self, when: str, restarts_seen: int | None = None) -> None:
        """Start the servers that died ``when`` again (all of them when none is seen exited: the caller saw one
        die), and push the policy's current weights into each as the version the servers hold. ``restarts_seen``:
        ``restarts`` when the caller began what saw the death; if a server was started again since (by the loop's
        weight push, which found it dead too), there is nothing left to do."""
        with self._lock:
            if restarts_seen is not None and self.restarts != restarts_seen:
                return
            dead = [i for i, server in enumerate(self.svc.servers) if server.exited()]
            for index in dead or range(len(self.syncs)):
                self.restart_server(index, self.version, when)

    def restart_server(self, index: int, version: str, when: str) -> None:
        """Start server ``index`` again after it died ``when``, with the policy's current weights as ``version``."""
        with self._lock:
            which = f"vLLM server {index} ({self.syncs[index].base_url})" if len(self.syncs) > 1 else "vLLM"
            print(f"lit: {which} died {when}; starting it again with the current weights", file=sys.stderr)
            self.syncs[index].close()
            self.svc.restart_server(index)
            self.restarts += 1
            self.syncs[index] = self._open_sync(index)
            self.syncs[index].push_weights(self.policy.state_dict(), version=version)

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()

    def _open_sync(self, index: int) -> WeightSync:
        config = self.cfg.weight_sync
        if index:  # each server's NCCL group meets on a port of its own
            config = replace(config, nccl_master_port=config.nccl_master_port + index)
        return WeightSync(self.svc.servers[index].base_url, config)


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
