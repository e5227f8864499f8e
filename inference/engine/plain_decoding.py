"""Plain autoregressive decoding: the baseline Medusa is measured against and must match."""

from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from inference.engine.decoding import DecodeRequest, DecodeStats, StepEmitter, check_request
from inference.engine.kv_cache import KVBuffer
from inference.engine.sampling import choose_tokens


@torch.inference_mode()
def plain_decode(model: PreTrainedModel, request: DecodeRequest, stats: DecodeStats | None = None) -> Iterator[list[int]]:
    """Yield the new token ids one step (one token) at a time; same cache and stopping as Medusa."""
    stats = stats if stats is not None else DecodeStats()
    check_request(request, getattr(model.config, "max_position_embeddings", None))
    device = model.device
    generator = request.generator(device)
    cache = KVBuffer(model.config, len(request.input_ids) + request.max_new_tokens, device, model.dtype)
    emitter = StepEmitter(request, stats)
    ids = torch.tensor([request.input_ids], device=device)
    while True:
        logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0]
        token = choose_tokens(logits, request.sampling, generator)
        tokens = emitter.emit(token.tolist())  # the step's single device-to-host transfer
        yield tokens
        if emitter.done:
            return
        ids = token.view(1, 1)
