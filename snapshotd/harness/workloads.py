"""Training workloads for the benchmarks: a small GPT-style transformer, synthetic batches, a training loop.

Everything is deterministic given its seeds and the number of torch threads: the model initialises from its
own ``torch.Generator`` (the global RNG is left alone), batches come from a generator the caller owns, and there
is no dropout. Typical use::

    cfg = config_for_params(5_000_000)
    model = GPT(cfg, seed=0)
    opt = make_optimizer(model)
    losses = train_steps(model, opt, cfg, steps=30, batch=8, seed=1)

Benchmarks that act between steps (snapshot overhead, recovery) pass ``on_step`` to :func:`train_steps`, or
drive :func:`train_step` themselves with batches from :func:`make_batch`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "GPTConfig",
    "config_for_params",
    "make_batch",
    "make_optimizer",
    "train_step",
    "train_steps",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab: int = 4096
    """Token vocabulary size."""
    d_model: int = 256
    """Width of the residual stream; a multiple of ``n_head``."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    seq_len: int = 128
    """Longest sequence (size of the position embedding)."""
    tie_weights: bool = True
    """Share the output head's weight with the token embedding."""

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layer", "n_head", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_head {self.n_head}")

    @property
    def n_params(self) -> int:
        """Exact parameter count of ``GPT(self)`` (tied weights counted once)."""
        return _count(self.vocab, self.d_model, self.n_layer, self.seq_len, self.tie_weights)


def _count(vocab: int, d: int, n_layer: int, seq_len: int, tie_weights: bool) -> int:
    per_block = 12 * d * d + 13 * d  # qkv + proj + 2 MLP linears (with biases) + 2 LayerNorms
    head = 0 if tie_weights else vocab * d
    return vocab * d + seq_len * d + n_layer * per_block + 2 * d + head


def config_for_params(
    n_params: int, *, vocab: int = 4096, seq_len: int = 128, tie_weights: bool = True
) -> GPTConfig:
    """A GPT shape with about ``n_params`` parameters.

    Widths are multiples of 32 and heads 32 or 64 wide; among the shapes whose width-to-depth ratio lies in
    [32, 128] (GPT-2's is 64), picks the one whose count is nearest ``n_params`` (in ratio), then the one
    nearest ratio 64. Tiny targets get the smallest shape (width 32, one layer).

    Raises:
        ValueError: ``n_params < 1``.
    """
    if n_params < 1:
        raise ValueError(f"n_params must be >= 1, got {n_params}")
    shapes = [
        (d_model, n_layer)
        for n_layer in range(1, 129)
        for d_model in range(max(32, 32 * n_layer), 128 * n_layer + 1, 32)
    ]
    d_model, n_layer = min(
        shapes,
        key=lambda s: (
            abs(math.log(_count(vocab, s[0], s[1], seq_len, tie_weights) / n_params)),
            abs(math.log(s[0] / s[1] / 64)),
        ),
    )
    head_dim = 64 if d_model % 64 == 0 else 32
    return GPTConfig(
        vocab=vocab,
        d_model=d_model,
        n_layer=n_layer,
        n_head=d_model // head_dim,
        seq_len=seq_len,
        tie_weights=tie_weights,
    )


class _Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then a 4x GELU MLP, each on a residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder: token + position embedding, pre-LN blocks, final LayerNorm, linear head.

    Args:
        cfg: the shape.
        seed: seeds the weight initialisation (normal(0, 0.02), residual projections scaled by
            1/sqrt(2 * n_layer), zero biases), from a private generator.
    """

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)`` for token ids ``idx`` of shape ``(batch, seq)``, ``seq <= seq_len``."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens, the model takes at most {self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_batch(cfg: GPTConfig, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic batch: ``(x, y)`` int64 of shape ``(batch, seq_len)``, ``y`` shifted by one.

    Each row counts from a random start with a random stride (1-8) modulo ``vocab``, so the next token is
    predictable from context and the loss falls as the model learns (unlike uniform random tokens). Consumes
    ``generator``; the same generator state gives the same batch.
    """
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 9, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_optimizer(model: nn.Module, *, lr: float = 1e-3, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters (the optimizer whose moments a snapshot carries)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step of next-token cross-entropy on ``(x, y)``; returns the loss before the step."""
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def train_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    cfg: GPTConfig,
    steps: int,
    batch: int,
    seed: int,
    *,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Run ``steps`` optimizer steps on batches drawn from a generator seeded with ``seed``.

    Args:
        model: a model taking ``(batch, seq_len)`` token ids and returning logits (e.g. :class:`GPT`).
        opt: its optimizer.
        cfg: the shape batches are made for.
        steps: how many optimizer steps.
        batch: sequences per step.
        seed: seeds the batch generator; the same seed (and model/optimizer state) gives the same losses.
        on_step: called with ``n`` (steps completed, 1-based) after each optimizer step, e.g. to capture a
            snapshot.

    Returns:
        The loss of each step, in order.
    """
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for n in range(1, steps + 1):
        x, y = make_batch(cfg, batch, gen)
        losses.append(train_step(model, opt, x, y))
        if on_step is not None:
            on_step(n)
    return losses
