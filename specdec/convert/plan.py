"""What a family converter hands the writer: the architecture, its metadata and its tensors.

A :class:`Plan` is pure description; every tensor is read and converted only when the writer
asks for it (:attr:`OutTensor.read`), so a conversion holds one tensor in memory at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from gguf import GGUFValueType as VT
from gguf import Keys as K


@dataclass(frozen=True)
class OutTensor:
    """One GGUF tensor: llama.cpp ``name``, torch-order ``shape``, and ``read()`` returning it in
    fp32 with every llama.cpp convention already applied (permuted, shifted, stacked ...)."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


@dataclass
class Plan:
    """``arch``: llama.cpp's ``general.architecture``; ``metadata``: key -> (value, GGUF value
    type), keys as ``gguf.Keys`` spells them (``{arch}`` filled in); ``tensors`` in file order."""

    arch: str
    metadata: dict[str, tuple[Any, VT]] = field(default_factory=dict)
    tensors: list[OutTensor] = field(default_factory=list)

    def key(self, key: str) -> str:
        return key.format(arch=self.arch)

    def u32(self, key: str, value: int) -> None:
        self.metadata[self.key(key)] = (int(value), VT.UINT32)

    def f32(self, key: str, value: float) -> None:
        self.metadata[self.key(key)] = (float(value), VT.FLOAT32)

    def boolean(self, key: str, value: bool) -> None:
        self.metadata[self.key(key)] = (bool(value), VT.BOOL)

    def string(self, key: str, value: str) -> None:
        self.metadata[self.key(key)] = (str(value), VT.STRING)

    def array(self, key: str, values: list) -> None:
        """A non-empty array; the element type follows the first element (int -> INT32)."""
        assert values, f"empty array for {key}"
        self.metadata[self.key(key)] = (list(values), VT.ARRAY)

    def common_metadata(self, c, blocks: int | None = None, ffn: bool = True) -> None:
        """The keys every family writes from its config ``c``: block count (``blocks``, default
        ``c.num_hidden_layers``), context, widths, heads, norm epsilon, RoPE base, vocabulary."""
        self.u32(K.LLM.BLOCK_COUNT, c.num_hidden_layers if blocks is None else blocks)
        self.u32(K.LLM.CONTEXT_LENGTH, c.max_position_embeddings)
        self.u32(K.LLM.EMBEDDING_LENGTH, c.hidden_size)
        if ffn:
            self.u32(K.LLM.FEED_FORWARD_LENGTH, c.intermediate_size)
        self.u32(K.Attention.HEAD_COUNT, c.num_attention_heads)
        self.u32(K.Attention.HEAD_COUNT_KV, c.num_key_value_heads)
        self.f32(K.Attention.LAYERNORM_RMS_EPS, c.rms_norm_eps)
        self.f32(K.Rope.FREQ_BASE, c.rope_theta)
        self.u32(K.LLM.VOCAB_SIZE, c.vocab_size)

    def add(self, name: str, shape, read: Callable[[], torch.Tensor]) -> None:
        assert all(t.name != name for t in self.tensors[-8:]), f"tensor {name} planned twice"
        self.tensors.append(OutTensor(name, tuple(int(s) for s in shape), read))
