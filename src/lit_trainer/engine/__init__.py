"""The inference engine: the vLLM server the agents call (``server``), what it loads (``served_model``,
``templates/``), pushing new weights into it (``weight_sync``) and checking that they landed (``logprob_check``);
their settings are in ``config``."""
