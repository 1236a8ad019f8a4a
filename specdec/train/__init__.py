"""``specdec train``: drafters trained by self-distillation from their target.

``data`` makes and caches the target's own replies; ``dflash_batch`` and ``mtp_batch`` are the
batched, differentiable drafter forwards and losses (the same math as inference, tested against
it); ``trainer`` runs the loop (schedule, checkpoints, resume, held-out tau).
"""
