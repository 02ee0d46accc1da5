"""A verifiable GenEval-like task: counted, coloured shapes on white, and its reward.

Shape legend: B batch, H height, W width, K palette colours (white first).

Prompts follow a closed grammar: one or two clauses `<count> <color> <shape>` joined by ` and `,
count in one..four, color in red|green|blue|yellow, shape in circle|square|triangle (plural with
an `s` when count > 1), and the two clauses of a prompt have different colours, so that the reward
can tell from colour alone which clause a blob belongs to. Example: `two red circles and one blue
square`. `render_prompt` draws the ground truth (the pretraining data); `score_images` checks an
image against its prompt.

Scoring (`score_images`, registered as reward `shapes`), per image:

1. Segmentation. Each pixel takes the nearest of white and the four palette colours; a pixel
   farther than `UNCLEAR_DISTANCE` (RGB, 0..255 units) from all five is *unclear*.
2. Blobs. The 4-connected components of each palette colour; components smaller than
   `MIN_BLOB_FRACTION` of the image are specks and ignored.
3. Shape of a blob, from its pixel area, bounding box (h, w), fill = area / (h * w) and centroid
   offset = the larger of |centroid - box centre| / box side over the two axes. It is `other` if
   max(h, w) / min(h, w) > `MAX_ASPECT` or it covers more than `MAX_BLOB_FRACTION` of the image
   (a painted background is no object); else a triangle if offset >= 0.075 and fill < 0.8 (a
   triangle's centroid sits a sixth of its height off the box centre in the direction of its
   base, in any orientation; discs and squares are centred within a pixel); else a square if fill
   >= 0.92, a circle if fill >= 0.6 (pi/4 = 0.785 ideally; 0.67 to 0.87 for discrete discs of
   radius 5 to 9), a triangle if fill >= 0.35, otherwise `other`.
4. Credit for a clause (count c, colour k, shape s) with n blobs of colour k:
   `0.2 * [n > 0] + 0.4 * [n > 0] / (1 + |n - c|) + 0.4 * (fraction of those n blobs shaped s)`.
5. score = mean clause credit * (1 - `UNCLEAR_PENALTY` * unclear fraction)
   / (1 + `EXTRA_BLOB_PENALTY` * number of blobs of colours the prompt does not name).

So the score is in [0, 1]; a ground-truth render scores 1 and a blank image 0.

Diagnostics (`breakdown_images`): the parts a model gets right, each also registered as a reward
`shapes_present`, `shapes_count`, `shapes_shape`, `shapes_extra_blobs`, `shapes_unclear`. With
weight 0 they change nothing and are logged beside the score (`reward/shapes_count`, ...):

    spotlight eval configs/dit/tiny-shapes.yaml --checkpoint RUN --json \
        "reward.weights={shapes: 1.0, shapes_present: 0, shapes_count: 0, shapes_shape: 0, shapes_extra_blobs: 0}"
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from spotlight.rewards.registry import register_reward

COUNT_WORDS = ("one", "two", "three", "four")
COLORS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
MAX_CLAUSES = 2

BACKGROUND = (255, 255, 255)
"""RGB of the background."""
PALETTE = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
}
"""RGB (0..255) of each object colour."""

UNCLEAR_DISTANCE = 70.0
"""A pixel farther than this (Euclidean RGB, 0..255) from every palette colour is unclear; below
half the closest pair of palette colours (red-yellow, 161), so no pixel is near two colours."""
MIN_BLOB_FRACTION = 0.003
"""Components smaller than this fraction of the image are specks (12 pixels at 64x64; the
smallest rendered object, a triangle of radius size/12, covers about 0.014)."""
MAX_BLOB_FRACTION = 0.25
"""Components larger than this fraction of the image are no object (the largest rendered covers
about 0.06)."""
MAX_ASPECT = 1.6
"""Blobs whose bounding box is more elongated than this are no shape of the grammar."""
UNCLEAR_PENALTY = 0.25
EXTRA_BLOB_PENALTY = 0.5

_MIN_SIZE = 32


@dataclass(frozen=True)
class Clause:
    """One `<count> <color> <shape>` phrase of a prompt."""

    count: int
    """How many objects, 1..4."""
    color: str
    """One of COLORS."""
    shape: str
    """One of SHAPES."""

    def __str__(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNT_WORDS[self.count - 1]} {self.color} {self.shape}{plural}"


def format_prompt(clauses: list[Clause]) -> str:
    """The prompt text of clauses, the inverse of `parse_prompt`."""
    return " and ".join(str(c) for c in clauses)


def _grammar_error(text: str, reason: str) -> ValueError:
    return ValueError(
        f"prompt {text!r} is not in the shapes grammar ({reason}); write one or two clauses "
        f"'<count> <color> <shape>' joined by ' and ', e.g. 'two red circles and one blue square'"
    )


def parse_prompt(text: str) -> list[Clause]:
    """Parses a prompt of the shapes grammar.

    Args:
        text: e.g. `"two red circles and one blue square"`; case and runs of spaces are ignored.

    Returns:
        One or two clauses, in prompt order.

    Raises:
        ValueError: naming the text, if it is off-grammar.
    """
    words = text.lower().split()
    groups = [list(g) for is_and, g in itertools.groupby(words, lambda w: w == "and") if not is_and]
    if not words or len(groups) != words.count("and") + 1 or len(groups) > MAX_CLAUSES:
        raise _grammar_error(text, f"expected 1 to {MAX_CLAUSES} clauses joined by 'and'")
    clauses = []
    for group in groups:
        if len(group) != 3:
            raise _grammar_error(text, f"clause {' '.join(group)!r} is not three words")
        count_word, color, noun = group
        if count_word not in COUNT_WORDS:
            raise _grammar_error(text, f"count {count_word!r} is not one of {COUNT_WORDS}")
        if color not in COLORS:
            raise _grammar_error(text, f"color {color!r} is not one of {COLORS}")
        count = COUNT_WORDS.index(count_word) + 1
        shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
        if shape not in SHAPES or (count > 1) != (shape != noun):
            raise _grammar_error(text, f"{count_word!r} does not go with shape {noun!r}")
        clauses.append(Clause(count, color, shape))
    if len({c.color for c in clauses}) != len(clauses):
        raise _grammar_error(text, "the clauses must have different colours")
    return clauses


def all_prompts(max_clauses: int = MAX_CLAUSES) -> list[str]:
    """Every prompt of the grammar with up to `max_clauses` clauses, in a fixed order.

    Args:
        max_clauses: 1 (48 prompts) or 2 (48 + 48 * 36 = 1776 prompts).
    """
    if max_clauses not in range(1, MAX_CLAUSES + 1):
        raise ValueError(f"max_clauses is {max_clauses}; use 1 to {MAX_CLAUSES}")
    singles = [Clause(n, c, s) for n, c, s in itertools.product((1, 2, 3, 4), COLORS, SHAPES)]
    prompts = [format_prompt([a]) for a in singles]
    if max_clauses == 2:
        prompts += [format_prompt([a, b]) for a in singles for b in singles if a.color != b.color]
    return prompts


def split_prompts(seed: int, num_heldout: int, max_clauses: int = MAX_CLAUSES) -> tuple[list[str], list[str]]:
    """A deterministic split of `all_prompts` into disjoint train and held-out lists.

    Args:
        seed: chooses the held-out prompts.
        num_heldout: how many prompts to hold out.
        max_clauses: as in `all_prompts`.

    Returns:
        (train, heldout), each in `all_prompts` order.
    """
    prompts = all_prompts(max_clauses)
    if not 0 <= num_heldout < len(prompts):
        raise ValueError(f"num_heldout is {num_heldout}; use 0 to {len(prompts) - 1}")
    heldout = np.zeros(len(prompts), dtype=bool)
    heldout[np.random.default_rng(seed).permutation(len(prompts))[:num_heldout]] = True
    train = [p for p, h in zip(prompts, heldout, strict=True) if not h]
    return train, [p for p, h in zip(prompts, heldout, strict=True) if h]


# ---------------------------------------------------------------------------------------------
# Rendering


def _place_randomly(
    num_objects: int, size: int, r_lo: float, r_hi: float, margin: float, rng: np.random.Generator
) -> list[tuple[float, float, float]] | None:
    """Objects one by one at uniform places, rejecting overlaps; None when one does not fit."""
    placed: list[tuple[float, float, float]] = []
    for _ in range(num_objects):
        for _ in range(100):
            r = rng.uniform(r_lo, r_hi)
            cx, cy = rng.uniform(r + margin, size - r - margin, size=2)
            if all(max(abs(cx - x), abs(cy - y)) >= r + q + margin for x, y, q in placed):
                placed.append((cx, cy, r))
                break
        else:
            return None
    return placed


def _place_on_grid(
    num_objects: int, size: int, r_lo: float, r_hi: float, margin: float, rng: np.random.Generator
) -> list[tuple[float, float, float]]:
    """Objects in distinct random cells of a grid, jittered within their cell: always fits."""
    n = math.ceil(math.sqrt(num_objects))
    cell = (size - 2 * margin) / n
    r_max = min(r_hi, (cell - margin) / 2)
    assert r_max >= r_lo, (size, num_objects)
    placed = []
    for index in rng.choice(n * n, size=num_objects, replace=False):
        r = rng.uniform(r_lo, r_max)
        lo_x, lo_y = margin + cell * (index % n), margin + cell * (index // n)
        cx, cy = rng.uniform(r + margin / 2, cell - r - margin / 2, size=2)
        placed.append((lo_x + cx, lo_y + cy, r))
    return placed


def _layout(num_objects: int, size: int, rng: np.random.Generator) -> list[tuple[float, ...]]:
    """Random (cx, cy, r) of objects whose boxes [c - r, c + r] keep a margin apart and in.

    A margin over 1 pixel leaves a white pixel between any two objects, so that no two objects
    of one colour merge into one blob.
    """
    margin = max(1.5, size / 32)
    r_lo, r_hi = size / 12, size / 7
    for _ in range(5):
        placed = _place_randomly(num_objects, size, r_lo, r_hi, margin, rng)
        if placed is not None:
            return placed
        # Crowded prompts (up to eight objects) may not fit at large radii: shrink them.
        r_hi = max(r_lo, 0.8 * r_hi)
    return _place_on_grid(num_objects, size, r_lo, size / 7, margin, rng)


def _object_mask(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """(size, size) bool mask of a filled object centred at (cx, cy) with half-extent r."""
    ys, xs = np.mgrid[0:size, 0:size] + 0.5  # pixel centres
    dx, dy = xs - cx, ys - cy
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        # 0.85 r gives the square about the visual weight of the disc of radius r.
        return (np.abs(dx) <= 0.85 * r) & (np.abs(dy) <= 0.85 * r)
    assert shape == "triangle", shape
    # Upright isosceles: apex at (cx, cy - r), base from (cx - r, cy + r) to (cx + r, cy + r).
    return (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2)


def render_prompt(prompt: str, size: int = 64, rng: np.random.Generator | None = None) -> np.ndarray:
    """Draws the ground truth of a prompt: its objects, apart, at random places and sizes.

    Args:
        prompt: a prompt of the grammar.
        size: image side in pixels, at least 32.
        rng: source of the layout; None draws from fresh OS entropy.

    Returns:
        (size, size, 3) float32 RGB in [0, 1] on a white background.
    """
    if size < _MIN_SIZE:
        raise ValueError(f"size is {size}; use at least {_MIN_SIZE} so shapes stay recognisable")
    rng = np.random.default_rng() if rng is None else rng
    objects = [(c.color, c.shape) for c in parse_prompt(prompt) for _ in range(c.count)]
    image = np.empty((size, size, 3), dtype=np.float32)
    image[:] = np.array(BACKGROUND, dtype=np.float32) / 255
    for (color, shape), (cx, cy, r) in zip(objects, _layout(len(objects), size, rng), strict=True):
        image[_object_mask(shape, cx, cy, r, size)] = np.array(PALETTE[color]) / 255
    return image


def noisy_caption_target(prompt: str, noise: float, rng: np.random.Generator) -> str:
    """The prompt whose image is drawn for caption `prompt` in noisy-caption pretraining.

    Web captions bind counts and attributes loosely to their images; that weak binding is what
    verifiable-reward RL fixes in real text-to-image models (GenEval counting, attributes). To
    give the tiny base the same kind of failure, each clause independently, with probability
    `noise`, draws its count uniformly from 1..4 and its shape uniformly from SHAPES (either may
    come out unchanged); colours are kept. The caption stays `prompt`.
    """
    if not 0 <= noise <= 1:
        raise ValueError(f"caption noise must be in [0, 1], got {noise}")
    clauses = parse_prompt(prompt)
    drawn = []
    for c in clauses:
        if rng.random() < noise:
            c = Clause(int(rng.integers(1, 5)), c.color, SHAPES[int(rng.integers(len(SHAPES)))])
        drawn.append(c)
    return format_prompt(drawn)


def render_batch(prompts: list[str], size: int = 64, seed: int = 0) -> torch.Tensor:
    """Ground-truth images of prompts, in the layout rewards and the VAE take.

    Image i depends only on (prompts[i], size, seed, i), not on the other prompts.

    Returns:
        (B, 3, size, size) float32 in [0, 1].
    """
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(len(prompts))]
    images = np.stack([render_prompt(p, size, rng) for p, rng in zip(prompts, rngs, strict=True)])
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


# ---------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True)
class Blob:
    """A connected component of one palette colour."""

    color: str
    """One of COLORS."""
    shape: str
    """One of SHAPES, or "other"."""
    area: int
    """Pixels."""
    height: int
    """Bounding box height in pixels."""
    width: int
    """Bounding box width in pixels."""
    offset: float
    """Largest distance of the centroid from the box centre along an axis, over the box side."""


@dataclass(frozen=True)
class ImageAnalysis:
    """What the reward sees in one image."""

    blobs: list[Blob]
    """Blobs above the speck size, in no particular order."""
    unclear_fraction: float
    """Fraction of pixels far from every palette colour."""


def classify_shape(area: int, height: int, width: int, offset: float, image_area: int) -> str:
    """Names a blob's shape from its features (see the module docstring for the rule)."""
    elongated = max(height, width) > MAX_ASPECT * min(height, width)
    if elongated or area > MAX_BLOB_FRACTION * image_area:
        return "other"
    fill = area / (height * width)
    if offset >= 0.075:
        return "triangle" if fill < 0.8 else "other"
    if fill >= 0.92:
        return "square"
    if fill >= 0.6:
        return "circle"
    if fill >= 0.35:
        return "triangle"
    return "other"


def segment_images(images_BHW3: np.ndarray) -> np.ndarray:
    """Assigns each pixel to the nearest of white and the palette colours.

    Args:
        images_BHW3: (B, H, W, 3) RGB in [0, 1].

    Returns:
        (B, H, W) int8: 0 for white, k for the k-th colour of PALETTE (from 1), -1 for unclear.
    """
    colors_K3 = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32) / 255
    # Contiguous channel planes and a loop over the five colours: numpy's reductions over a short
    # trailing axis, as in an (N, K) distance matrix, are about ten times slower.
    planes_3N = np.moveaxis(np.asarray(images_BHW3, dtype=np.float32), -1, 0).reshape(3, -1)
    planes_3N = np.ascontiguousarray(planes_3N)
    best_N = np.full(planes_3N.shape[1], np.inf, dtype=np.float32)
    nearest_N = np.zeros(planes_3N.shape[1], dtype=np.int8)
    for k, color in enumerate(colors_K3):
        dist2_N = np.square(planes_3N[0] - color[0])
        dist2_N += np.square(planes_3N[1] - color[1])
        dist2_N += np.square(planes_3N[2] - color[2])
        nearest_N[dist2_N < best_N] = k
        np.minimum(best_N, dist2_N, out=best_N)
    nearest_N[best_N > (UNCLEAR_DISTANCE / 255) ** 2] = -1
    return nearest_N.reshape(images_BHW3.shape[:3])


def analyze_images(images_BHW3: np.ndarray) -> list[ImageAnalysis]:
    """Finds the palette-coloured blobs of images and names their shapes.

    Args:
        images_BHW3: (B, H, W, 3) RGB in [0, 1].

    Returns:
        One analysis per image.
    """
    batch_size, height, width, _ = images_BHW3.shape
    classes_BHW = segment_images(images_BHW3)
    image_area = height * width
    min_area = max(4, MIN_BLOB_FRACTION * image_area)
    blobs: list[list[Blob]] = [[] for _ in range(batch_size)]
    # A 3-D structure connected only within the (H, W) plane labels all images in one call
    # without joining components across the batch.
    structure = np.zeros((3, 3, 3), dtype=bool)
    structure[1] = ndimage.generate_binary_structure(2, 1)
    # Pixel-centre coordinates, summed per component with bincount: centroids without a loop.
    ys_N = np.broadcast_to(np.arange(height)[None, :, None] + 0.5, classes_BHW.shape).ravel()
    xs_N = np.broadcast_to(np.arange(width)[None, None, :] + 0.5, classes_BHW.shape).ravel()
    for k, color in enumerate(PALETTE, start=1):
        labels_BHW, num = ndimage.label(classes_BHW == k, structure=structure)
        if num == 0:
            continue
        labels_N = labels_BHW.ravel()
        areas = np.bincount(labels_N, minlength=num + 1)
        sum_y = np.bincount(labels_N, weights=ys_N, minlength=num + 1)
        sum_x = np.bincount(labels_N, weights=xs_N, minlength=num + 1)
        # Noise makes thousands of specks, and find_objects builds slices for every label:
        # renumber the kept components 1..m first and erase the rest.
        kept = np.flatnonzero(areas[1:] >= min_area) + 1
        renumber = np.zeros(num + 1, dtype=labels_BHW.dtype)
        renumber[kept] = np.arange(1, len(kept) + 1)
        boxes = ndimage.find_objects(renumber[labels_BHW])
        for i, (b, ys, xs) in zip(kept, boxes, strict=True):
            area, h, w = int(areas[i]), ys.stop - ys.start, xs.stop - xs.start
            offset = max(
                abs(sum_y[i] / area - (ys.start + ys.stop) / 2) / h,
                abs(sum_x[i] / area - (xs.start + xs.stop) / 2) / w,
            )
            shape = classify_shape(area, h, w, offset, image_area)
            blobs[b.start].append(Blob(color, shape, area, h, w, float(offset)))
    unclear_B = (classes_BHW == -1).mean(axis=(1, 2))
    return [ImageAnalysis(b, float(u)) for b, u in zip(blobs, unclear_B, strict=True)]


def _clause_blobs(clause: Clause, analysis: ImageAnalysis) -> list[Blob]:
    """The blobs of a clause's colour (prompts name each colour once, so they are the clause's)."""
    return [b for b in analysis.blobs if b.color == clause.color]


def _extra_blobs(clauses: list[Clause], analysis: ImageAnalysis) -> int:
    """Blobs of colours the prompt does not name."""
    requested = {c.color for c in clauses}
    return sum(b.color not in requested for b in analysis.blobs)


def score_analysis(clauses: list[Clause], analysis: ImageAnalysis) -> float:
    """The reward of one analysed image for a parsed prompt (see the module docstring)."""
    credits = []
    for clause in clauses:
        mine = _clause_blobs(clause, analysis)
        n = len(mine)
        if n == 0:
            credits.append(0.0)
            continue
        shape_ok = sum(b.shape == clause.shape for b in mine) / n
        credits.append(0.2 + 0.4 / (1 + abs(n - clause.count)) + 0.4 * shape_ok)
    clarity = 1 - UNCLEAR_PENALTY * analysis.unclear_fraction
    return float(np.mean(credits)) * clarity / (1 + EXTRA_BLOB_PENALTY * _extra_blobs(clauses, analysis))


BREAKDOWN = ("present", "count", "shape", "extra_blobs", "unclear")
"""The parts of the score `breakdown_analysis` measures (each also a reward `shapes_<part>`)."""
GRAMMAR_REWARDS = ("shapes", "shapes_exact", *(f"shapes_{part}" for part in BREAKDOWN))
"""The registered rewards that score prompts of this grammar (and fail on any other)."""


def breakdown_analysis(clauses: list[Clause], analysis: ImageAnalysis) -> dict[str, float]:
    """What one image gets right, part by part, to see which part of the score a model moves:

    present: fraction of the clauses whose colour appears; count: fraction drawn with exactly
    their count; shape: mean over clauses of the fraction of their blobs that have their shape (0
    if absent; the score's shape term); extra_blobs: blobs of colours the prompt does not name;
    unclear: fraction of unclear pixels.
    """
    present, count, shape = [], [], []
    for clause in clauses:
        mine = _clause_blobs(clause, analysis)
        present.append(bool(mine))
        count.append(len(mine) == clause.count)
        shape.append(sum(b.shape == clause.shape for b in mine) / len(mine) if mine else 0.0)
    return {
        "present": float(np.mean(present)),
        "count": float(np.mean(count)),
        "shape": float(np.mean(shape)),
        "extra_blobs": float(_extra_blobs(clauses, analysis)),
        "unclear": analysis.unclear_fraction,
    }


def breakdown_images(images_BHW3: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
    """`breakdown_analysis` of a batch: each part as a (B,) float32 array."""
    rows = [breakdown_analysis(c, a) for c, a in _parse_and_analyze(images_BHW3, prompts)]
    return {part: np.array([r[part] for r in rows], dtype=np.float32) for part in BREAKDOWN}


def exact_analysis(clauses: list[Clause], analysis: ImageAnalysis) -> bool:
    """Whether the image is right as a whole, GenEval's per-image verdict: every clause drawn with
    exactly its count, all of those blobs of its shape, and no blob of a colour the prompt does not
    name (unclear pixels are not judged, as GenEval's detector ignores them)."""
    for clause in clauses:
        mine = _clause_blobs(clause, analysis)
        if len(mine) != clause.count or any(b.shape != clause.shape for b in mine):
            return False
    return _extra_blobs(clauses, analysis) == 0


def exact_images(images_BHW3: np.ndarray, prompts: list[str]) -> np.ndarray:
    """(B,) float32: 1 where `exact_analysis` holds, else 0."""
    return np.array([exact_analysis(c, a) for c, a in _parse_and_analyze(images_BHW3, prompts)], dtype=np.float32)


def _parse_and_analyze(images_BHW3: np.ndarray, prompts: list[str]) -> list[tuple[list[Clause], ImageAnalysis]]:
    """(parsed prompt, analysis) per image."""
    # Parse first, so that an off-grammar prompt fails before any image work.
    parsed = [parse_prompt(p) for p in prompts]
    if len(parsed) != len(images_BHW3):
        raise ValueError(f"got {len(images_BHW3)} images but {len(prompts)} prompts")
    return list(zip(parsed, analyze_images(images_BHW3), strict=True))


def score_images(images_BHW3: np.ndarray, prompts: list[str]) -> np.ndarray:
    """Scores images against their prompts.

    Args:
        images_BHW3: (B, H, W, 3) RGB in [0, 1].
        prompts: B prompts of the grammar.

    Returns:
        (B,) float32 scores in [0, 1].
    """
    return np.array([score_analysis(c, a) for c, a in _parse_and_analyze(images_BHW3, prompts)], dtype=np.float32)


def _channels_last(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) tensor in [0, 1] -> (B, H, W, 3) float32 array, as the scorer reads it."""
    return images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()


@register_reward("shapes")
def make_shapes_reward():
    """The shapes-grammar reward; it takes no options."""

    def shapes_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.from_numpy(score_images(_channels_last(images), prompts))

    return shapes_reward


@register_reward("shapes_exact")
def make_shapes_exact_reward():
    """All-or-nothing shapes reward (`exact_images`): 1 for an image that is right as a whole, else 0.

    GenEval scores an image this way, and so Spotlight's GenEval runs face groups of G that all
    fail. The partial credit of `shapes` rarely gives a group equal rewards; this reward does, for
    the prompts a policy seldom gets right, which is where seed exploration pays off."""

    def shapes_exact_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return torch.from_numpy(exact_images(_channels_last(images), prompts))

    return shapes_exact_reward


def _register_breakdown(part: str) -> None:
    def make():
        def reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
            return torch.from_numpy(breakdown_images(_channels_last(images), prompts)[part])

        return reward

    make.__doc__ = f"Diagnostic part {part!r} of the shapes score (`breakdown_analysis`); weigh it 0 to only log it."
    make.__qualname__ = f"make_shapes_{part}_reward"
    register_reward(f"shapes_{part}")(make)


for _part in BREAKDOWN:
    _register_breakdown(_part)
