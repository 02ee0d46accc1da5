"""Tests of the reward registry, the shapes task, JPEG compressibility and the CLIP reward."""

from __future__ import annotations

import io
import logging
import math
import time

import numpy as np
import pytest
import torch
from PIL import Image

from spotlight.rewards import REWARDS, build_reward, register_reward
from spotlight.rewards import shapes as S


def _render(prompts: list[str], size: int = 64, seed: int = 0) -> torch.Tensor:
    return S.render_batch(prompts, size, seed)


def _shapes_score(images: torch.Tensor, prompts: list[str]) -> np.ndarray:
    return S.score_images(images.permute(0, 2, 3, 1).numpy(), prompts)


@pytest.fixture
def failing_rewards():
    """Registers rewards that fail in known ways, and removes them afterwards."""
    names = ["test_raises", "test_nan_first", "test_inf_last", "test_bad_shape", "test_scaled"]

    @register_reward("test_raises")
    def make_raises():
        def fn(images, prompts):
            raise RuntimeError("reward server unreachable")

        return fn

    @register_reward("test_nan_first")
    def make_nan_first():
        def fn(images, prompts):
            scores = torch.ones(len(prompts))
            scores[0] = float("nan")
            return scores

        return fn

    @register_reward("test_inf_last")
    def make_inf_last():
        def fn(images, prompts):
            scores = torch.zeros(len(prompts), dtype=torch.float64)
            scores[-1] = float("inf")
            return scores

        return fn

    @register_reward("test_bad_shape")
    def make_bad_shape():
        return lambda images, prompts: torch.zeros(len(prompts), 2)

    @register_reward("test_scaled")
    def make_scaled(test_scale: float = 1.0):
        return lambda images, prompts: torch.full((len(prompts),), test_scale)

    yield
    for name in names:
        REWARDS.pop(name)


# ---------------------------------------------------------------------------------------------
# Registry and combination


def test_registered_rewards():
    assert {"shapes", "jpeg_compressibility", "clip_score"} <= set(REWARDS)


def test_combination_is_the_weighted_sum():
    prompts = [
        "two red circles",
        "one blue square and three green triangles",
        "four yellow squares",
    ]
    images = _render(prompts)
    reward = build_reward({"shapes": 2.0, "jpeg_compressibility": 0.5})
    result = reward(images, prompts)
    assert set(result.components) == {"shapes", "jpeg_compressibility"}
    for scores in [result.total_B, *result.components.values()]:
        assert scores.shape == (3,) and scores.dtype == torch.float32
    expected = 2.0 * result.components["shapes"] + 0.5 * result.components["jpeg_compressibility"]
    torch.testing.assert_close(result.total_B, expected)
    torch.testing.assert_close(result.components["shapes"], torch.ones(3))
    assert result.num_failed == 0


def test_raising_reward_fails_its_batch_but_not_the_others(failing_rewards, caplog):
    prompts = ["one red circle", "two blue squares"]
    reward = build_reward({"shapes": 1.0, "test_raises": 1.0})
    with caplog.at_level(logging.WARNING, logger="spotlight.rewards"):
        result = reward(_render(prompts), prompts)
    assert torch.isnan(result.total_B).all() and result.num_failed == 2
    assert torch.isnan(result.components["test_raises"]).all()
    torch.testing.assert_close(result.components["shapes"], torch.ones(2))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "test_raises" in warnings[0].getMessage()
    assert "reward server unreachable" in warnings[0].getMessage()


def test_non_finite_scores_fail_only_their_samples(failing_rewards, caplog):
    prompts = ["one red circle", "two blue squares", "three green triangles"]
    reward = build_reward({"shapes": 1.0, "test_nan_first": 1.0, "test_inf_last": 0.5})
    with caplog.at_level(logging.WARNING, logger="spotlight.rewards"):
        result = reward(_render(prompts), prompts)
    assert torch.isnan(result.total_B).tolist() == [True, False, True]
    assert result.num_failed == 2
    assert result.total_B[1].item() == pytest.approx(2.0)
    assert torch.isnan(result.components["test_inf_last"]).tolist() == [False, False, True]
    assert result.components["test_inf_last"].dtype == torch.float32
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert any("test_nan_first" in m and "1 of 3" in m for m in messages)
    assert any("test_inf_last" in m and "1 of 3" in m for m in messages)


def test_wrong_shape_is_a_failure(failing_rewards):
    prompts = ["one red circle", "two blue squares"]
    result = build_reward({"test_bad_shape": 1.0})(_render(prompts), prompts)
    assert torch.isnan(result.total_B).all() and result.num_failed == 2


def test_off_grammar_prompt_fails_the_shapes_batch():
    prompts = ["one red circle", "a photo of a cat"]
    result = build_reward({"shapes": 1.0})(_render(["one red circle"] * 2), prompts)
    assert result.num_failed == 2


def test_unknown_reward_name():
    with pytest.raises(ValueError) as error:
        build_reward({"shape": 1.0})
    message = str(error.value)
    assert "'shape'" in message and "Did you mean 'shapes'?" in message
    assert "jpeg_compressibility" in message and "clip_score" in message


def test_options_go_only_to_the_rewards_that_take_them(failing_rewards):
    prompts = ["one red circle", "two blue squares"]
    # clip_model_path belongs to a reward not chosen here: ignored, so no missing-path error.
    reward = build_reward({"test_scaled": 1.0}, test_scale=3.0, clip_model_path="/nonexistent")
    torch.testing.assert_close(reward(_render(prompts), prompts).total_B, torch.full((2,), 3.0))
    with pytest.raises(ValueError, match="Did you mean 'test_scale'"):
        build_reward({"test_scaled": 1.0}, test_scal=3.0)


def test_registration_and_weight_errors(failing_rewards):
    with pytest.raises(ValueError, match="already registered"):
        register_reward("shapes")(lambda: None)
    with pytest.raises(ValueError, match="empty"):
        build_reward({})
    with pytest.raises(ValueError, match="finite"):
        build_reward({"shapes": math.nan})
    reward = build_reward({"shapes": 1.0})
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(_render(["one red circle"] * 2), ["one red circle"])


# ---------------------------------------------------------------------------------------------
# Shapes grammar


def test_parse_prompt():
    assert S.parse_prompt("two red circles and one blue square") == [
        S.Clause(2, "red", "circle"),
        S.Clause(1, "blue", "square"),
    ]
    assert S.parse_prompt("  Four  YELLOW triangles ") == [S.Clause(4, "yellow", "triangle")]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "two red circle",
        "one red circles",
        "five red circles",
        "two purple circles",
        "two red hexagons",
        "one red circle and one red square",
        "one red circle and one blue square and one green triangle",
        "one red circle and",
        "and one red circle",
        "red circle",
        "a photo of a cat",
    ],
)
def test_parse_errors_name_the_text(text):
    with pytest.raises(ValueError) as error:
        S.parse_prompt(text)
    assert repr(text) in str(error.value)


def test_all_prompts_round_trip():
    prompts = S.all_prompts()
    assert len(S.all_prompts(1)) == 48 and len(prompts) == 48 + 48 * 36
    assert len(set(prompts)) == len(prompts)
    assert prompts == S.all_prompts()
    for prompt in prompts:
        assert S.format_prompt(S.parse_prompt(prompt)) == prompt
    with pytest.raises(ValueError, match="max_clauses"):
        S.all_prompts(3)


def test_split_prompts():
    train, heldout = S.split_prompts(seed=0, num_heldout=100)
    assert len(heldout) == 100 and len(train) == len(S.all_prompts()) - 100
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(S.all_prompts())
    assert S.split_prompts(seed=0, num_heldout=100) == (train, heldout)
    assert S.split_prompts(seed=1, num_heldout=100)[1] != heldout
    with pytest.raises(ValueError, match="num_heldout"):
        S.split_prompts(seed=0, num_heldout=len(S.all_prompts()))


# ---------------------------------------------------------------------------------------------
# Rendering


@pytest.mark.parametrize("size", [32, 64, 256])
def test_render_prompt(size):
    prompt = "four red squares and four blue triangles"  # the most crowded kind of prompt
    image = S.render_prompt(prompt, size, np.random.default_rng(0))
    assert image.shape == (size, size, 3) and image.dtype == np.float32
    colors = {tuple(c) for c in np.unique((image * 255).round().reshape(-1, 3), axis=0)}
    assert colors == {S.BACKGROUND, S.PALETTE["red"], S.PALETTE["blue"]}
    np.testing.assert_array_equal(image, S.render_prompt(prompt, size, np.random.default_rng(0)))
    blobs = S.analyze_images(image[None])[0].blobs
    assert sorted((b.color, b.shape) for b in blobs) == [("blue", "triangle")] * 4 + [("red", "square")] * 4


def test_render_errors():
    with pytest.raises(ValueError, match="size"):
        S.render_prompt("one red circle", 16, np.random.default_rng(0))
    with pytest.raises(ValueError, match="grammar"):
        S.render_prompt("one red cube", 64, np.random.default_rng(0))


def test_render_batch_is_per_sample_deterministic():
    images = _render(["one red circle", "two blue squares"], seed=3)
    assert images.shape == (2, 3, 64, 64) and images.dtype == torch.float32
    assert 0 <= images.min() and images.max() <= 1
    other = _render(["four green triangles", "two blue squares"], seed=3)
    torch.testing.assert_close(images[1], other[1])
    assert not torch.equal(images[1], _render(["one red circle", "two blue squares"], seed=4)[1])


# ---------------------------------------------------------------------------------------------
# Shapes reward


def test_noisy_caption_target():
    rng = np.random.default_rng(0)
    prompt = "two red circles and one blue square"
    assert S.noisy_caption_target(prompt, 0.0, rng) == prompt
    drawn = [S.parse_prompt(S.noisy_caption_target(prompt, 1.0, rng)) for _ in range(400)]
    assert all([c.color for c in d] == ["red", "blue"] for d in drawn), "colours are kept"
    assert {d[0].count for d in drawn} == {1, 2, 3, 4} and {d[1].shape for d in drawn} == set(S.SHAPES)
    # At noise 0.5 a clause is redrawn half the time and then keeps its count by chance 1/4.
    half = [S.parse_prompt(S.noisy_caption_target(prompt, 0.5, rng))[0].count for _ in range(2000)]
    assert abs(np.mean([c == 2 for c in half]) - (0.5 + 0.5 / 4)) < 0.04
    with pytest.raises(ValueError, match="caption noise"):
        S.noisy_caption_target(prompt, 1.5, rng)


def test_ground_truth_scores_high():
    prompts = list(np.random.default_rng(0).choice(S.all_prompts(), 128))
    scores = _shapes_score(_render(prompts, seed=1), prompts)
    assert scores.mean() >= 0.95 and scores.min() >= 0.8


def test_blank_and_noise_score_low():
    prompts = list(np.random.default_rng(1).choice(S.all_prompts(), 32))
    assert _shapes_score(torch.ones(32, 3, 64, 64), prompts).max() <= 0.05
    noise = torch.rand(32, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert _shapes_score(noise, prompts).max() <= 0.2


def _paint_extra_square(image_HW3: np.ndarray, color: str) -> np.ndarray:
    """A copy of the image with a 10x10 square of `color` in the first empty 14x14 window."""
    white = (image_HW3 == 1).all(-1)
    for y in range(0, image_HW3.shape[0] - 14, 2):
        for x in range(0, image_HW3.shape[1] - 14, 2):
            if white[y : y + 14, x : x + 14].all():
                painted = image_HW3.copy()
                painted[y + 2 : y + 12, x + 2 : x + 12] = np.array(S.PALETTE[color]) / 255
                return painted
    raise AssertionError("no empty window")


@pytest.mark.parametrize(
    ("prompt", "wrong_count", "wrong_shape", "extra_color"),
    [
        ("two red circles", "three red circles", "two red squares", "blue"),
        ("one green triangle", "two green triangles", "one green circle", "yellow"),
        ("four yellow squares", "three yellow squares", "four yellow circles", "red"),
        (
            "three blue squares and one yellow circle",
            "three blue squares and two yellow circles",
            "three blue triangles and one yellow circle",
            "green",
        ),
    ],
)
def test_mistakes_score_lower(prompt, wrong_count, wrong_shape, extra_color):
    for seed in range(3):
        correct = S.render_prompt(prompt, 64, np.random.default_rng(seed))
        images = [
            correct,
            S.render_prompt(wrong_count, 64, np.random.default_rng(seed)),
            S.render_prompt(wrong_shape, 64, np.random.default_rng(seed)),
            _paint_extra_square(correct, extra_color),
        ]
        scores = S.score_images(np.stack(images), [prompt] * 4)
        assert scores[0] == pytest.approx(1.0)
        assert max(scores[1:]) < scores[0]
        # The all-or-nothing verdict: partial credit for a mistake is none.
        np.testing.assert_array_equal(S.exact_images(np.stack(images), [prompt] * 4), [1, 0, 0, 0])


def test_unclear_pixels_reduce_the_score_mildly():
    prompts = ["two red circles", "one blue square and four green triangles"]
    images = _render(prompts)
    grey = images.clone()
    grey[(images == 1).all(1, keepdim=True).expand_as(images)] = 0.5  # background to grey
    scores = _shapes_score(grey, prompts)
    assert (scores < 1).all() and (scores > 0.7).all()


def test_classify_shape_on_ideal_features():
    assert S.classify_shape(100, 10, 10, 0.0, 4096) == "square"
    assert S.classify_shape(79, 10, 10, 0.0, 4096) == "circle"
    assert S.classify_shape(50, 10, 10, 0.16, 4096) == "triangle"
    assert S.classify_shape(60, 4, 15, 0.0, 4096) == "other"  # a streak
    assert S.classify_shape(4096, 64, 64, 0.0, 4096) == "other"  # a painted canvas


def test_shapes_reward_is_fast():
    prompts = list(np.random.default_rng(2).choice(S.all_prompts(), 64))
    images = _render(prompts)
    reward = build_reward({"shapes": 1.0})
    reward(images, prompts)
    # A generous bound for a loaded 2-core CI machine; it takes about 0.03 s alone.
    start = time.perf_counter()
    result = reward(images, prompts)
    assert time.perf_counter() - start < 1.0
    assert result.num_failed == 0


# ---------------------------------------------------------------------------------------------
# JPEG compressibility


def test_jpeg_compressibility():
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images = torch.cat([flat, noise])
    scores = build_reward({"jpeg_compressibility": 1.0})(images, ["", ""]).total_B
    assert scores.dtype == torch.float32 and (scores < 0).all()
    assert scores[0] > scores[1]
    buffer = io.BytesIO()
    pixels = (noise[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
    assert scores[1].item() == pytest.approx(-len(buffer.getvalue()) / 1000)
    low_quality = build_reward({"jpeg_compressibility": 1.0}, jpeg_quality=50)
    assert low_quality(images, ["", ""]).total_B[1] > scores[1]
    with pytest.raises(ValueError, match="reward.jpeg_quality"):
        build_reward({"jpeg_compressibility": 1.0}, jpeg_quality=100)


# ---------------------------------------------------------------------------------------------
# CLIP score


@pytest.fixture(scope="module")
def tiny_clip_dirs(tmp_path_factory):
    """A tiny random CLIPModel in one directory, its tokenizer and image processor in another.

    The tokenizer is a word-level one trained here on the shapes grammar, so that nothing is
    downloaded; the model is random, which is all a test of the plumbing needs.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    model_dir = tmp_path_factory.mktemp("clip_model")
    processor_dir = tmp_path_factory.mktemp("clip_processor")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    tokenizer.train_from_iterator(S.all_prompts(), trainers.WordLevelTrainer(special_tokens=specials))
    pad, bos, eos = (tokenizer.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>"))
    # CLIP pools the text at the end-of-text token, so every sequence must carry one.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", bos), ("<eos>", eos)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    ).save_pretrained(processor_dir)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(processor_dir)
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=tokenizer.get_vocab_size(),
            max_position_embeddings=16,
            pad_token_id=pad,
            bos_token_id=bos,
            eos_token_id=eos,
            **tiny,
        ),
        vision_config=dict(image_size=32, patch_size=8, **tiny),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(model_dir)
    return str(model_dir), str(processor_dir)


def test_clip_score(tiny_clip_dirs):
    model_dir, processor_dir = tiny_clip_dirs
    prompts = [
        "two red circles",
        "one blue square and three green triangles",
        "four yellow squares",
    ]
    images = _render(prompts)
    options = dict(clip_model_path=model_dir, clip_processor_path=processor_dir, clip_device="cpu")
    reward = build_reward({"clip_score": 1.0}, **options)
    result = reward(images, prompts)
    scores = result.components["clip_score"]
    assert scores.shape == (3,) and scores.dtype == torch.float32
    assert torch.isfinite(scores).all() and (scores.abs() <= 1 + 1e-5).all()
    assert result.num_failed == 0
    torch.testing.assert_close(reward(images, prompts).total_B, result.total_B)
    # A second load of the same checkpoint scores the same: no randomness in loading.
    again = build_reward({"clip_score": 1.0}, **options)
    torch.testing.assert_close(again(images, prompts).total_B, result.total_B)
    # The images and prompts do matter.
    assert not torch.equal(reward(images, prompts[::-1]).total_B, result.total_B)


def test_clip_score_reads_a_single_directory(tiny_clip_dirs, tmp_path):
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    model_dir, processor_dir = tiny_clip_dirs
    CLIPModel.from_pretrained(model_dir).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(processor_dir).save_pretrained(tmp_path)
    AutoImageProcessor.from_pretrained(processor_dir).save_pretrained(tmp_path)
    prompts = ["one red circle", "two blue squares"]
    images = _render(prompts)
    single = build_reward({"clip_score": 1.0}, clip_model_path=str(tmp_path))(images, prompts)
    split = build_reward({"clip_score": 1.0}, clip_model_path=model_dir, clip_processor_path=processor_dir)(
        images, prompts
    )
    torch.testing.assert_close(single.total_B, split.total_B)


def test_clip_missing_path(tmp_path):
    missing = str(tmp_path / "no_such_checkpoint")
    with pytest.raises(ValueError) as error:
        build_reward({"clip_score": 1.0}, clip_model_path=missing)
    assert missing in str(error.value) and "reward.clip_model_path" in str(error.value)
    with pytest.raises(ValueError, match="reward.clip_model_path"):
        build_reward({"clip_score": 1.0})


def test_breakdown_parts_of_known_images_and_as_zero_weight_rewards():
    truth = ["two red circles and one blue square", "three yellow triangles"]
    rendered = _render(truth, seed=3)
    parts = S.breakdown_images(rendered.permute(0, 2, 3, 1).numpy(), truth)
    assert set(parts) == set(S.BREAKDOWN)
    for part, want in {"present": 1.0, "count": 1.0, "shape": 1.0, "extra_blobs": 0.0}.items():
        np.testing.assert_array_equal(parts[part], [want, want], err_msg=part)
    # The same images against other prompts: the render of two red circles and one blue square is
    # scored for one red circle (count off, shape right) and two green squares (absent), and
    # shows blue blobs the prompt does not name; three yellow triangles are drawn for two.
    other = ["one red circle and two green squares", "two yellow triangles"]
    parts = S.breakdown_images(rendered.permute(0, 2, 3, 1).numpy(), other)
    np.testing.assert_array_equal(parts["present"], [0.5, 1.0])
    np.testing.assert_array_equal(parts["count"], [0.0, 0.0])
    np.testing.assert_array_equal(parts["shape"], [0.5, 1.0])
    np.testing.assert_array_equal(parts["extra_blobs"], [1.0, 0.0])
    blank = S.breakdown_images(np.ones((1, 64, 64, 3), dtype=np.float32), truth[:1])
    assert {k: float(v[0]) for k, v in blank.items()} == {
        "present": 0.0,
        "count": 0.0,
        "shape": 0.0,
        "extra_blobs": 0.0,
        "unclear": 0.0,
    }

    # Registered as rewards: weight 0 logs a part without changing the total.
    reward = build_reward({"shapes": 1.0, "shapes_count": 0.0, "shapes_extra_blobs": 0.0})
    result = reward(rendered, other)
    torch.testing.assert_close(result.total_B, result.components["shapes"])
    torch.testing.assert_close(result.components["shapes_count"], torch.zeros(2))
    torch.testing.assert_close(result.components["shapes_extra_blobs"], torch.tensor([1.0, 0.0]))


def test_exact_reward_is_registered_and_all_or_nothing():
    """`shapes_exact` (per image: right as a whole, GenEval's verdict); test_mistakes_score_lower
    checks it on one mistake of each kind."""
    prompt = "three blue squares and one yellow circle"
    images = _render([prompt, "three blue squares and two yellow circles"])
    assert S.exact_images(np.ones((1, 64, 64, 3), dtype=np.float32), [prompt]).tolist() == [0.0]
    result = build_reward({"shapes_exact": 1.0, "shapes": 0.0})(images, [prompt, prompt])
    torch.testing.assert_close(result.total_B, torch.tensor([1.0, 0.0]))
    assert 0 < float(result.components["shapes"][1]) < 1  # the partial credit the exact verdict withholds
    assert build_reward({"shapes_exact": 1.0})(images[:1], ["a photo of a cat"]).num_failed == 1
