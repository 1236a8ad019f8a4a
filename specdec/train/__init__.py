"""Training drafters for a target: batched, differentiable forwards, losses and checkpoint writing.

A new room above the engine: it uses the models and drafters, and nothing below it imports it.
:mod:`.dflash_batch` holds the DFlash pieces (config and init from a target, the batched block
forward, the loss, anchor sampling, saving a loadable drafter directory).
"""
