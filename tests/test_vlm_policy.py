"""Tiny real Qwen2.5-VL / Qwen3-VL with their processors: loading, seeded rollouts, log-probs."""

from __future__ import annotations

import json

import pytest
import torch

from vlm.config import ModelConfig, TaskConfig, TinyVLMConfig
from vlm.policy import VLMPolicy, load_policy, mask_banned, response_logprobs
from vlm.rollout import BanTokens, GumbelNoise, HFRolloutEngine, generation_positions, response_mask
from vlm.task import CELL_PX, corpus, example_image, make_example
from vlm.tiny import build_tiny_vlm

TASK = TaskConfig(grid_size=2, max_shapes=3)
SPEC = dict(text_hidden=32, text_layers=1, text_heads=2, vision_hidden=32, vision_depth=1, vision_heads=2)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def folder(request, tmp_path_factory):
    spec = TinyVLMConfig(family=request.param, **SPEC)
    return build_tiny_vlm(
        tmp_path_factory.mktemp(request.param) / "model", spec, corpus(TASK), image_px=TASK.grid_size * CELL_PX
    )


def _prompts(policy, num=3):
    examples = [make_example(s, TASK) for s in range(num)]
    return policy.encode([e.question for e in examples], [example_image(e, TASK) for e in examples])


def test_folder_loads_through_from_pretrained_with_its_chat_template(folder):
    config = json.loads((folder / "config.json").read_text())
    policy = VLMPolicy.load(folder)
    expected = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
    assert type(policy.model).__name__ == expected[config["model_type"]]
    assert "<|im_start|>assistant" in policy.processor.chat_template
    batch = _prompts(policy)
    # One LM token per merged 2x2 patch block; every prompt ends with the assistant turn opener.
    image_id = policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    merged = (batch.image_grid_thw_B3.prod(-1) // 4).tolist()
    assert (batch.input_ids_BL == image_id).sum(1).tolist() == merged
    assert policy.tokenizer.convert_ids_to_tokens(batch.input_ids_BL[0, -2:].tolist()) == ["<|im_start|>", "assistant"]
    assert policy.tokenizer.decode(policy.tokenizer("answer : 3").input_ids) == "answer : 3"


def test_missing_model_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-model-here"
    with pytest.raises(ValueError, match=r"model\.path: .*no-model-here.*warmstart"):
        load_policy(ModelConfig(path=str(missing)))


def test_sampling_is_seeded_and_independent_of_batching(folder):
    policy = VLMPolicy.load(folder)
    batch = _prompts(policy)
    a = HFRolloutEngine(policy, batch_size=2).generate(batch, 4, 5, 1.0, seed=7)
    b = HFRolloutEngine(policy, batch_size=64).generate(batch, 4, 5, 1.0, seed=7)
    c = HFRolloutEngine(policy, batch_size=64).generate(batch, 4, 5, 1.0, seed=8)
    assert a.response_ids_BT.shape[0] == 12 and len(a.texts) == 12
    assert torch.equal(a.response_ids_BT, b.response_ids_BT) and torch.equal(a.response_mask_BT, b.response_mask_BT)
    assert not torch.equal(a.response_ids_BT, c.response_ids_BT)
    # The G samples of one prompt differ from each other (a random model is far from greedy).
    assert len({tuple(r) for r in a.response_ids_BT[:4].tolist()}) > 1
    assert not set(a.response_ids_BT[a.response_mask_BT.bool()].tolist()) & set(policy.banned_token_ids)


def test_positions_computed_once_per_prompt_are_the_ones_generate_derives(folder):
    from transformers import GenerationConfig, LogitsProcessorList

    from spotlight.core.seeds import derive_seed

    policy = VLMPolicy.load(folder)
    batch = _prompts(policy)
    ours = generation_positions(policy, batch)
    theirs = policy.model._prepare_position_ids_for_generation(batch.input_ids_BL, batch.model_inputs())
    assert ours.shape[0] == 4 and torch.equal(ours, theirs)
    # End to end: the engine (positions per prompt, indexed per row) samples what a plain
    # `generate` over the repeated rows samples when it derives positions itself.
    G = 3
    got = HFRolloutEngine(policy).generate(batch, G, 5, 1.0, seed=3)
    rows = batch.select([r // G for r in range(batch.num_rows * G)])
    processors = LogitsProcessorList(
        [
            BanTokens(policy.banned_token_ids),
            GumbelNoise([derive_seed(3, r // G, r % G) for r in range(rows.num_rows)], 1.0),
        ]
    )
    config = GenerationConfig(
        do_sample=False, max_new_tokens=5, eos_token_id=policy.eos_token_id, pad_token_id=policy.pad_token_id
    )
    out = policy.model.generate(**rows.model_inputs(), generation_config=config, logits_processor=processors)
    plain = out[:, rows.input_ids_BL.shape[1] :]
    mask = response_mask(plain, policy.eos_token_id)
    plain = torch.where(mask.bool(), plain, torch.full_like(plain, policy.pad_token_id))
    assert torch.equal(got.response_ids_BT[:, : plain.shape[1]], plain)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_logprobs_equal_the_sampling_distribution(folder, temperature):
    policy = VLMPolicy.load(folder)
    rows = _prompts(policy).repeat_rows(2)
    from transformers import GenerationConfig, LogitsProcessorList

    seeds = list(range(rows.num_rows))
    out = policy.model.generate(
        **rows.model_inputs(),
        generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=5, eos_token_id=policy.eos_token_id, pad_token_id=policy.pad_token_id
        ),
        logits_processor=LogitsProcessorList([BanTokens(policy.banned_token_ids), GumbelNoise(seeds, temperature)]),
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids_BT = out.sequences[:, rows.input_ids_BL.shape[1] :]
    mask_BT = response_mask(ids_BT, policy.eos_token_id)
    raw_BTV = torch.stack(out.logits, 1).float()
    expected_BT = (
        torch.log_softmax(mask_banned(raw_BTV, policy.banned_token_ids) / temperature, -1)
        .gather(-1, ids_BT.unsqueeze(-1))
        .squeeze(-1)
    )
    with torch.no_grad():
        got_BT = response_logprobs(policy, rows, ids_BT, mask_BT, temperature)
    m = mask_BT.bool()
    torch.testing.assert_close(got_BT[m], expected_BT[m], atol=1e-5, rtol=1e-5)
    assert (got_BT[~m] == 0).all()


def test_response_mask_stops_after_the_first_end_token():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert response_mask(ids, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_lora_and_frozen_vision_options(folder):
    full = load_policy(ModelConfig(path=str(folder), train_vision=True))
    frozen = load_policy(ModelConfig(path=str(folder), train_vision=False))
    lora = load_policy(ModelConfig(path=str(folder), lora_rank=4, train_vision=False))
    lora_vision = load_policy(ModelConfig(path=str(folder), lora_rank=4, train_vision=True))

    def trainable(p):
        return {n for n, q in p.model.named_parameters() if q.requires_grad}

    assert any(".visual." in n for n in trainable(full))
    assert not any(".visual." in n for n in trainable(frozen)) and any("language_model" in n for n in trainable(frozen))
    assert trainable(lora) and all("lora_" in n and "visual" not in n for n in trainable(lora))
    assert any("visual" in n for n in trainable(lora_vision)) and all("lora_" in n for n in trainable(lora_vision))


def test_lora_init_follows_the_run_seed_and_leaves_the_global_generator(folder):
    """A LoRA adapter's initial weights are a function of `seed` (train.seed), and drawing them does
    not move torch's global generator; without a seed they are peft's draw from that generator."""
    from vlm.policy import trainable_state

    cfg = ModelConfig(path=str(folder), lora_rank=4)

    def adapter(seed):
        state = torch.random.get_rng_state()
        weights = trainable_state(load_policy(cfg, seed=seed))
        return weights, torch.equal(state, torch.random.get_rng_state())

    (a, kept_a), (b, _), (c, _) = adapter(3), adapter(3), adapter(4)
    assert kept_a and a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if "lora_A" in k)
    _, kept = adapter(None)
    assert not kept  # peft drew from the global generator
