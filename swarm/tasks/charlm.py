"""``charlm``: a tiny causal transformer that predicts the next character of Python source.

Data: :func:`swarm.tasks.corpus.stdlib_corpus` (the interpreter's own standard library;
nothing is downloaded). A training example is the window of ``context + 1`` characters
starting at any position of the training text: input the first ``context``, target the
last ``context`` (each position predicts the next character). Evaluation uses fixed,
evenly spaced, non-overlapping windows of the test text.

The model is a pre-LayerNorm GPT-style decoder (Radford et al. 2019): token and learned
position embeddings, ``num_layers`` blocks of causal self-attention and a 4x GELU MLP,
a final LayerNorm and an untied output head. No dropout, so training is a deterministic
function of the seed and the data order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from swarm.errors import TaskError
from swarm.optim_spec import OptimizerSpec
from swarm.tasks.base import Batch, Recipe, Task, evaluating
from swarm.tasks.corpus import DEFAULT_MODULES, VOCAB_SIZE, stdlib_corpus


@dataclass(frozen=True, kw_only=True)
class CharLMConfig:
    """Shape of the ``charlm`` task's model and evaluation."""

    context: int = 64
    """Characters the model sees (and predicts) per example."""
    d_model: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads per block (``d_model`` must be a multiple)."""
    num_eval_windows: int = 256
    """Test windows evaluated (evenly spaced over the test text): bounds evaluation time."""
    modules: tuple[str, ...] = DEFAULT_MODULES
    """Standard-library modules whose source is the corpus."""

    def __post_init__(self) -> None:
        if min(self.context, self.d_model, self.num_layers, self.num_heads) < 1:
            raise TaskError("context, d_model, num_layers and num_heads must all be >= 1")
        if self.d_model % self.num_heads:
            raise TaskError(f"d_model {self.d_model} is not a multiple of {self.num_heads} heads")
        if self.num_eval_windows < 1:
            raise TaskError(f"num_eval_windows must be >= 1, got {self.num_eval_windows}")


class Block(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        heads = (batch, length, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyTransformerLM(nn.Module):
    """Tokens (batch, length) of ints < vocab_size -> logits (batch, length, vocab_size)."""

    def __init__(self, config: CharLMConfig, vocab_size: int = VOCAB_SIZE) -> None:
        super().__init__()
        self.context = config.context
        self.token_embedding = nn.Embedding(vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.Sequential(
            *(Block(config.d_model, config.num_heads) for _ in range(config.num_layers))
        )
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.context:
            raise TaskError(f"input of {length} tokens is longer than the context {self.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        logits: torch.Tensor = self.head(self.ln_final(self.blocks(x)))
        return logits


def _windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> Batch:
    rows = text[starts.unsqueeze(1) + torch.arange(context + 1)].long()
    return rows[:, :-1], rows[:, 1:]


class CharLMTask(Task):
    """Next-character prediction on Python source; metrics: loss (nats), bits_per_char,
    accuracy (of the most likely next character)."""

    name = "charlm"

    def __init__(self, config: CharLMConfig | None = None) -> None:
        self.config = config or CharLMConfig()
        corpus = stdlib_corpus(self.config.modules)
        context = self.config.context
        self.train_text = torch.frombuffer(bytearray(corpus.train), dtype=torch.uint8)
        self.test_text = torch.frombuffer(bytearray(corpus.test), dtype=torch.uint8)
        if len(self.test_text) < context + 1:
            raise TaskError(f"test text of {len(self.test_text)} chars is shorter than a window")
        num_test_windows = (len(self.test_text) - 1) // context
        chosen = np.linspace(
            0, num_test_windows - 1, min(self.config.num_eval_windows, num_test_windows)
        )
        starts = torch.from_numpy(np.unique(chosen.round().astype(np.int64)) * context)
        self.test_inputs, self.test_targets = _windows(self.test_text, starts, context)

    @property
    def num_train(self) -> int:
        return len(self.train_text) - self.config.context

    @property
    def recipe(self) -> Recipe:
        # 800 steps, 20-30 s of one CPU core: test loss falls from 7 bits/char (uniform
        # over ASCII) to about 2.1.
        return Recipe(
            batch_size=32,
            num_samples=32 * 800,
            optimizer=OptimizerSpec(kind="adam", lr=6e-3),
        )

    def build_model(self) -> nn.Module:
        return TinyTransformerLM(self.config)

    def examples(self, indices: np.ndarray) -> Batch:
        return _windows(self.train_text, torch.from_numpy(indices), self.config.context)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        with evaluating(model):
            logits = model(self.test_inputs)
            flat_logits = logits.reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(flat_logits, self.test_targets.reshape(-1)).item()
            hits = flat_logits.argmax(dim=1) == self.test_targets.reshape(-1)
            accuracy = hits.float().mean().item()
        return {"loss": loss, "bits_per_char": loss / math.log(2), "accuracy": accuracy}
