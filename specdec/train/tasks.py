"""What ``specdec train`` trains: one task per drafter kind, each owning its drafter's weights,
its loss on a batch (the frozen target's features given), an inference copy for the held-out
tau, and how it is saved. The math lives in :mod:`.dflash_batch` and :mod:`.mtp_batch`."""

from __future__ import annotations

import copy
import json
import os

import torch

from ..errors import ConfigError


def pick_mask_token(tok, vocab_size: int) -> int:
    """A token for DFlash's mask rows: a special (added) token named like a mask, else the last
    special token that is neither BOS/EOS nor used by the chat template."""
    added = getattr(getattr(tok, "tok", None), "get_added_tokens_decoder", lambda: {})()
    special = sorted((i, a.content) for i, a in added.items() if getattr(a, "special", False) and i < vocab_size)
    for i, name in special:
        if "mask" in name.lower():
            return i
    used = set(tok.eos_ids) | ({tok.bos_id} if getattr(tok, "bos_id", None) is not None else set())
    template = tok.chat_template or ""
    free = [i for i, name in special if i not in used and name not in template]
    if not free:
        raise ConfigError("found no unused special token for DFlash's mask rows; pass --mask-token-id")
    return free[-1]


class _Task:
    kind = ""
    capture: tuple[int, ...] = ()
    show: tuple[str, ...] = ()
    provenance: dict = {}
    extra_files: dict = {}  # more files written into the drafter directory (run.py: draft_vocab.json)

    def parameters(self):
        return self.module.parameters()

    def train(self):
        self.module.train()

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, sd):
        self.module.load_state_dict(sd)

    def _notes(self, summary: dict) -> dict[str, str]:
        info = {**self.provenance, **summary, "recipe": self.recipe()}
        lines = [f"# {self.kind} drafter trained by `specdec train`", ""]
        for k, v in info.items():
            lines.append(f"- **{k}**: {v if not isinstance(v, (dict, list)) else json.dumps(v)}")
        return {"TRAINING.md": "\n".join(lines) + "\n", "training.json": json.dumps(info, indent=2) + "\n",
                **self.extra_files}


class DFlashTask(_Task):
    kind = "dflash"
    show = ("acc1", "accept")

    def __init__(self, a, loaded):
        from ..drafters.dflash_model import DFlashConfig
        from .dflash_batch import new_dflash_config, new_dflash_model

        self.target = loaded.model
        if a.init is not None:  # continue from a trained drafter: its config and weights
            from ..config import read_json
            from ..drafters.dflash import load_dflash_drafter

            self.cfg = read_json(os.path.join(a.init, "config.json"))
            self.module = load_dflash_drafter(a.init, loaded).model.float().requires_grad_(True)
        else:
            mask = a.mask_token_id
            if mask is None:
                mask = pick_mask_token(loaded.tokenizer, self.target.config.vocab_size)
            elif not 0 <= mask < self.target.config.vocab_size:
                raise ConfigError(f"--mask-token-id {mask} is outside the vocabulary "
                                  f"(0..{self.target.config.vocab_size - 1})")
            self.cfg = new_dflash_config(self.target, a.layers or 5, a.block_size or 16, mask_token_id=mask)
            self.module = new_dflash_model(self.target, self.cfg)
        self.block_size = self.module.config.block_size
        self.anchors, self.gamma = a.anchors, a.gamma
        self.capture = tuple(DFlashConfig.from_dict(self.cfg).target_layer_ids)

    def recipe(self) -> dict:
        return {"kind": self.kind, "config": self.cfg, "anchors": self.anchors, "gamma": self.gamma}

    def loss(self, ids, valid, out, gen):
        from .dflash_batch import dflash_block_hidden, dflash_loss, sample_anchors, trim_anchors

        anchors, ok = sample_anchors(valid, self.anchors, self.block_size, generator=gen)
        anchors, ok = trim_anchors(anchors, ok)
        h = dflash_block_hidden(self.module, self.target.embed_tokens.weight, out.captured, ids, anchors, ok)
        loss, st = dflash_loss(self.module, h, self.target.head_weight(), ids, anchors, ok, valid, self.gamma)
        return loss, {"acc1": st["acc"][0], "accept": st["accept_len"]}

    def inference_drafter(self):
        from ..drafters.dflash import DFlashDrafter

        m = copy.deepcopy(self.module).to(self.target.dtype).eval().requires_grad_(False)
        return DFlashDrafter(m, self.target, None, "the drafter in training"), self.block_size - 1

    def save(self, out: str, summary: dict) -> None:
        from .dflash_batch import save_dflash_dir

        save_dflash_dir(self.module, self.cfg, out, extra_files=self._notes(summary))


class MTPTask(_Task):
    kind = "mtp"
    show = ("acc1", "acc2")

    def __init__(self, a, loaded):
        from ..drafters.mtp_dir import new_mtp_block

        self.target = loaded.model
        self.steps = a.steps
        if a.init is not None:  # continue from a trained head
            from ..drafters.mtp_dir import load_mtp_dir

            self.module = load_mtp_dir(a.init, loaded).block.float().requires_grad_(True)
            return
        last = len(self.target.layers) - 1
        try:
            block = new_mtp_block(self.target, init_from_layer=last, generator=torch.Generator().manual_seed(a.seed))
        except ConfigError:  # a hybrid target whose last layer is not full attention: random init
            block = new_mtp_block(self.target, generator=torch.Generator().manual_seed(a.seed))
        self.module = block.float()

    def recipe(self) -> dict:
        return {"kind": self.kind, "steps": self.steps}

    def loss(self, ids, valid, out, gen):
        from .mtp_batch import mtp_chain_loss

        t = self.target
        res = mtp_chain_loss(self.module, t.embed, t.head_weight(), out.hidden, ids, valid, self.steps, t.rotary,
                             softcap=t.final_logit_softcap)
        stats = {f"acc{s + 1}": res.step_acc[s] for s in range(self.steps)}
        return res.loss, stats

    def inference_drafter(self):
        from ..drafters.mtp import MTPDrafter

        b = copy.deepcopy(self.module).to(self.target.dtype).eval().requires_grad_(False)
        return MTPDrafter(b, self.target), self.steps

    def save(self, out: str, summary: dict) -> None:
        from ..drafters.mtp_dir import save_mtp_dir

        save_mtp_dir(self.module, self.target, out, steps=self.steps, extra_files=self._notes(summary))


def make_task(a, loaded):
    loaded.model.requires_grad_(False)  # frozen: embedding, head and features get no gradient
    return {"dflash": DFlashTask, "mtp": MTPTask}[a.kind](a, loaded)
