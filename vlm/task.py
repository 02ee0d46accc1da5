"""A tiny visual question answering task with verifiable answers: coloured shapes on a grid.

A scene is a `grid_size x grid_size` board of 28-pixel cells (one merged Qwen2.5-VL vision token
per cell with patch 14 and merge 2); each cell is empty or holds one shape, drawn with a seeded
jitter of size and position. A question about the scene is one of:

- ``count_color``: "how many red shapes are there ?" -> "2"
- ``count_kind``: "how many circles are there ?" -> "1"
- ``color_of``: "what color is the triangle ?" -> "blue" (asked only when there is exactly one)
- ``compare``: "are there more red shapes than blue shapes ?" -> "yes" / "no"

Every example is a pure function of one integer seed. The held-out split is the examples of the
seeds ``derive_seed(split_seed, 1, i)``, i < num_heldout; training examples come from the stream
``derive_seed(split_seed, 0, ...)`` and any whose (scene, question) is held out is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from spotlight.core.seeds import derive_seed
from vlm.config import COLOR_RGB, QUESTION_TYPES, TaskConfig

CELL_PX = 28
"""Pixels per grid cell: patch_size 14 x spatial_merge_size 2, so one cell is one LM vision token."""
KINDS = ("circle", "square", "triangle")
BACKGROUND_RGB = (123, 117, 104)
"""Board colour: the image processor's normalisation mean (CLIP's), so an empty patch enters the
vision tower as zeros and the shapes carry the whole signal; on white, the constant background
dominates a tiny random tower's features and it barely learns to see."""
ANSWER_PREFIX = "answer :"
"""Responses are `answer : <word>`; `rewards.parse_answer` reads them."""

Cell = tuple[str, str] | None
"""(color, kind) of a cell's shape, or None for an empty cell."""


@dataclass(frozen=True)
class Example:
    """One question about one scene."""

    seed: int
    """The seed the example was drawn from."""
    cells: tuple[Cell, ...]
    """Row-major grid cells."""
    question_type: str
    """One of QUESTION_TYPES."""
    question: str
    """The question text (lower case, space-separated words and punctuation)."""
    answer: str
    """The gold answer word."""

    @property
    def key(self) -> tuple:
        """Identity of the (scene, question) pair, used to keep training off the held-out split."""
        return self.cells, self.question

    @property
    def target(self) -> str:
        """The response a perfect policy gives (the warm start's supervision)."""
        return f"{ANSWER_PREFIX} {self.answer}"


def render(cells: tuple[Cell, ...], grid_size: int, seed: int) -> Image.Image:
    """Draw a scene on a grey board; size and position jitter come from `seed`.

    Returns:
        An RGB image of (grid_size * 28) x (grid_size * 28) pixels.
    """
    rng = np.random.default_rng(derive_seed(seed, 7))
    size = grid_size * CELL_PX
    image = Image.new("RGB", (size, size), BACKGROUND_RGB)
    draw = ImageDraw.Draw(image)
    for i, cell in enumerate(cells):
        if cell is None:
            continue
        color, kind = cell
        row, col = divmod(i, grid_size)
        half = int(rng.integers(7, 12))
        cx = col * CELL_PX + CELL_PX // 2 + int(rng.integers(-2, 3))
        cy = row * CELL_PX + CELL_PX // 2 + int(rng.integers(-2, 3))
        box = (cx - half, cy - half, cx + half, cy + half)
        fill = COLOR_RGB[color]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - half), (cx - half, cy + half), (cx + half, cy + half)], fill=fill)
    return image


def _plural(kind: str) -> str:
    return kind + "s"


def make_example(seed: int, cfg: TaskConfig) -> Example:
    """The example of one seed (scene and question)."""
    rng = np.random.default_rng(seed)
    colors = list(cfg.colors)
    num_cells = cfg.grid_size**2
    num_shapes = int(rng.integers(1, cfg.max_shapes + 1))
    occupied = rng.choice(num_cells, size=num_shapes, replace=False)
    cells: list[Cell] = [None] * num_cells
    for i in occupied:
        cells[int(i)] = (colors[int(rng.integers(len(colors)))], KINDS[int(rng.integers(len(KINDS)))])
    shapes = [c for c in cells if c is not None]

    weights = np.array([cfg.question_weights[q] for q in QUESTION_TYPES], dtype=float)
    single_kinds = [k for k in KINDS if sum(s[1] == k for s in shapes) == 1]
    if not single_kinds:  # "what color is the X" needs exactly one X
        weights[QUESTION_TYPES.index("color_of")] = 0.0
    qtype = QUESTION_TYPES[int(rng.choice(len(QUESTION_TYPES), p=weights / weights.sum()))]
    if qtype == "count_color":
        color = colors[int(rng.integers(len(colors)))]
        question = f"how many {color} shapes are there ?"
        answer = str(sum(s[0] == color for s in shapes))
    elif qtype == "count_kind":
        kind = KINDS[int(rng.integers(len(KINDS)))]
        question = f"how many {_plural(kind)} are there ?"
        answer = str(sum(s[1] == kind for s in shapes))
    elif qtype == "color_of":
        kind = single_kinds[int(rng.integers(len(single_kinds)))]
        question = f"what color is the {kind} ?"
        answer = next(s[0] for s in shapes if s[1] == kind)
    else:
        a, b = rng.choice(len(colors), size=2, replace=False)
        question = f"are there more {colors[a]} shapes than {colors[b]} shapes ?"
        num_a = sum(s[0] == colors[a] for s in shapes)
        num_b = sum(s[0] == colors[b] for s in shapes)
        answer = "yes" if num_a > num_b else "no"
    return Example(seed=seed, cells=tuple(cells), question_type=qtype, question=question, answer=answer)


def example_image(example: Example, cfg: TaskConfig) -> Image.Image:
    """The rendered scene of an example."""
    return render(example.cells, cfg.grid_size, example.seed)


def cell_labels(example: Example, cfg: TaskConfig) -> list[int]:
    """Class of each grid cell, row-major: 0 empty, else 1 + colour index x len(KINDS) + kind index
    (the vision tower's pretraining targets, `vlm.warmstart.pretrain_vision`)."""
    colors = list(cfg.colors)
    return [0 if c is None else 1 + colors.index(c[0]) * len(KINDS) + KINDS.index(c[1]) for c in example.cells]


def heldout_examples(cfg: TaskConfig) -> list[Example]:
    """The held-out split: `cfg.num_heldout` examples, the same for every run with this split_seed."""
    return [make_example(derive_seed(cfg.split_seed, 1, i), cfg) for i in range(cfg.num_heldout)]


class TrainStream:
    """Training examples addressed by (iteration, slot), never in the held-out split.

    Args:
        cfg: the task.
        seed: run seed; the examples of (iteration, slot) depend only on (seed, split_seed, iteration, slot).
    """

    def __init__(self, cfg: TaskConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self._heldout_keys = {e.key for e in heldout_examples(cfg)}

    def example(self, iteration: int, slot: int) -> Example:
        """The training example of one (iteration, slot)."""
        for attempt in range(1000):
            ex = make_example(derive_seed(self.cfg.split_seed, 0, self.seed, iteration, slot, attempt), self.cfg)
            if ex.key not in self._heldout_keys:
                return ex
        raise AssertionError("could not draw a training example outside the held-out split")

    def batch(self, iteration: int, num_examples: int) -> list[Example]:
        """`num_examples` training examples of one iteration."""
        return [self.example(iteration, p) for p in range(num_examples)]


def answer_vocabulary(cfg: TaskConfig) -> list[str]:
    """Every word a gold answer can be."""
    return [str(n) for n in range(cfg.max_shapes + 1)] + list(cfg.colors) + ["yes", "no"]


def corpus(cfg: TaskConfig) -> list[str]:
    """Every question and target response of the task: the text a tiny tokenizer is trained on."""
    colors = list(cfg.colors)
    lines = [f"how many {c} shapes are there ?" for c in colors]
    lines += [f"how many {_plural(k)} are there ?" for k in KINDS]
    lines += [f"what color is the {k} ?" for k in KINDS]
    lines += [f"are there more {a} shapes than {b} shapes ?" for a in colors for b in colors if a != b]
    lines += [f"{ANSWER_PREFIX} {w}" for w in answer_vocabulary(cfg)]
    return lines
