"""Rollouts: the tasks of a run (``tasks``) and the dispatcher that hands rollouts to agent workers on any host,
retries what fails and records every attempt (``dispatcher``)."""
