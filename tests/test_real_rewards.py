"""The real-model rewards (ocr, geneval, pickscore) with tiny random instances of the real classes.

The pure parts (edit distance, prompt parsing, colour names, detection scoring) are checked with
exact numbers; the model parts load tiny random checkpoints through the rewards' real
`from_pretrained` path (`spotlight.rewards.tiny`), so only the plumbing is checked there.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from spotlight.config import RewardConfig
from spotlight.rewards import build_reward
from spotlight.rewards import geneval as GE
from spotlight.rewards.local_models import to_uint8_images
from spotlight.rewards.ocr import OcrReader, levenshtein, normalize_text, ocr_score, quoted_text

OCR_TEXTS = ["OPEN 24 HOURS", "Hello World", "SALE", "coffee & tea"]
OCR_PROMPTS = [f'A sign that says "{t}"' for t in OCR_TEXTS]
LABELS = ["apple", "cup", "dog", "teddy bear"]


def _images(num: int, height: int = 40, width: int = 48, seed: int = 0) -> torch.Tensor:
    return torch.rand(num, 3, height, width, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Tiny random reader, detector and CLIP folders, as save_pretrained writes them."""
    from spotlight.rewards.tiny import build_tiny_clip, build_tiny_detector, build_tiny_got_ocr, build_tiny_ocr_reader

    root = tmp_path_factory.mktemp("reward_models")
    return {
        "trocr": str(build_tiny_ocr_reader(root / "trocr", OCR_TEXTS)),
        "got_ocr": str(build_tiny_got_ocr(root / "got_ocr", OCR_TEXTS)),
        "detector": str(build_tiny_detector(root / "detector", LABELS)),
        "clip": str(build_tiny_clip(root / "clip", OCR_PROMPTS + ["two red apples and a blue cup"])),
    }


# ---------------------------------------------------------------------------------------------
# OCR: text scoring


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("abc", "", 3), ("abc", "abc", 0), ("ab", "ba", 2)],
)
def test_levenshtein(a, b, distance):
    assert levenshtein(a, b) == distance
    assert levenshtein(b, a) == distance


def test_quoted_text():
    assert quoted_text('A sign that says "OPEN 24 HOURS"') == "OPEN 24 HOURS"
    assert quoted_text("A mug with \u201cTea Time\u201d on it") == "Tea Time"
    assert quoted_text('Two signs: "LEFT" and "RIGHT"') == "LEFT RIGHT"
    assert quoted_text("A sign with no text") is None
    assert quoted_text('An empty sign ""') is None


def test_ocr_score_exact_numbers():
    target = "OPEN 24 HOURS"  # 11 characters once the spaces go
    assert normalize_text(target) == "open24hours"
    assert ocr_score("OPEN 24 HOURS", target) == 1.0
    assert ocr_score("open24hours", target) == 1.0  # case and whitespace do not count
    assert ocr_score("OPEN 24 H0URS", target) == pytest.approx(1 - 1 / 11)
    assert ocr_score("OPEN", target) == pytest.approx(4 / 11)  # 7 characters missing
    assert ocr_score("SALES", "SALE") == pytest.approx(0.75)  # one extra character
    assert ocr_score("SLE", "SALE") == pytest.approx(0.75)
    assert ocr_score("", "SALE") == 0.0
    assert ocr_score("a long unrelated paragraph of text", "SALE") == 0.0  # clamped, not negative
    with pytest.raises(ValueError, match="no characters"):
        ocr_score("x", "  ")


# ---------------------------------------------------------------------------------------------
# OCR: the reward with tiny readers of both kinds


@pytest.mark.parametrize("reader_kind", ["trocr", "got_ocr"])  # encoder-decoder, decoder-only
def test_ocr_reward_reads_and_scores(tiny_dirs, reader_kind):
    images = _images(4)
    prompts = [*OCR_PROMPTS[:3], "A sign with no quoted text"]
    path = tiny_dirs[reader_kind]
    reward = build_reward({"ocr": 1.0}, ocr_model_path=path, ocr_max_new_tokens=12, ocr_device="cpu", batch_size=2)
    scores = reward(images, prompts).components["ocr"]
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.isnan(scores[3])  # no target: dropped, not scored
    assert ((scores[:3] >= 0) & (scores[:3] <= 1)).all()
    # The reward is exactly the text score of what the reader reads (read here with another batch size).
    reader = OcrReader(path, torch.device("cpu"), max_new_tokens=12, batch_size=1)
    read = reader.read(to_uint8_images(images[:3]))
    assert all(isinstance(t, str) and t for t in read)  # the decoder-only reader's prompt is not in it
    assert not any("OCR" in t or "assistant" in t for t in read)
    expected = torch.tensor([ocr_score(t, quoted_text(p)) for t, p in zip(read, prompts[:3])])
    torch.testing.assert_close(scores[:3], expected)
    # Deterministic: the same scores again, and from a second load.
    torch.testing.assert_close(reward(images, prompts).components["ocr"], scores, equal_nan=True)
    again = build_reward({"ocr": 1.0}, ocr_model_path=path, ocr_max_new_tokens=12, ocr_device="cpu")
    torch.testing.assert_close(again(images, prompts).components["ocr"], scores, equal_nan=True)


def test_ocr_reading_ends_at_the_first_special_token(tiny_dirs):
    reader = OcrReader(tiny_dirs["got_ocr"], torch.device("cpu"), max_new_tokens=4, batch_size=1)
    tok = reader.tokenizer
    sale = tok("SALE", add_special_tokens=False).input_ids
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    # A leading start token is skipped; whatever follows the end of turn is no part of the reading.
    row = [start, *sale, end, *tok("more text", add_special_tokens=False).input_ids, tok.pad_token_id]
    assert reader._answer(row) == sale and tok.decode(reader._answer(row)) == "SALE"
    assert reader._answer([end, end]) == []


def test_ocr_missing_path(tmp_path):
    missing = str(tmp_path / "no_such_reader")
    with pytest.raises(ValueError) as error:
        build_reward({"ocr": 1.0}, ocr_model_path=missing)
    message = str(error.value)
    assert "'ocr'" in message and "reward.ocr_model_path" in message and missing in message
    assert "microsoft/trocr-base-printed" in message  # what to download
    with pytest.raises(ValueError, match="reward.ocr_model_path"):
        build_reward({"ocr": 1.0})


# ---------------------------------------------------------------------------------------------
# GenEval: prompts, colours, scoring


VOCAB = GE.label_vocabulary(["N/A", "person", "apple", "cup", "orange", "wine glass", "teddy bear", "dog", "mouse"])


def test_label_vocabulary():
    assert VOCAB["apples"] == "apple" and VOCAB["wine glasses"] == "wine glass" and VOCAB["people"] == "person"
    assert VOCAB["mice"] == "mouse" and VOCAB["computer mouse"] == "mouse" and VOCAB["teddy bears"] == "teddy bear"
    assert "n/a" not in VOCAB and "sofa" not in VOCAB  # an alias only where its label exists


@pytest.mark.parametrize(
    ("prompt", "spec"),
    [
        ("a photo of an apple", GE.PromptSpec((GE.ObjectSpec("apple", 1, False),))),
        (
            "two red apples and a blue cup",
            GE.PromptSpec((GE.ObjectSpec("apple", 2, True, "red"), GE.ObjectSpec("cup", 1, False, "blue"))),
        ),
        ("a photo of an orange", GE.PromptSpec((GE.ObjectSpec("orange", 1, False),))),  # the fruit
        ("A photo of an orange cup.", GE.PromptSpec((GE.ObjectSpec("cup", 1, False, "orange"),))),  # the colour
        (
            "three people, 2 wine glasses, and a mouse",
            GE.PromptSpec(
                (
                    GE.ObjectSpec("person", 3, True),
                    GE.ObjectSpec("wine glass", 2, True),
                    GE.ObjectSpec("mouse", 1, False),
                )
            ),
        ),
        (
            "a photo of a dog to the left of a teddy bear",
            GE.PromptSpec((GE.ObjectSpec("dog", 1, False), GE.ObjectSpec("teddy bear", 1, False)), relation="left of"),
        ),
        (
            "a photo of a white cup below two apples",
            GE.PromptSpec((GE.ObjectSpec("cup", 1, False, "white"), GE.ObjectSpec("apple", 2, True)), relation="below"),
        ),
    ],
)
def test_parse_prompt(prompt, spec):
    assert GE.parse_prompt(prompt, VOCAB) == spec


def test_parse_prompt_errors_name_the_prompt():
    with pytest.raises(ValueError, match="'a photo of a cat'.*'cat' is no label"):
        GE.parse_prompt("a photo of a cat", VOCAB)
    with pytest.raises(ValueError, match="count 0"):
        GE.parse_prompt("0 apples", VOCAB)


def test_classify_color():
    rgbs = [
        (220, 30, 30),
        (255, 140, 0),
        (240, 220, 30),
        (30, 160, 60),
        (30, 60, 220),
        (130, 40, 180),
        (250, 150, 190),
        (120, 70, 30),
        (10, 10, 10),
        (245, 245, 245),
        (128, 128, 128),
    ]
    names = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white", "gray"]
    assert [GE.classify_color(c) for c in rgbs] == names


def test_box_color_reads_the_centre_of_the_box():
    image = np.full((64, 64, 3), 255, dtype=np.uint8)
    image[10:30, 10:30] = (30, 60, 220)  # a blue square on white
    assert GE.box_color(image, (10, 10, 30, 30)) == "blue"
    # A loose box (twice the square's size): its central half is still the square.
    assert GE.box_color(image, (0, 0, 40, 40)) == "blue"
    assert GE.box_color(image, (40, 40, 64, 64)) == "white"


def _det(label, score, box=(0, 0, 10, 10), color=None):
    return GE.Detection(label, score, box, color)


def test_score_prompt_partial_credit():
    spec = GE.parse_prompt("two red apples and a blue cup", VOCAB)
    right = [_det("apple", 0.95, color="red"), _det("apple", 0.92, color="red"), _det("cup", 0.5, color="blue")]
    assert GE.score_prompt(spec, right) == 1.0
    # One apple of two, and a green cup: apples (1 + 1/2 + 1) / 3, cup (1 + 0) / 2.
    partial = [_det("apple", 0.95, color="red"), _det("cup", 0.5, color="green")]
    assert GE.score_prompt(spec, partial) == pytest.approx(((1 + 0.5 + 1) / 3 + 0.5) / 2)
    # An apple below the counting threshold does not count for "two apples"; a cup at 0.3 counts.
    weak = [_det("apple", 0.95, color="red"), _det("apple", 0.85, color="red"), _det("cup", 0.3, color="blue")]
    assert GE.score_prompt(spec, weak) == pytest.approx(((1 + 0.5 + 1) / 3 + 1) / 2)
    # Three red apples: count credit 1/2; the colour of the two best is checked.
    three = [
        _det("apple", 0.99, color="red"),
        _det("apple", 0.98, color="red"),
        _det("apple", 0.97, color="green"),
        right[2],
    ]
    assert GE.score_prompt(spec, three) == pytest.approx(((1 + 0.5 + 1) / 3 + 1) / 2)
    assert GE.score_prompt(spec, []) == 0.0


def test_score_prompt_relation():
    spec = GE.parse_prompt("a dog left of a teddy bear", VOCAB)
    dog, bear = _det("dog", 0.9, (0, 0, 20, 20)), _det("teddy bear", 0.9, (30, 0, 50, 20))
    assert GE.score_prompt(spec, [dog, bear]) == 1.0
    swapped = [_det("dog", 0.9, bear.box), _det("teddy bear", 0.9, dog.box)]
    assert GE.score_prompt(spec, swapped) == pytest.approx(2 / 3)  # both present, wrong side
    assert GE.score_prompt(spec, [dog]) == pytest.approx(1 / 3)
    # The best-scoring detection of each object decides the relation.
    decoy = _det("dog", 0.95, (60, 0, 70, 20))
    assert GE.score_prompt(spec, [dog, bear, decoy]) == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# GenEval: the reward with a tiny DETR


def test_geneval_reward_detects_and_scores(tiny_dirs):
    images = _images(4, 48, 64)
    prompts = ["two red apples and a blue cup", "a dog left of a teddy bear", "a photo of a cat", "three cups"]
    # Threshold 0: the random detector's low scores still count, so counting and colours run.
    options = dict(
        detector_model_path=tiny_dirs["detector"],
        detector_threshold=0.0,
        detector_count_threshold=0.0,
        detector_device="cpu",
    )
    reward = build_reward({"geneval": 1.0}, batch_size=3, **options)
    scores = reward(images, prompts).components["geneval"]
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert torch.isnan(scores[2])  # "cat" is no label of this detector
    valid = scores[[0, 1, 3]]
    assert ((valid >= 0) & (valid <= 1)).all()
    # The reward is score_prompt of the detector's detections, coloured from the image.
    detector = GE.Detector(tiny_dirs["detector"], torch.device("cpu"), min_score=0.0, batch_size=4)
    arrays = to_uint8_images(images)
    detections = detector.detect(arrays)
    assert all(d.label in LABELS and 0 <= d.score <= 1 for dets in detections for d in dets)
    vocab = GE.label_vocabulary(LABELS)
    for i in (0, 1, 3):
        dets = [GE.Detection(d.label, d.score, d.box, GE.box_color(arrays[i], d.box)) for d in detections[i]]
        expected = GE.score_prompt(GE.parse_prompt(prompts[i], vocab), dets, threshold=0.0, count_threshold=0.0)
        assert scores[i].item() == pytest.approx(expected, abs=1e-6)
    # Deterministic across calls and loads.
    again = build_reward({"geneval": 1.0}, **options)
    torch.testing.assert_close(again(images, prompts).components["geneval"], scores, equal_nan=True)
    # With GenEval's thresholds a random detector finds nothing: every parsed prompt scores 0.
    strict = build_reward({"geneval": 1.0}, detector_model_path=tiny_dirs["detector"], detector_device="cpu")
    assert strict(images, prompts).components["geneval"][[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]


def test_geneval_missing_path(tmp_path):
    missing = str(tmp_path / "no_such_detector")
    with pytest.raises(ValueError) as error:
        build_reward({"geneval": 1.0}, detector_model_path=missing)
    message = str(error.value)
    assert "'geneval'" in message and "reward.detector_model_path" in message and missing in message
    assert "facebook/detr-resnet-50" in message
    with pytest.raises(ValueError, match="reward.detector_threshold"):
        build_reward({"geneval": 1.0}, detector_model_path=str(tmp_path), detector_threshold=1.5)


# ---------------------------------------------------------------------------------------------
# PickScore


def test_pickscore_is_the_scaled_clip_cosine(tiny_dirs):
    images = _images(4)
    options = dict(clip_model_path=tiny_dirs["clip"], clip_device="cpu")
    result = build_reward({"pickscore": 1.0, "clip_score": 1.0}, batch_size=3, **options)(images, OCR_PROMPTS)
    pick, cosine = result.components["pickscore"], result.components["clip_score"]
    assert pick.shape == (4,) and pick.dtype == torch.float32 and torch.isfinite(pick).all()
    from transformers import CLIPModel

    scale = CLIPModel.from_pretrained(tiny_dirs["clip"]).logit_scale.exp().item()
    assert scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial temperature
    torch.testing.assert_close(pick, scale * cosine)
    normalized = build_reward({"pickscore": 1.0}, pickscore_normalize=True, **options)(images, OCR_PROMPTS).total_B
    assert ((normalized >= 0) & (normalized <= 1)).all()
    torch.testing.assert_close(normalized, (cosine + 1) / 2)
    # Deterministic, and batch size does not change the scores.
    single = build_reward({"pickscore": 1.0}, batch_size=1, **options)(images, OCR_PROMPTS).total_B
    torch.testing.assert_close(single, pick)


def test_pickscore_missing_path(tmp_path):
    missing = str(tmp_path / "PickScore_v1")
    with pytest.raises(ValueError) as error:
        build_reward({"pickscore": 1.0}, clip_model_path=missing)
    message = str(error.value)
    assert "'pickscore'" in message and "reward.clip_model_path" in message and missing in message
    assert "yuvalkirstain/PickScore_v1" in message and "laion/CLIP-ViT-H-14-laion2B-s32B-b79K" in message


def test_reward_config_options_are_all_known():
    # Every RewardConfig field is an option some reward takes (build_reward rejects unknown ones).
    reward = build_reward({"jpeg_compressibility": 1.0}, **RewardConfig().options())
    assert math.isfinite(reward(_images(1), [""]).total_B.item())
