"""Intake: spans arrive over ZeroMQ (``collector``), are kept durably in SQLite (``store``), and each finished
rollout's span tree becomes an MDP episode of LLM calls (``episodes``)."""
