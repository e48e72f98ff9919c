"""An agent module whose import ends a worker process with code 3, as an agent that fails only where the worker
runs does (an environment variable, a file or a GPU that the trainer's process has and the worker's lacks); the
trainer's own import of it, which checks the agent before anything starts, works."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lit_sdk as lit

if Path(sys.argv[0]).match("lit_sdk/worker.py"):  # python -m lit_sdk.worker
    print("exits_in_workers: this worker has no GPU_TOKEN", file=sys.stderr, flush=True)
    os._exit(3)


@lit.trace
async def agent(task, llm):
    return 1.0
