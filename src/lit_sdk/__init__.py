"""lit's agent-side SDK: traces an agent's LLM calls and rewards and sends them to the trainer.

    import lit_sdk as lit
    lit.instrument(llm_base_urls=["http://127.0.0.1:8000/v1"])

    @lit.trace
    def solve(task): ...        # one rollout; a numeric return value is its final reward

It is light by design: wrapt, OpenTelemetry, openinference, msgpack and pyzmq. It never imports torch,
transformers or vLLM (a test checks this in a fresh interpreter), so it runs inside any agent process.
"""

from lit_sdk._context import assign as assign_rollout
from lit_sdk.instrument import flush, instrument, uninstrument
from lit_sdk.resources import LLM
from lit_sdk.trace import reward, trace

__version__ = "0.1.0"
__all__ = ["LLM", "assign_rollout", "flush", "instrument", "uninstrument", "reward", "trace"]
