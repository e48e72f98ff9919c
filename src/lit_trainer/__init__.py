"""lit's trainer: collects spans from agents, rebuilds episodes, runs LightningRL and syncs weights into vLLM.

It imports torch, transformers and vLLM only inside the modules that need them, so ``lit --help`` stays instant.
"""

__version__ = "0.1.0"
