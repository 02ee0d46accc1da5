"""Per-step prompt cache of the DiT path: one text-encoder call per prompt per step, same images.

A forward pre-hook on the tiny real Qwen2.5-VL text encoder counts the prompt rows it really
encodes, independently of the cache's own counters.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import spotlight.driver as train_mod
from spotlight.cli import main
from spotlight.config import DiTRecipe
from spotlight.core.advantages import group_advantages
from spotlight.core.tracking import read_metrics
from spotlight.policy import load_policy
from spotlight.prompt_cache import PREFETCH_THREAD, PromptCache, UncachedPrompts
from spotlight.rollout import rollout
from spotlight.sampling import qwen_image_sigmas, sde_step_indices
from spotlight.update import GRPOTrainer

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
        policy,
        prompts,
        list(range(100 * iteration, 100 * iteration + len(prompts))),
        sigmas,
        noise_level=s.noise_level,
        sde_steps=sde_step_indices(s.num_steps, 0, 0),
        sde_type=s.sde_type,
        guidance_scale=s.guidance_scale,
        negative_prompt=s.negative_prompt,
        batch_size=s.batch_size,
    )
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
    for _ro, stats, encoded in runs[True][0]:
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
        f"model.path={tiny_model_dir}",
        "sample.num_steps=2",
        "sample.batch_size=4",
        "train.num_iterations=2",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.minibatch_size=4",
        "log.images_every=0",
        "data.num_heldout=8",
    ]
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
        tiny_policy.encode_prompts(prompts)
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


# -- prefetch: the next step's prompts encoded on a worker thread during this step -------------------


class FakeEncoder:
    """A text encoder stand-in: prompt -> a (1, 2) tensor; raises on prompts containing "boom"."""

    def __init__(self):
        self.calls: list[tuple[str, list[str]]] = []
        self.version = 0
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, prompts: list[str]) -> list[torch.Tensor]:
        self.gate.wait(timeout=10)
        self.calls.append((threading.current_thread().name, list(prompts)))
        if any("boom" in p for p in prompts):
            raise RuntimeError(f"encoder failed on {prompts}")
        return [torch.tensor([[float(len(p)), float(self.version)]]) for p in prompts]

    def cache(self) -> PromptCache:
        return PromptCache(self, lambda: self.version)


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD)]


def test_prefetch_serves_the_next_step_from_the_worker_thread():
    enc = FakeEncoder()
    cache = enc.cache()
    cache.begin_step(["b", "a", "b"], next_prompts=["c", "dd", "c"])
    assert cache.prefetching == ["c", "dd"]  # the batch begin_step would encode: sorted, distinct
    first = cache.end_step()
    assert not first.prefetched and first.num_forwards == 1
    cache.begin_step(["dd", "c"], next_prompts=None)
    assert cache.prefetching == [] and cache.num_held == 2
    assert torch.equal(cache.lookup(["dd"])[0], torch.tensor([[2.0, 0.0]]))
    stats = cache.end_step()
    assert stats.prefetched and stats.num_forwards == 1 and stats.num_encoded == 2 and stats.calls_per_prompt == 1.0
    assert stats.metrics()["time/prompt_encoder_wait_s"] == stats.wait_s >= 0
    assert enc.calls[0] == ("MainThread", ["a", "b"]) and enc.calls[1][1] == ["c", "dd"]
    assert enc.calls[1][0].startswith(PREFETCH_THREAD)
    assert cache.prefetch_used == 1 and cache.prefetch_discarded == 0
    cache.close()
    assert not _prefetch_threads()


def test_prefetch_of_other_prompts_or_under_other_weights_is_discarded():
    enc = FakeEncoder()
    cache = enc.cache()
    # Other prompts than the step's: dropped, the step encodes its own batch.
    cache.begin_step(["a"], next_prompts=["b"])
    cache.end_step()
    cache.begin_step(["b", "c"])
    stats = cache.end_step()
    assert not stats.prefetched and cache.prefetch_discarded == 1 and enc.calls[-1][1] == ["b", "c"]
    # The encoder's weights changed after the prefetch was asked for: dropped, recomputed.
    cache.begin_step(["a"], next_prompts=["b"])
    cache.end_step()
    enc.version = 1
    cache.begin_step(["b"])
    assert torch.equal(cache.lookup(["b"])[0], torch.tensor([[1.0, 1.0]]))
    assert not cache.end_step().prefetched and cache.prefetch_discarded == 2 and cache.invalidations == 1
    # Memory: at most one prefetched step; a second prefetch waits for the first (still running
    # here) and drops it.
    enc.gate.clear()
    cache.prefetch(["x"])
    threading.Timer(0.2, enc.gate.set).start()
    cache.prefetch(["y", "z"])
    assert ["x"] in [c[1] for c in enc.calls]  # done before the second was submitted
    assert cache.prefetching == ["y", "z"] and cache.prefetch_discarded == 3
    assert len(_prefetch_threads()) == 1
    cache.close()
    assert cache.prefetching == [] and cache.prefetch_discarded == 4 and not _prefetch_threads()


def test_prefetch_errors_surface_in_the_driver_thread(caplog):
    enc = FakeEncoder()
    cache = enc.cache()
    cache.begin_step(["a"], next_prompts=["boom"])
    cache.end_step()
    with pytest.raises(RuntimeError, match="encoder failed"):
        cache.begin_step(["boom"])  # the step that takes the prefetch raises its error
    cache.end_step()
    # A failed prefetch nobody took is raised at close (the end of a run)...
    cache.prefetch(["boom again"])
    with pytest.raises(RuntimeError, match="encoder failed"):
        cache.close()
    assert not _prefetch_threads()
    # ...or, when the loop already raised, logged while the loop's own error propagates.
    with pytest.raises(KeyError, match="the loop's"):
        with cache.prefetch_scope():
            cache.prefetch(["boom"])
            raise KeyError("the loop's")
    assert "prompt prefetch failed" in caplog.text and not _prefetch_threads()
    # The cache still works after all that.
    cache.begin_step(["a"])
    assert cache.end_step().num_encoded == 1


def test_prefetched_embeddings_are_the_same_bits_while_the_transformer_runs(tiny_policy):
    """The worker thread runs with the driver's intra-op thread count, concurrently with a rollout on
    the driver's thread: same embeddings and same rollout as sequentially, and the tiny model's
    kernels give the same bits at 1 and 2 threads."""
    prompts = ["one red circle", "two blue squares", "three green triangles", "four yellow circles"]
    reference = tiny_policy._encode_uncached(sorted(prompts))
    sigmas = qwen_image_sigmas(3, tiny_policy.latent_shape[0])
    rows = [p for p in PROMPTS for _ in range(G)]

    def sample():
        return rollout(tiny_policy, rows, list(range(len(rows))), sigmas, noise_level=0.0, batch_size=len(rows)).images

    cache = tiny_policy.prompt_cache
    cache.begin_step(rows)
    alone = sample()
    cache.end_step()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = tiny_policy._encode_uncached(sorted(prompts))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(reference, one_thread))
    for _ in range(3):
        cache.begin_step(rows, next_prompts=prompts)  # encodes on the worker while this step's rollout runs
        overlapped = sample()
        cache.end_step()
        assert torch.equal(overlapped, alone)
        cache.begin_step(prompts)
        held = cache.lookup(sorted(prompts))
        assert cache.end_step().prefetched
        assert all(torch.equal(a, b) for a, b in zip(held, reference, strict=True))
    cache.close()


def _recorded_driver(monkeypatch) -> SimpleNamespace:
    """Records the driver's policy, its encoder calls (thread, prompts, embeddings) and its rollouts."""
    rec = SimpleNamespace(policy=None, encodes=[], rollouts=[], fail_at_rollout=None)
    real_load, real_rollout = load_policy, rollout  # the modules' own, not an earlier test's wrappers

    def load(*args, **kwargs):
        policy = real_load(*args, **kwargs)
        encode_fn = policy.prompt_cache._encode_fn

        def encode(prompts):
            embs = encode_fn(prompts)
            rec.encodes.append((threading.current_thread().name, list(prompts), embs))
            return embs

        policy.prompt_cache._encode_fn = encode
        rec.policy = policy
        return policy

    def sample(*args, **kwargs):
        if len(rec.rollouts) == rec.fail_at_rollout:
            raise RuntimeError("the node went away")
        ro = real_rollout(*args, **kwargs)
        rec.rollouts.append(ro)
        return ro

    monkeypatch.setattr(train_mod, "load_policy", load)
    monkeypatch.setattr(train_mod, "rollout", sample)
    return rec


def test_prefetch_through_the_driver_is_bit_identical_and_resumes(tiny_model_dir, tmp_path, monkeypatch):
    """`spotlight train` with and without train.prefetch_prompts, and with it interrupted by an error
    and resumed: the same encoder batches and embeddings, rollouts and trained weights, bit for bit.
    True CFG makes the driver's thread encode the negative prompt while the prefetch may run."""
    overrides = [
        f"model.path={tiny_model_dir}",
        "sample.num_steps=2",
        "sample.batch_size=4",
        "sample.guidance_scale=2.0",
        "train.num_iterations=3",
        "train.prompts_per_iteration=2",
        "train.group_size=4",
        "train.minibatch_size=4",
        "train.lr_cooldown=0",
        "log.images_every=0",
        "log.checkpoint_every=1",
        "data.num_heldout=8",
    ]
    runs = {}
    for prefetch in (False, True):
        rec = _recorded_driver(monkeypatch)
        run_dir = tmp_path / f"prefetch-{prefetch}"
        assert (
            main(["train", *overrides, f"train.prefetch_prompts={prefetch}", "--run-dir", str(run_dir), "--quiet"]) == 0
        )
        runs[prefetch] = rec, read_metrics(run_dir)
        assert not _prefetch_threads()
    (off, off_rows), (on, on_rows) = runs[False], runs[True]
    for rows in (off_rows, on_rows):
        assert all(r["prompt_encoder/calls_per_prompt"] == 1.0 and r["prompt_encoder/forwards"] == 2.0 for r in rows)
        assert all(r["time/prompt_encoder_wait_s"] >= 0 for r in rows)

    # The same batches (each step's sorted distinct prompts, and the negative prompt in its own), to
    # the same bits; with prefetch the steps after the first were encoded on the worker thread.
    def batches(rec, negative: bool):
        return [(t, p, e) for t, p, e in rec.encodes if (p == [" "]) == negative]

    for negative in (False, True):
        a, b = batches(off, negative), batches(on, negative)
        assert [p for _, p, _ in a] == [p for _, p, _ in b] and len(a) == 3
        for (_, _, x), (_, _, y) in zip(a, b):
            assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
    assert all(t == "MainThread" for t, _, _ in off.encodes)
    threads = [t for t, _, _ in batches(on, False)]
    assert threads[0] == "MainThread" and all(t.startswith(PREFETCH_THREAD) for t in threads[1:])
    assert all(t == "MainThread" for t, _, _ in batches(on, True))
    for a, b in zip(off.rollouts, on.rollouts, strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)
    weights = off.policy.transformer.state_dict()
    assert all(torch.equal(v, on.policy.transformer.state_dict()[k]) for k, v in weights.items())

    # Interrupted in iteration 2's rollout, while iteration 3's prompts are being prefetched: the
    # error propagates and the worker is stopped; the resumed run encodes iteration 2 itself,
    # prefetches iteration 3, and ends on the same weights.
    run_dir = tmp_path / "interrupted"
    rec = _recorded_driver(monkeypatch)
    rec.fail_at_rollout = 1
    with pytest.raises(RuntimeError, match="the node went away"):
        main(["train", *overrides, "--run-dir", str(run_dir), "--quiet"])
    assert not _prefetch_threads() and rec.policy.prompt_cache.prefetching == []
    assert rec.policy.prompt_cache.prefetch_discarded == 1
    rec = _recorded_driver(monkeypatch)
    assert main(["train", *overrides, "--run-dir", str(run_dir), "--quiet"]) == 0
    threads = [t for t, p, _ in rec.encodes if p != [" "]]
    assert threads[0] == "MainThread" and threads[1].startswith(PREFETCH_THREAD) and len(threads) == 2
    assert [p for _, p, _ in rec.encodes if p != [" "]] == [p for _, p, _ in batches(on, False)[1:]]
    assert len(read_metrics(run_dir)) == 3
    for a, b in zip(rec.rollouts, on.rollouts[1:], strict=True):
        assert torch.equal(a.images, b.images) and torch.equal(a.trajectory.latents, b.trajectory.latents)
    assert all(torch.equal(v, rec.policy.transformer.state_dict()[k]) for k, v in weights.items())
