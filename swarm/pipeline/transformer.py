"""The ``charlm`` transformer cut into stages: a small GPT as a :class:`PipelineModel`.

The model is the ``charlm`` task's (:class:`swarm.tasks.charlm.TinyTransformerLM`: token
and position embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP,
a final LayerNorm and the output head), its blocks spread over the stages: embeddings
and the first blocks | blocks | the last blocks, the final norm and the head. Stage
``i`` is initialised from ``seed + i``.

What crosses a stage boundary is the residual stream, ``(batch, context, d_model)``
float32; with ``bottleneck=k`` each boundary carries ``k`` features instead: the sending
stage ends with a ``d_model -> k`` projection and the receiving one starts with ``k ->
d_model`` (SWARM's compression of activations at stage boundaries, learned with the
model; it changes the model, so the local model has the same projections). The wire
codec (``PipelineConfig.calls.codec``, e.g. ``blockwise8``) compresses what is sent,
both ways, on top of it. The first stage takes token ids and refuses any outside the
vocabulary with the request's error, before its embedding sees them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from swarm.experts.schema import TensorSpec
from swarm.pipeline.stages import MAX_STAGES
from swarm.tasks.charlm import Block, CharLMConfig
from swarm.tasks.corpus import VOCAB_SIZE

#: Widest bottleneck accepted (wider than any residual stream it could compress).
MAX_BOTTLENECK = 1 << 14


class TokenEmbedding(nn.Module):
    """Token ids ``(batch, length)`` -> token plus position embeddings."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.token_embedding(tokens) + self.position_embedding(positions)
        return out


class Head(nn.Module):
    """The residual stream -> next-character logits ``(batch, length, vocab)``."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__()
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.ln_final(x))
        return out


def _default_config() -> CharLMConfig:
    return CharLMConfig(num_layers=3)


@dataclass(frozen=True, kw_only=True)
class CharLMStages:
    """The ``charlm`` transformer in ``stages`` stages (see the module docstring)."""

    config: CharLMConfig = field(default_factory=_default_config)
    """The transformer's shape (``num_layers >= stages``: every stage has a block)."""
    stages: int = 3
    bottleneck: int | None = None
    """Features crossing each stage boundary; ``None``: the whole residual stream."""
    seed: int = 0
    """Stage ``i`` is initialised from ``seed + i``."""

    def __post_init__(self) -> None:
        if not 1 <= self.stages <= min(MAX_STAGES, self.config.num_layers):
            raise ValueError(
                f"need 1 to {self.config.num_layers} stages (one block each at least), "
                f"got {self.stages}"
            )
        if self.bottleneck is not None and not 1 <= self.bottleneck <= MAX_BOTTLENECK:
            raise ValueError(f"bottleneck must be in [1, {MAX_BOTTLENECK}] or None")
        if not 0 <= self.seed < 2**62:
            raise ValueError("seed must be in [0, 2**62)")

    @property
    def num_stages(self) -> int:
        return self.stages

    def blocks_of(self, stage: int) -> range:
        """The transformer blocks stage ``stage`` holds (as even a split as can be)."""
        layers = self.config.num_layers
        return range(stage * layers // self.stages, (stage + 1) * layers // self.stages)

    def _boundary(self) -> int:
        return self.config.d_model if self.bottleneck is None else self.bottleneck

    def build_stage(self, stage: int) -> tuple[nn.Module, list[TensorSpec]]:
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is outside [0, {self.stages})")
        config, width = self.config, self.config.d_model
        parts: list[nn.Module] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + stage)
            if stage == 0:
                parts.append(TokenEmbedding(config))
                inputs = [TensorSpec(shape=[config.context], dtype="int64", high=VOCAB_SIZE)]
            else:
                if self.bottleneck is not None:
                    parts.append(nn.Linear(self.bottleneck, width))
                inputs = [TensorSpec(shape=[config.context, self._boundary()], dtype="float32")]
            parts.extend(Block(width, config.num_heads) for _ in self.blocks_of(stage))
            if stage == self.stages - 1:
                parts.append(Head(config))
            elif self.bottleneck is not None:
                parts.append(nn.Linear(width, self.bottleneck))
        return nn.Sequential(*parts), inputs

    def build_local(self) -> nn.Sequential:
        return nn.Sequential(*(self.build_stage(i)[0] for i in range(self.stages)))


CHARLM_STAGES = CharLMStages()
"""The ``charlm`` task's transformer with 3 blocks, one per stage."""
