"""LightningRL as pure functions: credit per LLM call (``credit``), group-relative advantages over the rollouts of
one task (``advantages``), and the token-level clipped policy-gradient objective (``loss``).

Each takes tensors or Episodes plus a small frozen config and returns tensors and a metrics dict; none of them
knows about models, optimizers, ZeroMQ or the store.
"""
