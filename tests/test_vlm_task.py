"""The shapes question task and its verifiable rewards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlm.config import COLOR_RGB, TaskConfig
from vlm.rewards import CombinedReward, accuracy_reward, format_reward, numeric_reward, parse_answer
from vlm.task import BACKGROUND_RGB, CELL_PX, TrainStream, example_image, heldout_examples, make_example


def _recount(example) -> str:
    """The gold answer recomputed from the question words and the scene's cells."""
    words = example.question.split()
    shapes = [c for c in example.cells if c is not None]
    if words[:2] == ["how", "many"] and words[3] == "shapes":
        return str(sum(s[0] == words[2] for s in shapes))
    if words[:2] == ["how", "many"]:
        return str(sum(s[1] + "s" == words[2] for s in shapes))
    if words[:2] == ["what", "color"]:
        (color,) = [s[0] for s in shapes if s[1] == words[4]]
        return color
    a = sum(s[0] == words[3] for s in shapes)
    b = sum(s[0] == words[6] for s in shapes)
    return "yes" if a > b else "no"


def test_examples_are_pure_functions_of_their_seed_and_answers_are_right():
    cfg = TaskConfig()
    examples = [make_example(s, cfg) for s in range(300)]
    assert examples == [make_example(s, cfg) for s in range(300)]
    assert {e.question_type for e in examples} == {"count_color", "count_kind", "color_of", "compare"}
    for e in examples:
        assert e.answer == _recount(e), e
        assert 1 <= sum(c is not None for c in e.cells) <= cfg.max_shapes


def test_rendered_scene_shows_each_shape_in_its_cell():
    cfg = TaskConfig()
    e = make_example(5, cfg)
    img = example_image(e, cfg)
    assert img.size == (cfg.grid_size * CELL_PX,) * 2
    assert np.array_equal(np.asarray(img), np.asarray(example_image(e, cfg)))
    pixels = np.asarray(img).astype(int)
    for i, cell in enumerate(e.cells):
        row, col = divmod(i, cfg.grid_size)
        block = pixels[row * CELL_PX : (row + 1) * CELL_PX, col * CELL_PX : (col + 1) * CELL_PX].reshape(-1, 3)
        if cell is None:
            assert (block == np.array(BACKGROUND_RGB)).all()
        else:
            assert (np.abs(block - np.array(COLOR_RGB[cell[0]])).sum(axis=1) == 0).sum() > 40


def test_training_stream_never_yields_a_heldout_example():
    cfg = TaskConfig(grid_size=2, max_shapes=1, colors=("red", "blue"), num_heldout=48)
    heldout = {e.key for e in heldout_examples(cfg)}
    # The scene space is tiny here (4 cells x 2 colours x 3 kinds), so collisions must be skipped.
    train = TrainStream(cfg, seed=0).batch(0, 200)
    assert heldout and not heldout & {e.key for e in train}
    assert heldout_examples(cfg) == heldout_examples(cfg)
    assert heldout_examples(cfg) != heldout_examples(
        TaskConfig(grid_size=2, max_shapes=1, colors=("red", "blue"), num_heldout=48, split_seed=1)
    )


def test_task_config_rejects_unknown_colors():
    from spotlight.core.config_io import from_dict
    from vlm.config import VLMRecipe

    with pytest.raises(ValueError, match="colors"):
        from_dict(VLMRecipe, {"task": {"colors": ["red", "teal"]}})


def test_answer_rewards():
    responses = ["answer : 3", "answer : 2", "answer: red", "3", "answer : blue extra", "Answer : yes"]
    answers = ["3", "3", "red", "3", "blue", "yes"]
    assert parse_answer("answer : 3") == "3" and parse_answer("the answer is 3") is None
    assert accuracy_reward(responses, answers).tolist() == [1, 0, 1, 0, 0, 1]
    assert format_reward(responses, answers).tolist() == [1, 1, 1, 0, 0, 1]
    numeric = numeric_reward(responses, answers)
    assert numeric[0] == 1 and numeric[1] == pytest.approx(np.exp(-1)) and numeric[2] == 1 and numeric[3] == 0


def test_combined_reward_weights_and_names():
    reward = CombinedReward({"accuracy": 1.0, "format": 0.5})
    result = reward(["answer : 1", "answer : 2", "nonsense"], ["1", "1", "1"])
    assert torch.allclose(result.total_B, torch.tensor([1.5, 0.5, 0.0]))
    assert set(result.components) == {"accuracy", "format"}
    with pytest.raises(ValueError, match="did you mean 'accuracy'|Did you mean 'accuracy'"):
        CombinedReward({"acuracy": 1.0})
