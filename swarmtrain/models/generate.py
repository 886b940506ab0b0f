"""Sampling text from a trained model (`swarmtrain generate`): temperature and top-k over the last position."""

from __future__ import annotations

import torch
from torch import nn

from swarmtrain.data.tokenizer import Tokenizer

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Tokenizer, prompt: str, *, max_new_tokens: int, context_len: int,
             temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    """The prompt's continuation (new text only): `max_new_tokens` tokens, or fewer when end-of-text is drawn.

    The whole window is recomputed for each token (no key/value cache): simple, and enough for the models a
    CPU trains. temperature 0 takes the most likely token.
    """
    if max_new_tokens < 1 or context_len < 1:
        raise ValueError("generate: --max-new-tokens and the context must be >= 1")
    if temperature < 0 or top_k < 0:
        raise ValueError("generate: --temperature and --top-k must be >= 0")
    model.eval()
    device = next(model.parameters()).device
    (ids,) = tokenizer.encode_batch([prompt])
    tokens = torch.tensor([ids or [tokenizer.info.eos_id]], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits, _ = model(tokens[:, -context_len:])
        last = logits[0, -1].float()
        if temperature == 0:
            token = int(last.argmax())
        else:
            last = last / temperature
            if top_k:
                floor = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < floor, float("-inf"))
            token = int(torch.multinomial(torch.softmax(last, dim=-1), 1, generator=generator))
        if token == tokenizer.info.eos_id:
            break
        new.append(token)
        tokens = torch.cat([tokens, torch.tensor([[token]], device=device)], dim=1)
    return tokenizer.decode(new)
