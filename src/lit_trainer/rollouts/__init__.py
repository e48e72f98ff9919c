"""Rollouts: the tasks of a run (``tasks``), the services a run starts (``services``: store, collector, vLLM,
dispatcher, local workers) and the dispatcher that hands rollouts to agent workers (``dispatcher``)."""
