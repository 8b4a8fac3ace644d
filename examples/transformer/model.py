"""A small decoder-only transformer trained on synthetic tokens: the precision test's model.

Token and position embeddings, ``LAYERS`` pre-LN blocks (layer_norm, q/k/v/o linear projections, a causal
attention written out as ``torch.matmul``, a scale, ``masked_fill`` and ``F.softmax``, then a gelu MLP), a final
layer_norm and a linear head, trained with AdamW on next-token prediction, all in float32 with random weights.
The attention is spelled out (no ``scaled_dot_product_attention``) so that each of its operators is a call of
its own in the dump, where a fault can be named.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D_MODEL, HEADS, LAYERS, SEQ = 128, 64, 4, 2, 32
MASKED = -1e4  # a masked score: finite, so that the statistics of the scores stay finite too


class Attention(nn.Module):
    """Causal multi-head self-attention: q, k, v and output projections around matmul, softmax, matmul."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:  # (b, t, d) -> (b, h, t, d / h)
            return y.view(b, t, h, d // h).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h)
        weights = F.softmax(scores.masked_fill(causal, MASKED), dim=-1)
        return self.o(torch.matmul(weights, v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-LN transformer block: attention and a gelu MLP, each around a residual add."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Embeddings, ``layers`` blocks, a final layer_norm and the head: about 120K parameters."""

    def __init__(
        self, vocab: int = VOCAB, d: int = D_MODEL, heads: int = HEADS, layers: int = LAYERS, seq: int = SEQ
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # True above the diagonal: a position attends to itself and the positions before it
        self.register_buffer(
            "causal", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        causal = self.causal[:t, :t]
        for block in self.blocks:
            x = block(x, causal)
        return self.head(self.ln(x))


def synthetic_batches(
    steps: int, batch: int = 8, seq: int = SEQ, vocab: int = VOCAB
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random token sequences and their next tokens, from a generator of their own: the same on every device."""
    gen = torch.Generator().manual_seed(2024)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
