"""The language models of the LM benchmarks (`python benchmarks/lm.py` on Spark, `lab/lockstep_lm.py` in
lock step), each with its training recipe, and the text they learn. Nothing is downloaded.

- "tiny": what people write by hand: token and position embeddings, `nn.TransformerEncoder` (pre-norm,
  GELU) under a causal -inf mask kept as a non-persistent buffer, a linear head giving (B, T, V) logits
  against (B, T) next-token labels with the default loss; PyTorch's init. AdamW (weight decay 0.1 on the
  matrices, betas 0.9/0.95).
- "llama": Hugging Face's `LlamaForCausalLM` (RMSNorm, rotary positions, SwiGLU) and "gpt2":
  `GPT2LMHeadModel` (LayerNorm, learned positions, GELU), built from small configs (width 96, 2 layers,
  4 heads, tied embeddings, no dropout) with the library's own init (normal, std 0.02). They train the
  Hugging Face way (`HF_RECIPE`): the model shifts the labels itself and returns a `ModelOutput`, so the
  step is ``train_step=hf_train_step``; AdamW at its default betas and weight decay 0.01.
Every recipe: a linear warm-up over the first 5 % of the steps then a cosine to zero (a LambdaLR stepped
per step), the gradient norm clipped to 1.

The text: characters of Python's own standard library sources (`TRAIN_MODULES`, `VAL_MODULES`, ASCII),
cut into windows of `SEQ` tokens. `transformers` is the optional extra `gradshare[hf]`, imported only
when an HF model is built.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gradshare.replica.losses import model_output

LmData = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # (ids, labels, validation ids, its labels)
TrainStepFn = Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]

TRAIN_MODULES = ("argparse", "difflib", "shutil", "pathlib", "functools", "dataclasses", "statistics", "fractions")
VAL_MODULES = ("textwrap", "heapq")
VOCAB, SEQ, WIDTH, LAYERS, HEADS = 128, 64, 96, 2, 4
WARMUP_SHARE = 0.05
HF_MODELS = ("llama", "gpt2")
MODELS = ("tiny", *HF_MODELS)


@dataclass(frozen=True)
class LmRecipe:
    """How a model of `MODELS` trains: AdamW's lr, weight decay and betas, the gradient clip, the batch per
    worker, and the run (training windows, epochs)."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    batch: int
    rows: int
    epochs: int
    clip: float = 1.0
    decay_matrices_only: bool = False  # GPT-2's recipe: no weight decay on norms and biases


HF_RECIPE = LmRecipe(lr=3e-3, weight_decay=0.01, betas=(0.9, 0.999), batch=16, rows=6000, epochs=2)
RECIPES = {
    "tiny": LmRecipe(
        lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), batch=32, rows=4096, epochs=4, decay_matrices_only=True
    ),
    "llama": HF_RECIPE,
    "gpt2": HF_RECIPE,
}


# ------------------------------------------------------------------------------------ text
def text_windows(modules: tuple[str, ...], limit: int | None = None) -> np.ndarray:
    """int64 (n, SEQ + 1) windows over the ASCII characters of stdlib modules' sources (others → '?')."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in modules:
        with open(os.path.join(stdlib, name + ".py"), "rb") as f:
            chunks.append(f.read())
    codes = np.frombuffer(b"\n".join(chunks), np.uint8).astype(np.int64)
    codes[codes >= VOCAB] = ord("?")
    n = (len(codes) - 1) // SEQ
    windows = np.lib.stride_tricks.sliding_window_view(codes, SEQ + 1)[: n * SEQ : SEQ]
    return np.ascontiguousarray(windows[:limit])


def lm_data(seed: int, rows: int | None = None) -> LmData:
    """(train ids, train labels, val ids, val labels), (n, SEQ) int64; training windows in a seeded order."""
    train = text_windows(TRAIN_MODULES)
    train = train[np.random.default_rng(seed).permutation(len(train))][:rows]
    val = text_windows(VAL_MODULES, None if rows is None else max(rows // 4, 64))
    return train[:, :-1], train[:, 1:], val[:, :-1], val[:, 1:]


# ------------------------------------------------------------------------------------ the lm study's own model
class CausalLM(nn.Module):
    """The benchmark's model: token and position embeddings, pre-norm GELU encoder layers under a causal
    -inf mask kept as a non-persistent buffer, a linear head giving (B, T, VOCAB) logits."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        layer = nn.TransformerEncoderLayer(
            WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        mask = self.get_buffer("mask")  # typed: nn.Module's attribute reads are Tensor | Module
        out: torch.Tensor = self.head(self.norm(self.blocks(x, mask=mask[:n, :n], is_causal=True)))
        return out


def causal_lm() -> CausalLM:
    """the lm study's own model (module level: Spark pickles it by reference)."""
    return CausalLM()


# ------------------------------------------------------------------------------------ Hugging Face models
def llama() -> nn.Module:
    """A small `LlamaForCausalLM` from a config, the library's init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    """A small `GPT2LMHeadModel` from a config, the library's init, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


FACTORIES: dict[str, Callable[[], nn.Module]] = {"tiny": causal_lm, "llama": llama, "gpt2": gpt2}


def check_transformers(model: str) -> None:
    """ImportError naming the extra when model `model` needs `transformers` and it is not installed."""
    if model not in HF_MODELS:
        return
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the {model!r} model needs transformers: pip install 'gradshare[hf]'") from e


def hf_train_step(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The Hugging Face way: the token ids are the labels too; the model shifts them and returns the loss."""
    ids = batch[0]
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def next_token_step(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of (B, T, V) logits against (B, T) next-token labels: the default loss's arithmetic."""
    return F.cross_entropy(logits(model(batch[0])).flatten(0, -2), batch[-1].flatten())


def logits(out: object) -> torch.Tensor:
    """A model's logits: the output itself, or a `ModelOutput`'s (replica/losses.py's rule)."""
    return cast(torch.Tensor, model_output(out))


def train_step_for(model: str) -> TrainStepFn:
    """How model `model` computes its loss from a batch (ids, next-token labels)."""
    return hf_train_step if model in HF_MODELS else next_token_step


def optimizer_for(model: str) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """AdamW at model `model`'s recipe (the gradient clip is the caller's: clip_grad_norm or the DDP loop)."""
    recipe = RECIPES[model]

    def factory(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        if not recipe.decay_matrices_only:
            return torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
        groups: list[dict[str, Any]] = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas)

    return factory


# ------------------------------------------------------------------------------------ schedule and metric
def warmup_cosine(total_steps: int, step: int) -> float:
    """lr factor: linear warm-up over WARMUP_SHARE of the steps, then a cosine to 0."""
    warm = max(1, round(WARMUP_SHARE * total_steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))


def scheduler_factory(total_steps: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    def factory(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_cosine, total_steps))

    return factory


def val_loss_sums(out: Any, labels: torch.Tensor) -> tuple[float, float]:
    """(summed next-token cross-entropy, tokens): the validation metric, exact to add across batches."""
    out = logits(out)
    return float(F.cross_entropy(out.flatten(0, -2), labels.flatten(), reduction="sum")), float(labels.numel())


def val_loss(model: nn.Module, ids: np.ndarray, labels: np.ndarray, batch: int = 256) -> float:
    """Mean next-token loss of `model` over the windows `ids` with their next tokens `labels`."""
    total = count = 0.0
    model.eval()
    with torch.no_grad():
        for b in range(0, len(ids), batch):
            s, c = val_loss_sums(model(torch.from_numpy(ids[b : b + batch])), torch.from_numpy(labels[b : b + batch]))
            total, count = total + s, count + c
    model.train()
    return total / count
