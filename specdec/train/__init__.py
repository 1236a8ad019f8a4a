"""Training helpers: batched, differentiable forwards that mirror what the drafters compute at inference.

Nothing in the engine, the drafters or the models imports this package.
"""
