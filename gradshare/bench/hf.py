"""Hugging Face causal language models as benchmark workloads: the model code most people train today,
built from small configs with the library's own weight init (nothing downloaded).

- "llama": `LlamaForCausalLM` (RMSNorm, rotary positions, SwiGLU), width 96, 2 layers, 4 heads;
- "gpt2": `GPT2LMHeadModel` (LayerNorm, learned positions, GELU), the same size;
both with tied input and output embeddings and no dropout, over the byte-level text of `bench lm`
(`VOCAB` ASCII codes, `SEQ`-token windows). They train the Hugging Face way (`HF_RECIPE`): the model
shifts the labels itself and returns a `ModelOutput`, so the step is ``train_step=hf_train_step``;
AdamW at its default betas, a warm-up then a cosine (a LambdaLR stepped per step) and the gradient norm
clipped to 1.

`transformers` is the optional extra `gradshare[hf]`; this module imports it only when a model is built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradshare.bench.lm import SEQ, VOCAB, causal_lm

HF_MODELS = ("llama", "gpt2")
MODELS = ("tiny", *HF_MODELS)  # "tiny": bench lm's own nn.TransformerEncoder LM (PyTorch's init)
WIDTH, LAYERS, HEADS = 96, 2, 4


@dataclass(frozen=True)
class LmRecipe:
    """How a model of `MODELS` trains: AdamW's lr, weight decay and betas, the clip, the batch per worker."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    clip: float = 1.0
    batch: int = 16
    decay_matrices_only: bool = False  # GPT-2's recipe: no weight decay on norms and biases


HF_RECIPE = LmRecipe(lr=3e-3, weight_decay=0.01, betas=(0.9, 0.999))
RECIPES = {"tiny": LmRecipe(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), decay_matrices_only=True),
           "llama": HF_RECIPE, "gpt2": HF_RECIPE}


def llama() -> nn.Module:
    """A small `LlamaForCausalLM` from a config, the library's init (N(0, 0.02) matrices)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    """A small `GPT2LMHeadModel` from a config, the library's init, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


FACTORIES: dict[str, Callable[[], nn.Module]] = {"tiny": causal_lm, "llama": llama, "gpt2": gpt2}


def hf_train_step(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The Hugging Face way: the token ids are the labels too; the model shifts them and returns the loss."""
    ids = batch[0]
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def lm_loss(name: str) -> Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]:
    """The train step of model `name`: `hf_train_step`, or next-token cross-entropy for "tiny"."""
    if name in HF_MODELS:
        return hf_train_step

    def tiny_step(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ids, labels = batch[0], batch[-1]
        return torch.nn.functional.cross_entropy(model(ids).flatten(0, -2), labels.flatten())

    return tiny_step


def optimizer_for(name: str) -> Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]:
    """AdamW at model `name`'s recipe (the clip is added by the caller, where the step is)."""
    recipe = RECIPES[name]

    def factory(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        if recipe.decay_matrices_only:
            groups: list[dict[str, Any]] = [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
            return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas)
        return torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)

    return factory


def check_transformers() -> None:
    """ImportError naming the extra when `transformers` is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("the Hugging Face models need transformers: pip install 'gradshare[hf]'") from e
