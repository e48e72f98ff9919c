"""lit's gateway: the HTTP front of the vLLM servers where every LLM call of a rollout is recorded (server.py)."""
