"""The decoding cache with reserved room gives the logits transformers' own growing cache gives."""

import pytest
import torch
from transformers import DynamicCache

import localrl.generation.rollout as rollout
from localrl.config import TrainConfig
from localrl.generation.reserved_cache import ReservedLayer, reserve_room
from localrl.modeling import load_policy, pick_device


def _decode_logits(model, prompt: torch.Tensor, steps: int, room: int | None) -> list[torch.Tensor]:
    """Greedy decoding of ``prompt`` ([B, P]) token by token; each step's logits. ``room``: None for the plain
    cache, else the room reserved after the prefill (smaller than ``steps`` makes the cache grow once)."""
    cache = DynamicCache()
    positions = torch.arange(prompt.size(1))[None].expand_as(prompt)
    with torch.no_grad():
        out = model(input_ids=prompt, position_ids=positions, cache=cache, use_cache=True)
        if room is not None:
            reserve_room(cache, room)
            assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
        logits = [out.logits[:, -1]]
        for t in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True)
            out = model(input_ids=tok, position_ids=torch.full_like(tok, prompt.size(1) + t), cache=cache,
                        use_cache=True)
            logits.append(out.logits[:, -1])
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoding_with_reserved_room_gives_the_growing_caches_logits(tiny_models, arch):
    cfg = TrainConfig(model=str(tiny_models[arch])).validate()
    torch.manual_seed(0)
    model, _ = load_policy(cfg, pick_device("cpu"))
    model.eval()
    prompt = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(1))
    plain = _decode_logits(model, prompt, 6, None)
    for room in (6, 2):  # enough room; too little, so the cache grows past it once
        reserved = _decode_logits(model, prompt, 6, room)
        for step, (a, b) in enumerate(zip(plain, reserved)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"room {room}, step {step}")


def test_a_reserved_layer_keeps_its_room_through_the_caches_reshaping_calls():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, 4, 3, generator=g), torch.randn(2, 1, 4, 3, generator=g)
    layer = ReservedLayer(keys, values, room=3)
    layer.batch_repeat_interleave(2)  # [4, 1, 4, 3], rows 0 0 1 1, as torch.repeat_interleave orders them
    layer.crop(-1)  # 3 positions left
    layer.batch_select_indices(torch.tensor([1, 2]))  # rows 0 and 1 only if interleaved
    new_k, new_v = torch.randn(2, 1, 1, 3, generator=g), torch.randn(2, 1, 1, 3, generator=g)
    k, v = layer.update(new_k, new_v)
    want_k = torch.cat([keys[:, :, :3], new_k], dim=-2)
    want_v = torch.cat([values[:, :, :3], new_v], dim=-2)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)
    assert layer.get_seq_length() == 4 and k.data_ptr() == layer._k.data_ptr()  # written in place, in the room


def test_sampling_reserves_room_and_samples_what_the_growing_cache_samples(tiny_models, monkeypatch):
    cfg = TrainConfig(model=str(tiny_models["qwen2"])).validate()
    torch.manual_seed(0)
    model, tok = load_policy(cfg, pick_device("cpu"))
    prompts = [[5, 6, 7, 8], [9, 10]]

    def sample():
        gens = rollout.group_generators(3, range(2), torch.device("cpu"))
        return rollout.sample_groups(model, prompts, 4, 8, [], tok.pad_token_id or 0, 1.0, gens)

    reserved = sample()
    calls = []

    def plain_cache(cache, tokens, repeats):  # what the sampler did before: the growing cache, repeated
        calls.append((tokens, repeats))
        cache.batch_repeat_interleave(repeats)

    monkeypatch.setattr(rollout, "reserve_room", plain_cache)
    plain = sample()
    assert calls == [(7, 4)]  # the room the sampler asks for (every token after the first), for G = 4
    assert torch.equal(reserved.completion_ids, plain.completion_ids)
    assert reserved.completion_ids.shape == (8, 8)
