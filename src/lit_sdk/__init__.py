"""lit's agent-side SDK: traces an agent's LLM calls and rewards and sends them to the trainer.

It is light by design: wrapt, OpenTelemetry, openinference, msgpack and pyzmq. It never imports torch,
transformers or vLLM (a test checks this in a fresh interpreter), so it runs inside any agent process.
"""

__version__ = "0.1.0"
