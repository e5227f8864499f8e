"""Plain autoregressive decoding: the baseline Medusa is measured against and must match."""

from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from inference.engine.decoding import DecodeRequest, DecodeStats, StepEmitter, check_request
from inference.engine.forward import (BaseStates, CacheSlot, StaticCache, cache_dtype, check_supported, forward,
                                      prefill, visible_mask)
from inference.engine.graph_mode import CapturedStep
from inference.engine.npu_attention import attention_for
from inference.engine.phases import CAPTURED, FORWARD, HOST, NO_CLOCK
from inference.engine.sampling import Sampling, choose_tokens, exponential_race


def next_token(model: PreTrainedModel, cache: StaticCache, token: torch.Tensor, length: torch.Tensor,
               attention: Callable, sampling: Sampling, race: torch.Tensor | None,
               aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, BaseStates]:
    """(the base model's next token [1], the states [1, H] it came from) after `token` [1], written at position
    `length` [1] of `cache`."""
    one = torch.ones((1, 1), dtype=torch.bool, device=token.device)
    states = forward(model, cache, token, length, length, visible_mask(one, length, cache.capacity), attention,
                     aux_layers)
    return choose_tokens(model.lm_head(states.hidden), sampling, race), states


class PlainDecoder:
    """Plain decoding of one model, eager or with the step captured (`compile`)."""

    def __init__(self, model: PreTrainedModel, compile: bool = False, attention: Callable | None = None,
                 log: Callable[[str], None] | None = None):
        check_supported(model)
        self.model = model
        self.attention = attention or attention_for(model.device, model.dtype)
        self.cache = CacheSlot(model, cache_dtype(self.attention, model.dtype))
        self.step = CapturedStep(self._step, model.device, model.dtype, compile, "plain", log)
        self.step_clock = NO_CLOCK  # what the step marks its phases on: a decode's clock when eager

    def _step(self, cache: StaticCache, token: torch.Tensor, length: torch.Tensor, race: torch.Tensor | None,
              sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token after `token` [1] at position `length` [1]: everything between two host reads."""
        token = next_token(self.model, cache, token, length, self.attention, sampling, race)[0]
        self.step_clock.mark(FORWARD)
        return token, length + 1

    @torch.inference_mode()
    def decode(self, request: DecodeRequest, stats: DecodeStats | None = None) -> Iterator[list[int]]:
        """Yield the new token ids one step (one token) at a time; same cache and stopping as Medusa."""
        stats = stats if stats is not None else DecodeStats()
        model, sampling = self.model, request.sampling
        check_request(request, getattr(model.config, "max_position_embeddings", None))
        device, vocab = model.device, model.lm_head.weight.shape[0]
        generator = request.generator(device)
        cache = self.cache.get(len(request.input_ids) + request.max_new_tokens)
        emitter = StepEmitter(request, stats)
        hidden = prefill(model, cache, request.input_ids).hidden[-1:]
        token = choose_tokens(model.lm_head(hidden), sampling, exponential_race(1, vocab, sampling, generator, device))
        length = torch.tensor([len(request.input_ids)], device=device)
        clock = stats.phases or NO_CLOCK
        self.step_clock = NO_CLOCK if self.step.captured else clock
        clock.start()
        while True:
            tokens = emitter.emit(token.tolist())  # the step's single device-to-host transfer
            yield tokens
            if emitter.done:
                clock.mark(HOST)
                clock.stop()
                return
            race = exponential_race(1, vocab, sampling, generator, device)
            clock.mark(HOST)
            token, length = self.step((cache.capacity, sampling), f"capacity {cache.capacity}", stats,
                                      cache, token, length, race, sampling)
            if self.step.captured:
                clock.mark(CAPTURED)


def plain_decode(model: PreTrainedModel, request: DecodeRequest, stats: DecodeStats | None = None) -> Iterator[list[int]]:
    """Eager plain decoding of one request (a `PlainDecoder` keeps its cache and captured step between requests)."""
    return PlainDecoder(model).decode(request, stats)
