"""Compositional prompts scored with an object detector, in the manner of GenEval.

Shape legend: B batch, H height, W width.

GenEval (Ghosh et al. 2023) checks a generated image against the structure of its prompt (which
objects, how many, what colour, where) with an object detector; Flow-GRPO trains on it as a
reward. GenEval ships its prompts with metadata; ours come as text, so the structure is parsed from
the prompt itself, with the detector's own label names as the object vocabulary:

    prompt  = [a photo of] CLAUSE ((, | and | , and) CLAUSE)*     e.g. "two red apples and a blue cup"
            | [a photo of] OBJECT (left of | right of | above | below) OBJECT
    CLAUSE  = COUNT [COLOR] LABEL                                  COUNT: a, an (at least one),
                                                                   one .. ten or digits (exactly)
    COLOR   = red orange yellow green blue purple pink brown black white (GenEval's ten)
    LABEL   = a label of the detector (its config's id2label), singular or plural

Scoring (`score_prompt`), with the detections of an image: a detection *counts* for a clause if its
label is the clause's and its score is at least `threshold` (`count_threshold` for a clause with an
exact count: GenEval uses 0.3 and 0.9). With n such detections, a clause earns the mean of

- presence: 1 if n >= 1;
- count (exact counts only): [n >= 1] / (1 + |n - count|);
- colour (when the clause names one): the fraction of its min(n, count) highest-scoring detections
  whose box colour (`box_color`) is the named one (0 when n = 0).

A positional prompt has three parts: the two objects' clause credits and the relation, 1 if the
centre of the subject's best detection lies on the named side of the reference's best detection's
centre (image y grows downward), else 0. The score is the mean over the parts, in [0, 1]; it is 1
exactly when every check GenEval makes passes (with our colour rule in place of its CLIP colour
classifier: `classify_color`, a coarse HSV rule on the median colour of the box's central half).

The detector is any transformers object-detection model in a local folder with its image
processor (`AutoModelForObjectDetection`, e.g. DETR: `facebook/detr-resnet-50`, whose `no_timm`
revision needs no timm; GenEval itself uses a Mask2Former from mmdetection, which is not a
transformers model). A prompt that does not parse scores NaN (the combined reward drops it) and is
logged once.
"""

from __future__ import annotations

import colorsys
import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from spotlight.rewards.local_models import batch_slices, pick_device, require_local_dir, to_uint8_images
from spotlight.rewards.registry import register_reward

logger = logging.getLogger(__name__)

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour names."""
NUMBERS = {w: i for i, w in enumerate("one two three four five six seven eight nine ten".split(), start=1)}
ARTICLES = ("a", "an")
RELATIONS = ("left of", "right of", "above", "below")
PREFIXES = ("a photo of ", "a photograph of ", "a picture of ", "an image of ")
IRREGULAR_PLURALS = {
    "person": "people",
    "mouse": "mice",
    "knife": "knives",
    "sheep": "sheep",
    "skis": "skis",
    "scissors": "scissors",
}
ALIASES = {
    "computer mouse": "mouse",
    "computer keyboard": "keyboard",
    "tv remote": "remote",
    "television": "tv",
    "motorbike": "motorcycle",
    "aeroplane": "airplane",
    "sofa": "couch",
    "ball": "sports ball",
}
"""Other names of COCO labels (prompt name -> detector label), used when the label exists."""

DOWNLOAD_HINT = (
    "an object detector with its image processor, e.g. the Hugging Face repo facebook/detr-resnet-50 "
    "(revision no_timm: `--revision no_timm`, no timm needed)"
)


@dataclass(frozen=True)
class ObjectSpec:
    """One clause: `count` objects labelled `label`, of colour `color` (None: any)."""

    label: str
    count: int
    exact: bool
    """True for an exact count ("two apples"), False for at least `count` ("an apple")."""
    color: str | None = None


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for: clauses, and optionally a relation between the first two."""

    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    """One of RELATIONS: objects[0] is `relation` objects[1]."""


@dataclass(frozen=True)
class Detection:
    """One detected object."""

    label: str
    score: float
    box: tuple[float, float, float, float]
    """(x0, y0, x1, y1) in pixels."""
    color: str | None = None
    """Its colour name (`box_color`); None when not computed."""

    @property
    def center(self) -> tuple[float, float]:
        x0, y0, x1, y1 = self.box
        return (x0 + x1) / 2, (y0 + y1) / 2


# ---------------------------------------------------------------------------------------------
# Prompts


def plural(label: str) -> set[str]:
    """Plural forms of a label (its last word inflected): "cup" -> {"cups"}, "wine glass" -> {"wine glasses"}."""
    *head, word = label.split(" ")
    forms = {word + "s"}
    if word in IRREGULAR_PLURALS:
        forms.add(IRREGULAR_PLURALS[word])
    if word.endswith(("s", "x", "z", "ch", "sh")):
        forms.add(word + "es")
    if len(word) > 1 and word.endswith("y") and word[-2] not in "aeiou":
        forms.add(word[:-1] + "ies")
    return {" ".join([*head, f]) for f in forms}


def label_vocabulary(labels) -> dict[str, str]:
    """Every name a prompt may use (label, plurals, aliases) -> the detector label it means."""
    vocab: dict[str, str] = {}
    for label in labels:
        label = label.strip().lower()
        if not label or label == "n/a":  # COCO's unused ids in DETR's id2label
            continue
        vocab[label] = label
        for form in plural(label):
            vocab.setdefault(form, label)
    for alias, label in ALIASES.items():
        if label in vocab.values():
            for form in {alias, *plural(alias)}:
                vocab.setdefault(form, label)
    return vocab


def _parse_object(clause: str, vocab: dict[str, str], text: str) -> ObjectSpec:
    words = clause.split()
    if not words:
        raise ValueError(f"prompt {text!r} has an empty clause")
    count, exact = 1, False
    if words[0] in ARTICLES:
        words = words[1:]
    elif words[0] in NUMBERS or words[0].isdigit():
        count, exact = NUMBERS.get(words[0]) or int(words[0]), True
        words = words[1:]
    color = None
    # "an orange" is the fruit, "an orange cup" a colour: a colour word only if an object follows.
    if len(words) > 1 and words[0] in COLORS and " ".join(words[1:]) in vocab:
        color, words = words[0], words[1:]
    name = " ".join(words)
    if name not in vocab:
        raise ValueError(
            f"prompt {text!r}: {name!r} is no label of the detector (its labels: "
            f"{', '.join(sorted(set(vocab.values()))[:20])}, ...)"
        )
    if count < 1:
        raise ValueError(f"prompt {text!r}: count {count} must be at least 1")
    return ObjectSpec(label=vocab[name], count=count, exact=exact, color=color)


def parse_prompt(text: str, vocab: dict[str, str]) -> PromptSpec:
    """The objects, counts, colours and relation a prompt asks for (grammar in the module docstring).

    Args:
        text: e.g. "a photo of two red apples and a blue cup".
        vocab: `label_vocabulary` of the detector's labels.

    Raises:
        ValueError: naming the prompt and the part that does not parse.
    """
    s = " ".join(text.lower().replace(",", " , ").split()).rstrip(" .")
    for prefix in PREFIXES:
        if s.startswith(prefix):
            s = s[len(prefix) :]
            break
    match = re.fullmatch(rf"(.+?) (?:to the )?({'|'.join(RELATIONS)}) (.+)", s)
    if match:
        subject, relation, reference = match.groups()
        objects = (_parse_object(subject, vocab, text), _parse_object(reference, vocab, text))
        return PromptSpec(objects=objects, relation=relation)
    clauses = [c for c in re.split(r" , and | and | , ", s)]
    return PromptSpec(objects=tuple(_parse_object(c, vocab, text) for c in clauses))


# ---------------------------------------------------------------------------------------------
# Colours


def classify_color(rgb) -> str:
    """GenEval colour name of an RGB colour (0..255), or "gray" (matches none of them).

    A coarse rule in HSV: dark is black; unsaturated is white (bright) or gray; else by hue, with
    dark reds and oranges brown, and light, pale reds pink.
    """
    h, s, v = colorsys.rgb_to_hsv(*(float(c) / 255 for c in rgb))
    hue = h * 360
    if v < 0.2:
        return "black"
    if s < 0.2:
        return "white" if v > 0.7 else "gray"
    if hue < 15 or hue >= 345:
        if v < 0.5:
            return "brown"
        return "pink" if s < 0.5 and v > 0.7 else "red"
    if hue < 45:
        return "brown" if v < 0.6 else "orange"
    if hue < 70:
        return "yellow"
    if hue < 170:
        return "green"
    if hue < 260:
        return "blue"
    if hue < 290:
        return "purple"
    return "pink"


def box_color(image_HW3: np.ndarray, box) -> str:
    """`classify_color` of the median colour of the central half (each side) of a box.

    Args:
        image_HW3: uint8 RGB.
        box: (x0, y0, x1, y1) in pixels.
    """
    height, width = image_HW3.shape[:2]
    x0, y0, x1, y1 = box
    # The central half of the box: mostly object, little background.
    cx0, cx1 = x0 + (x1 - x0) / 4, x1 - (x1 - x0) / 4
    cy0, cy1 = y0 + (y1 - y0) / 4, y1 - (y1 - y0) / 4
    c0, c1 = int(np.clip(np.floor(cx0), 0, width - 1)), int(np.clip(np.ceil(cx1), 1, width))
    r0, r1 = int(np.clip(np.floor(cy0), 0, height - 1)), int(np.clip(np.ceil(cy1), 1, height))
    crop = image_HW3[r0 : max(r1, r0 + 1), c0 : max(c1, c0 + 1)].reshape(-1, 3)
    return classify_color(np.median(crop, axis=0))


# ---------------------------------------------------------------------------------------------
# Scoring


def _counted(
    spec: ObjectSpec, detections: list[Detection], threshold: float, count_threshold: float
) -> list[Detection]:
    cut = count_threshold if spec.exact else threshold
    kept = [d for d in detections if d.label == spec.label and d.score >= cut]
    return sorted(kept, key=lambda d: -d.score)


def _clause_credit(spec: ObjectSpec, kept: list[Detection]) -> float:
    n = len(kept)
    terms = [float(n > 0)]
    if spec.exact:
        terms.append(float(n > 0) / (1 + abs(n - spec.count)))
    if spec.color is not None:
        m = min(n, spec.count)
        terms.append(sum(d.color == spec.color for d in kept[:m]) / m if m else 0.0)
    return sum(terms) / len(terms)


def _relation_holds(relation: str, subject: Detection, reference: Detection) -> bool:
    (sx, sy), (rx, ry) = subject.center, reference.center
    return {"left of": sx < rx, "right of": sx > rx, "above": sy < ry, "below": sy > ry}[relation]


def score_prompt(
    spec: PromptSpec, detections: list[Detection], *, threshold: float = 0.3, count_threshold: float = 0.9
) -> float:
    """Partial credit in [0, 1] for how well the detections of one image satisfy a prompt.

    Args:
        spec: the parsed prompt.
        detections: the image's detections, with `color` set where a clause names a colour.
        threshold: least detection score that counts for a clause without exact count.
        count_threshold: least detection score that counts for a clause with an exact count.
    """
    kept = [_counted(o, detections, threshold, count_threshold) for o in spec.objects]
    parts = [_clause_credit(o, k) for o, k in zip(spec.objects, kept, strict=True)]
    if spec.relation is not None:
        subject, reference = kept
        parts.append(float(bool(subject and reference) and _relation_holds(spec.relation, subject[0], reference[0])))
    return sum(parts) / len(parts)


# ---------------------------------------------------------------------------------------------
# The detector and the reward


class Detector:
    """A transformers object detector and its image processor, loaded from a local folder.

    Args:
        path: the folder (model, config with id2label, image processor), as `save_pretrained` writes it.
        device: where the model runs.
        min_score: detections below this score are dropped.
        batch_size: images per forward.
    """

    def __init__(self, path, device: torch.device, *, min_score: float, batch_size: int):
        # Imported here: transformers takes seconds to import, and most runs use no detector.
        from transformers import AutoImageProcessor, AutoModelForObjectDetection

        self.model = AutoModelForObjectDetection.from_pretrained(path, local_files_only=True).to(device).eval()
        self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.labels = {int(i): name.strip().lower() for i, name in self.model.config.id2label.items()}
        self.device = device
        self.min_score = min_score
        self.batch_size = batch_size

    @torch.inference_mode()
    def detect(self, images: list[np.ndarray]) -> list[list[Detection]]:
        """Detections of each image (no colours yet).

        Args:
            images: (H, W, 3) uint8 RGB arrays.
        """
        found: list[list[Detection]] = []
        for batch in batch_slices(len(images), self.batch_size):
            chunk = images[batch]
            inputs = self.processor(images=chunk, return_tensors="pt").to(self.device)
            outputs = self.model(**inputs)
            sizes = [image.shape[:2] for image in chunk]
            results = self.processor.post_process_object_detection(
                outputs, threshold=self.min_score, target_sizes=sizes
            )
            for result in results:
                found.append(
                    [
                        Detection(label=self.labels[int(lab)], score=float(sc), box=tuple(float(x) for x in box))
                        for sc, lab, box in zip(
                            result["scores"].cpu(), result["labels"].cpu(), result["boxes"].float().cpu()
                        )
                    ]
                )
        return found


@register_reward("geneval")
def make_geneval_reward(
    detector_model_path: str = "",
    detector_threshold: float = 0.3,
    detector_count_threshold: float = 0.9,
    batch_size: int = 16,
    detector_device: str = "",
):
    """Detector-checked objects, counts, colours and positions of a compositional prompt.

    Args:
        detector_model_path: local folder of the detector and its image processor.
        detector_threshold: least detection score that counts (GenEval: 0.3).
        detector_count_threshold: least score that counts for clauses with an exact count (GenEval: 0.9).
        batch_size: images per detector forward.
        detector_device: where the detector runs; empty means cuda when available, else cpu.
    """
    path = require_local_dir("geneval", "reward.detector_model_path", detector_model_path, DOWNLOAD_HINT)
    for name, value in (
        ("detector_threshold", detector_threshold),
        ("detector_count_threshold", detector_count_threshold),
    ):
        if not 0 <= value <= 1:
            raise ValueError(f"reward.{name} is {value}; use a detection score in [0, 1]")
    detector = Detector(
        path,
        pick_device(detector_device),
        min_score=min(detector_threshold, detector_count_threshold),
        batch_size=batch_size,
    )
    vocab = label_vocabulary(detector.labels.values())
    parsed: dict[str, PromptSpec | None] = {}

    def spec_of(prompt: str) -> PromptSpec | None:
        if prompt not in parsed:
            try:
                parsed[prompt] = parse_prompt(prompt, vocab)
            except ValueError as err:
                logger.warning("reward 'geneval' cannot score this prompt (its samples score NaN): %s", err)
                parsed[prompt] = None
        return parsed[prompt]

    def geneval(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        specs = [spec_of(p) for p in prompts]
        scores_B = torch.full((len(prompts),), float("nan"), dtype=torch.float32)
        rows = [i for i, s in enumerate(specs) if s is not None]
        if not rows:
            return scores_B
        arrays = to_uint8_images(images)
        for i, dets in zip(rows, detector.detect([arrays[i] for i in rows]), strict=True):
            spec = specs[i]
            colored = {o.label for o in spec.objects if o.color is not None}
            dets = [
                Detection(d.label, d.score, d.box, box_color(arrays[i], d.box)) if d.label in colored else d
                for d in dets
            ]
            scores_B[i] = score_prompt(
                spec, dets, threshold=detector_threshold, count_threshold=detector_count_threshold
            )
        return scores_B

    return geneval
