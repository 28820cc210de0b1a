"""count_flops against the closed form: 2*m*n*k per matrix product, x3 with backward.

The backward pass of ``y = x @ W`` is two products of the forward's size (the
gradient of ``W`` and of ``x``); the gradient of the data is never computed, so
the first layer (its input is data) costs 2x, not 3x.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from funcaccel.flops import count_flops


def _linear_stack(widths: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _mm(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def test_count_flops_of_a_linear_stack_is_the_closed_form() -> None:
    widths, rows = [12, 32, 24, 8], 7
    net = _linear_stack(widths)
    products = [_mm(rows, b, a) for a, b in zip(widths, widths[1:], strict=False)]
    x = torch.randn(rows, widths[0])
    assert count_flops(net, x, backward=False) == sum(products)
    # The first layer's input is data: its gradient is not computed.
    assert count_flops(net, x) == 2 * products[0] + 3 * sum(products[1:])
    # Only the parameters are differentiated, as in training: an input that
    # requires a gradient does not change the count.
    assert count_flops(net, x.requires_grad_()) == 2 * products[0] + 3 * sum(
        products[1:]
    )


def test_count_flops_counts_a_leading_batch_dimension_and_meta_models() -> None:
    with torch.device("meta"):
        net = _linear_stack([6, 10, 3])
    x = torch.empty(4, 5, 6, device="meta")  # 20 rows
    expected = 2 * _mm(20, 10, 6) + 3 * _mm(20, 3, 10)
    assert count_flops(net, x) == expected
    assert net[0].weight.device.type == "meta"  # left as it was


class _Block(nn.Module):
    """Pre-norm attention (explicit matmuls) and a 4x MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o(att.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm2(x))))
        return out


class _TinyTransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(x)
        return logits


def test_count_flops_of_a_tiny_transformer_is_the_closed_form() -> None:
    vocab, dim, heads, layers, b, s = 50, 16, 4, 2, 3, 9
    model = _TinyTransformer(vocab, dim, heads, layers)
    ids = torch.randint(0, vocab, (b, s))
    tokens, dh = b * s, dim // heads
    per_block = (
        4 * _mm(tokens, dim, dim)  # q, k, v, o
        + 2 * _mm(tokens, 4 * dim, dim)  # up, down
        + 2 * b * heads * _mm(s, s, dh)  # q @ k^T, att @ v
    )
    forward = layers * per_block + _mm(tokens, vocab, dim)
    assert count_flops(model, {"input_ids": ids}, backward=False) == forward
    # Every product's inputs descend from the embedding's weight: all need a
    # gradient, so the backward pass is exactly twice the forward.
    assert count_flops(model, {"input_ids": ids}) == 3 * forward
    assert count_flops(model, (ids,)) == 3 * forward


def test_count_flops_uses_the_outputs_loss_or_loss_fn() -> None:
    net = nn.Linear(4, 3)
    x = torch.zeros(2, 4)
    one = _mm(2, 3, 4)

    def first_column(out: torch.Tensor) -> torch.Tensor:
        return out[:, 0].sum()

    assert count_flops(net, x, loss_fn=first_column) == 2 * one


def test_count_flops_refuses_what_it_cannot_count() -> None:
    with pytest.raises(TypeError, match=r"count_flops: model must be an nn.Module"):
        count_flops(lambda x: x, torch.zeros(1))  # type: ignore[arg-type]
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match=r"count_flops: backward must be False"):
        count_flops(frozen, torch.zeros(1, 2))
    assert count_flops(frozen, torch.zeros(1, 2), backward=False) == _mm(1, 2, 2)

    class _Ints(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.long()

    with pytest.raises(ValueError, match=r"loss_fn=\.\.\."):
        count_flops(_Ints(), torch.zeros(2))


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, -1).permute(2, 0, 3, 1, 4)
        out: torch.Tensor = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True
        )
        return out


def test_count_flops_counts_scaled_dot_product_attention_on_cpu() -> None:
    b, s, dim, heads = 2, 6, 8, 2
    x = torch.randn(b, s, dim)
    products = b * heads * _mm(s, s, dim // heads)  # one of q @ k^T, p @ v
    qkv = _mm(b * s, 3 * dim, dim)
    net = _Attention(dim)
    assert count_flops(net, x, backward=False) == qkv + 2 * products
    # Backward: the weight's gradient only (x is data), and five attention
    # products (scores recomputed; the gradients of p, v, q and k).
    assert count_flops(net, x) == 2 * qkv + 7 * products


def test_count_flops_of_a_tiny_transformers_llama_is_the_closed_form() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    h, f, layers, vocab, heads, kv_heads, b, s = 32, 64, 2, 40, 4, 2, 3, 10
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=f,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    ids = torch.zeros((b, s), dtype=torch.long)
    tokens, dh = b * s, h // heads
    projections = layers * (
        2 * _mm(tokens, h, h)  # q, o
        + 2 * _mm(tokens, kv_heads * dh, h)  # k, v (grouped-query)
        + 3 * _mm(tokens, f, h)  # gate, up, down
    ) + _mm(tokens, vocab, h)  # the head
    # scaled_dot_product_attention: q @ k^T and p @ v over all query heads.
    attention = layers * b * heads * _mm(s, s, dh)
    assert count_flops(model, {"input_ids": ids}, backward=False) == (
        projections + 2 * attention
    )
    # Backward: two more products per projection, five attention products.
    assert count_flops(model, {"input_ids": ids}) == 3 * projections + 7 * attention
