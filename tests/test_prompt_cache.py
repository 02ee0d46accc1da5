"""Per-step prompt cache of the DiT path: one text-encoder call per prompt per step, same images.

A forward pre-hook on the tiny real Qwen2.5-VL text encoder counts the prompt rows it really
encodes, independently of the cache's own counters.
"""

from __future__ import annotations

import pytest
import torch

from spotlight.cli import main
from spotlight.config import DiTRecipe
from spotlight.grpo import group_advantages
from spotlight.policy import load_policy
from spotlight.prompt_cache import PromptCache, UncachedPrompts
from spotlight.rollout import rollout
from spotlight.sampling import qwen_image_sigmas, sde_step_indices
from spotlight.tracking import read_metrics
from spotlight.trainer import GRPOTrainer

PROMPTS = ["one red circle", "two blue squares", "three green triangles"]
G = 4


class EncoderRows:
    """Prompt rows the text encoder's forward really sees."""

    def __init__(self, policy):
        self.rows = 0
        self._handle = policy.text_encoder.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        self.rows += int(kwargs["input_ids"].shape[0])


def _cfg(tiny_model_dir, objective: str, guidance_scale: float = 1.0, beta: float = 0.0) -> DiTRecipe:
    cfg = DiTRecipe()
    cfg.model.path = str(tiny_model_dir)
    cfg.sample.num_steps = 3
    cfg.sample.batch_size = 4  # several rollout chunks per step
    cfg.sample.guidance_scale = guidance_scale
    cfg.train.objective = objective
    cfg.train.minibatch_size = 4  # several minibatches per update
    cfg.train.beta = beta
    if objective == "flow_grpo":
        cfg.sample.noise_level = 1.2
    return cfg


def _policy(cfg: DiTRecipe, *, cached: bool):
    policy = load_policy(cfg.model)
    if not cached:
        policy.prompt_cache = UncachedPrompts(policy._encode_uncached)
    return policy


def _step(policy, trainer, cfg: DiTRecipe, iteration: int = 0):
    """One driver step (begin, rollout, advantages, update, end) on PROMPTS x G."""
    prompts = [p for p in PROMPTS for _ in range(G)]
    sigmas = qwen_image_sigmas(cfg.sample.num_steps, policy.latent_shape[0])
    s = cfg.sample
    policy.prompt_cache.begin_step(prompts)
    ro = rollout(
        policy, prompts, list(range(100 * iteration, 100 * iteration + len(prompts))), sigmas,
        noise_level=s.noise_level, sde_steps=sde_step_indices(s.num_steps, 0, 0), sde_type=s.sde_type,
        guidance_scale=s.guidance_scale, negative_prompt=s.negative_prompt, batch_size=s.batch_size,
    )  # fmt: skip
    rewards = torch.arange(len(prompts), dtype=torch.float32).view(len(PROMPTS), G) % 3
    trainer.update(ro, group_advantages(rewards), iteration)
    return ro, policy.prompt_cache.end_step()


@pytest.mark.parametrize("objective,guidance_scale,beta", [("nft", 1.0, 0.0), ("flow_grpo", 2.0, 0.1)])
def test_one_encoder_call_per_prompt_per_step_and_identical_samples(tiny_model_dir, objective, guidance_scale, beta):
    """Rollout chunks, update minibatches, the reference forward and CFG's negative prompt all share
    the step's embeddings; the naive path encodes every row in every phase. Same bits either way."""
    cfg = _cfg(tiny_model_dir, objective, guidance_scale, beta)
    runs = {}
    for cached in (False, True):
        policy = _policy(cfg, cached=cached)
        trainer = GRPOTrainer(policy, cfg)
        rows = EncoderRows(policy)
        outs = []
        for it in range(2):
            before = rows.rows
            ro, stats = _step(policy, trainer, cfg, it)
            outs.append((ro, stats, rows.rows - before))
        runs[cached] = outs, policy.transformer.state_dict()

    distinct = len(PROMPTS) + (guidance_scale != 1.0)  # the negative prompt is one more prompt
    for ro, stats, encoded in runs[True][0]:
        assert encoded == stats.num_encoded == distinct
        assert stats.num_prompts == distinct and stats.calls_per_prompt == 1.0
        assert stats.num_forwards == 1 + (guidance_scale != 1.0)  # begin_step, then the negative at first use
    for _, stats, encoded in runs[False][0]:
        # Every row in the rollout and again in the update (twice with CFG: prompts and negatives).
        assert encoded == stats.num_encoded == 2 * len(PROMPTS) * G * (1 + (guidance_scale != 1.0))
        assert stats.calls_per_prompt == encoded / distinct > 1
    for (a, _, _), (b, _, _) in zip(runs[False][0], runs[True][0]):
        assert torch.equal(a.images, b.images)
        assert torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)
    weights_a, weights_b = runs[False][1], runs[True][1]
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)


def test_training_run_reports_one_call_per_prompt(tiny_model_dir, tmp_path):
    """The real driver opens and closes the step and logs prompt_encoder/calls_per_prompt."""
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}", "sample.num_steps=2", "sample.batch_size=4", "train.num_iterations=2",
        "train.prompts_per_iteration=2", "train.group_size=4", "train.minibatch_size=4", "log.images_every=0",
        "data.num_heldout=8",
    ]  # fmt: skip
    assert main(["train", *overrides, "--run-dir", str(run_dir), "--quiet"]) == 0
    rows = read_metrics(run_dir)
    assert [r["prompt_encoder/calls_per_prompt"] for r in rows] == [1.0, 1.0]
    assert all(r["prompt_encoder/forwards"] == 1.0 and r["time/prompt_encoder_s"] > 0 for r in rows)


def test_memory_is_held_for_the_step_only(tiny_policy):
    cache = tiny_policy.prompt_cache
    assert isinstance(cache, PromptCache)
    for step in range(3):
        prompts = [PROMPTS[step], PROMPTS[(step + 1) % 3]] * G
        cache.begin_step(prompts)
        embeds, _ = tiny_policy.encode_prompts(prompts)
        assert cache.num_held == 2
        # Each held embedding owns its storage: it does not keep the encoder's batch output alive.
        e = cache.lookup([PROMPTS[step]])[0]
        assert e.untyped_storage().nbytes() == e.numel() * e.element_size()
        assert cache.held_bytes == sum(x.numel() * 4 for x in cache.lookup(prompts[:2]))
        stats = cache.end_step()
        assert stats.held_bytes > 0 and stats.calls_per_prompt == 1.0
        assert cache.num_held == 0 and cache.held_bytes == 0
    # Outside a step a lookup encodes its distinct prompts once and keeps nothing.
    before = cache.total_encoded
    tiny_policy.encode_prompts([PROMPTS[0]] * 5 + [PROMPTS[1]])
    assert cache.total_encoded - before == 2 and cache.num_held == 0
    # A caller that repeats prompts across calls (an explorer's batches) can hold them in a scope.
    with cache.step(PROMPTS):
        for _ in range(3):
            tiny_policy.encode_prompts(PROMPTS[:2])
    assert cache.total_encoded - before == 2 + 3 and cache.num_held == 0 and not cache.in_step


def test_a_step_left_open_is_dropped_at_the_next_begin(tiny_policy):
    cache = tiny_policy.prompt_cache
    cache.begin_step([PROMPTS[0]])
    cache.begin_step([PROMPTS[1]])  # the previous step's driver raised
    assert cache.num_held == 1
    assert cache.end_step().num_prompts == 1


def test_encoder_weight_change_invalidates(tiny_policy):
    """The encoder is frozen today; if its weights ever change, held embeddings are recomputed."""
    assert not any(p.requires_grad for p in tiny_policy.text_encoder.parameters())
    cache = tiny_policy.prompt_cache
    cache.begin_step(PROMPTS)
    before = cache.lookup(PROMPTS)
    weight = tiny_policy.text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        weight.add_(0.5)  # what an optimizer step would do in place
    after = cache.lookup(PROMPTS)
    assert cache.invalidations == 1
    assert not any(torch.equal(a, b) for a, b in zip(before, after))
    torch.testing.assert_close(after, tiny_policy._encode_uncached(PROMPTS), rtol=0, atol=0)
    # Loading a state dict in place is a change too.
    state = {k: v.clone() for k, v in tiny_policy.text_encoder.state_dict().items()}
    tiny_policy.text_encoder.load_state_dict(state)
    cache.lookup(PROMPTS)
    assert cache.invalidations == 2
    assert cache.end_step().calls_per_prompt == 3.0


def test_encoding_is_batch_invariant_on_cpu(tiny_policy):
    """What makes an embedding a function of its prompt here: alone or in any batch, the same bits."""
    alone = [tiny_policy._encode_uncached([p])[0] for p in PROMPTS]
    batched = tiny_policy._encode_uncached(PROMPTS[::-1] + ["four yellow circles and a purple square"])[:3][::-1]
    assert all(torch.equal(a, b) for a, b in zip(alone, batched))
