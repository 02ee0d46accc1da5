"""Tests for spotlight.core.config_io on small nested config dataclasses defined here."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from spotlight.core.config_io import (
    describe,
    dump_yaml,
    field_docs,
    from_dict,
    load_config,
    parse_override,
    save_config,
    to_dict,
)


@dataclass
class Optim:
    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam betas."""
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer to use."""


@dataclass
class Lora:
    rank: int = 8
    """LoRA rank."""
    targets: list[str] = field(default_factory=lambda: ["to_q", "to_v"])
    """Module names to adapt."""


@dataclass
class Train:
    steps: int = 100
    """Number of optimizer steps."""
    optim: Optim = field(default_factory=Optim)
    """Optimizer settings."""
    lora: Lora | None = None
    """LoRA adapter; null trains all weights."""
    reward_weights: dict[str, float] = field(default_factory=lambda: {"aesthetic": 1.0})
    """Weight of each reward model."""
    warmup: int | None = None
    """Warmup steps; null means no warmup."""

    def validate(self) -> None:
        if self.warmup is not None and self.warmup > self.steps:
            raise ValueError(f"warmup ({self.warmup}) must be <= steps ({self.steps}); lower warmup")


@dataclass
class Config:
    name: str = "run"
    """Run name."""
    seed: int = 0
    """Random seed."""
    bf16: bool = True
    """Train in bfloat16."""
    train: Train = field(default_factory=lambda: Train(steps=200))
    """Training options."""


@dataclass
class Required:
    path: str
    """Where the data lives."""
    batch: int = 4
    """Batch size."""


def write(tmp_path, text: str, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def fails(match: str):
    return pytest.raises(ValueError, match=re.escape(match))


# ---------------------------------------------------------------------------- layering


def test_defaults_without_recipe():
    cfg = load_config(Config)
    assert cfg == Config()
    assert cfg.train.steps == 200  # the parent's default_factory, not Train's class default


def test_recipe_overrides_defaults_and_keeps_the_rest(tmp_path):
    recipe = write(tmp_path, "name: exp\ntrain:\n  optim:\n    lr: 3e-4\n")
    cfg = load_config(Config, recipe)
    assert cfg.name == "exp"
    assert cfg.train.optim.lr == 3e-4 and isinstance(cfg.train.optim.lr, float)
    assert cfg.train.steps == 200  # partial section keeps the parent's default values
    assert cfg.train.optim.betas == (0.9, 0.999)


def test_command_line_beats_recipe_beats_base(tmp_path):
    recipe = write(tmp_path, "seed: 1\ntrain:\n  optim:\n    lr: 3e-4\n")
    base = {"seed": 7, "bf16": False, "train": {"steps": 50}}
    cfg = load_config(Config, recipe, ["train.optim.lr=1e-5", "name=cli"], base=base)
    assert cfg.train.optim.lr == 1e-5
    assert (cfg.seed, cfg.bf16, cfg.train.steps, cfg.name) == (1, False, 50, "cli")
    # A later override of the same key wins.
    assert load_config(Config, overrides=["seed=1", "seed=2"]).seed == 2


def test_empty_recipe_is_defaults(tmp_path):
    assert load_config(Config, write(tmp_path, "# nothing\n")) == Config()


# ---------------------------------------------------------------------------- unknown keys


def test_unknown_recipe_key_suggests_nearest(tmp_path):
    recipe = write(tmp_path, "train:\n  optim:\n    lrr: 0.1\n")
    with fails(f"{recipe}: unknown key 'train.optim.lrr'; did you mean 'train.optim.lr'?"):
        load_config(Config, recipe)


def test_unknown_command_line_key_suggests_nearest(tmp_path):
    recipe = write(tmp_path, "seed: 3\n")
    with fails("command line: unknown key 'train.stesp'; did you mean 'train.steps'?"):
        load_config(Config, recipe, ["train.stesp=5"])
    with fails("command line: unknown key 'trian'; did you mean 'train'?"):
        load_config(Config, recipe, ["trian.steps=5"])


def test_unknown_key_without_close_match_lists_valid_keys():
    with fails("unknown key 'zzz'; valid keys: name, seed, bf16, train"):
        from_dict(Config, {"zzz": 1})
    with fails("unknown key 'train.optim.qqq'; valid keys under 'train.optim': lr, betas, name"):
        from_dict(Config, {"train": {"optim": {"qqq": 1}}})


# ---------------------------------------------------------------------------- types


def test_type_error_names_source_and_path(tmp_path):
    recipe = write(tmp_path, "train:\n  optim:\n    lr: abc\n")
    with fails(f"{recipe}: train.optim.lr: expected float, got str 'abc'"):
        load_config(Config, recipe)
    with fails("command line: train.optim.lr: expected float, got str 'abc'"):
        load_config(Config, overrides=["train.optim.lr=abc"])
    with fails("x.yaml: seed: expected int, got str 'a'"):
        from_dict(Config, {"seed": "a"}, source="x.yaml")
    with fails("seed: expected int"):  # no source: no prefix
        from_dict(Config, {"seed": "a"})


def test_int_accepted_for_float():
    cfg = from_dict(Config, {"train": {"optim": {"lr": 1}}})
    assert cfg.train.optim.lr == 1.0 and type(cfg.train.optim.lr) is float


def test_bool_rejected_for_int_and_float_and_int_for_bool():
    with fails("seed: expected int, got bool True"):
        from_dict(Config, {"seed": True})
    with fails("train.optim.lr: expected float, got bool False"):
        from_dict(Config, {"train": {"optim": {"lr": False}}})
    with fails("bf16: expected bool, got int 1"):
        from_dict(Config, {"bf16": 1})
    with fails("name: expected str (quote it to keep it a string), got int 123"):
        load_config(Config, overrides=["name=123"])
    assert load_config(Config, overrides=["name='123'"]).name == "123"


def test_literal_lists_allowed_values():
    assert from_dict(Config, {"train": {"optim": {"name": "sgd"}}}).train.optim.name == "sgd"
    with fails("train.optim.name: expected one of 'adamw', 'sgd', got str 'adam'"):
        from_dict(Config, {"train": {"optim": {"name": "adam"}}})


def test_optional_fields_and_sections(tmp_path):
    cfg = from_dict(Config, {"train": {"warmup": 10, "lora": {"rank": 4}}})
    assert cfg.train.warmup == 10
    assert cfg.train.lora == Lora(rank=4)  # the section's own defaults fill the rest
    cfg = from_dict(Config, {"train": {"warmup": None, "lora": None}})
    assert cfg.train.warmup is None and cfg.train.lora is None
    # A dotted override creates a section the recipe left null.
    recipe = write(tmp_path, "train:\n  lora: null\n")
    assert load_config(Config, recipe, ["train.lora.rank=16"]).train.lora == Lora(rank=16)
    with fails("train.warmup: expected int, got str 'x'"):
        from_dict(Config, {"train": {"warmup": "x"}})
    with fails("name: expected str (quote it to keep it a string), got NoneType None"):
        from_dict(Config, {"name": None})


def test_list_tuple_dict_fields():
    cfg = from_dict(
        Config,
        {
            "train": {
                "optim": {"betas": [0.8, 1]},
                "lora": {"targets": ["a", "b", "c"]},
                "reward_weights": {"clip": 0.5, "ocr": 2},
            }
        },
    )
    assert cfg.train.optim.betas == (0.8, 1.0) and isinstance(cfg.train.optim.betas, tuple)
    assert cfg.train.lora.targets == ["a", "b", "c"]
    assert cfg.train.reward_weights == {"clip": 0.5, "ocr": 2.0}  # replaced, not merged
    with fails("train.optim.betas[1]: expected float, got str 'x'"):
        from_dict(Config, {"train": {"optim": {"betas": [0.9, "x"]}}})
    with fails("train.reward_weights.clip: expected float, got str 'high'"):
        from_dict(Config, {"train": {"reward_weights": {"clip": "high"}}})
    with fails("train.lora.targets: expected list[str], got str 'to_q'"):
        from_dict(Config, {"train": {"lora": {"targets": "to_q"}}})
    # A dotted override adds one entry to the default mapping; a mapping given whole replaces it.
    assert load_config(Config, overrides=["train.reward_weights.ocr=3"]).train.reward_weights == {
        "aesthetic": 1.0,
        "ocr": 3.0,
    }
    cfg = load_config(Config, overrides=["train.reward_weights={ocr: 3}"])
    assert cfg.train.reward_weights == {"ocr": 3.0}


def test_dotted_override_adds_to_recipe_mapping(tmp_path):
    recipe = write(tmp_path, "train:\n  reward_weights: {clip: 1}\n")
    cfg = load_config(Config, recipe, ["train.reward_weights.ocr=3"])
    assert cfg.train.reward_weights == {"clip": 1.0, "ocr": 3.0}


def test_fixed_length_tuple():
    @dataclass
    class Box:
        size: tuple[int, int] = (1, 2)
        """Height and width."""

    assert from_dict(Box, {"size": [3, 4]}).size == (3, 4)
    with fails("size: expected 2 items (tuple[int, int]), got list [1, 2, 3]"):
        from_dict(Box, {"size": [1, 2, 3]})


def test_mapping_where_scalar_expected_and_vice_versa(tmp_path):
    with fails("seed: expected int, got dict {'a': 1}"):
        from_dict(Config, {"seed": {"a": 1}})
    with fails("train: expected a mapping of Train keys, got int 3"):
        from_dict(Config, {"train": 3})
    with fails("train.reward_weights: expected a mapping (dict[str, float]), got list [1]"):
        from_dict(Config, {"train": {"reward_weights": [1]}})
    with fails("command line: cannot set 'seed.x': 'seed' is int 3, not a section"):
        load_config(Config, overrides=["seed=3", "seed.x=1"])
    with fails("expected a mapping of Config keys, got list [1]"):
        from_dict(Config, [1])


def test_missing_required_key():
    assert from_dict(Required, {"path": "/data"}) == Required(path="/data")
    with fails("path: missing required key"):
        from_dict(Required, {"batch": 2})


# ---------------------------------------------------------------------------- recipe files


def test_missing_recipe_file_names_path(tmp_path):
    with fails(f"recipe file '{tmp_path / 'nope.yaml'}' not found"):
        load_config(Config, tmp_path / "nope.yaml")


def test_bad_yaml_names_file_and_line(tmp_path):
    recipe = write(tmp_path, "seed: 1\ntrain:\n  steps: [1, 2\n  lr: 3\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(recipe))}: invalid YAML at line \d+"):
        load_config(Config, recipe)
    recipe = write(tmp_path, "seed: 1\n  bad: indent\n")
    with fails(f"{recipe}: invalid YAML at line 2"):
        load_config(Config, recipe)


def test_recipe_top_level_must_be_mapping(tmp_path):
    with fails("the top level must be a mapping of config keys, got list"):
        load_config(Config, write(tmp_path, "- 1\n- 2\n"))


# ---------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("train.lr=3e-4", "train.lr", 3e-4),
        ("lr=1e5", "lr", 1e5),
        ("lr=1.5E-3", "lr", 1.5e-3),
        ("lr=-2e-2", "lr", -2e-2),
        ("lr=0.1", "lr", 0.1),
        ("steps=10", "steps", 10),
        ("a.b=[1,2]", "a.b", [1, 2]),
        ("a=null", "a", None),
        ("a=true", "a", True),
        ("a=hello world", "a", "hello world"),
        ("a=x=y", "a", "x=y"),
        ("a='3e-4'", "a", "3e-4"),
        ("a=", "a", ""),
        ("a={b: 1}", "a", {"b": 1}),
    ],
)
def test_parse_override(text, key, value):
    k, v = parse_override(text)
    assert k == key and v == value and type(v) is type(value)


@pytest.mark.parametrize("text", ["train.lr", "=3", "a..b=1", ".a=1"])
def test_parse_override_rejects_malformed(text):
    with fails("must look like dotted.key=value, e.g. train.lr=3e-4"):
        parse_override(text)


def test_parse_override_bad_yaml_value():
    with fails("cannot parse the value of 'a=[1, 2' as YAML"):
        parse_override("a=[1, 2")


def test_recipe_exponent_floats_are_floats(tmp_path):
    recipe = write(tmp_path, "train:\n  optim:\n    lr: 5e-6\n    betas: [9e-1, 1E0]\n")
    cfg = load_config(Config, recipe)
    assert cfg.train.optim.lr == 5e-6 and cfg.train.optim.betas == (0.9, 1.0)


# ---------------------------------------------------------------------------- validate hook


def test_validate_hook_prefixes_path_and_source(tmp_path):
    with fails("command line: train: warmup (500) must be <= steps (200); lower warmup"):
        load_config(Config, overrides=["train.warmup=500"])
    recipe = write(tmp_path, "train:\n  steps: 10\n")
    with fails(f"{recipe} + command line: train: warmup (20) must be <= steps (10)"):
        load_config(Config, recipe, ["train.warmup=20"])
    with fails("x.yaml: train: warmup (3) must be <= steps (2)"):
        from_dict(Config, {"train": {"steps": 2, "warmup": 3}}, source="x.yaml")


def test_post_init_value_error_is_prefixed_too():
    @dataclass
    class Positive:
        n: int = 1
        """A positive number."""

        def __post_init__(self):
            if self.n <= 0:
                raise ValueError("n must be > 0")

    with fails("r.yaml: n must be > 0"):
        from_dict(Positive, {"n": 0}, source="r.yaml")


# ---------------------------------------------------------------------------- round trip


def _custom_config() -> Config:
    return Config(
        name="3e-4",
        seed=5,
        bf16=False,
        train=Train(
            steps=7,
            optim=Optim(lr=1e-10, betas=(0.5, 0.75), name="sgd"),
            lora=Lora(rank=2, targets=["x"]),
            reward_weights={"a": 0.25, "b": 1e-3},
            warmup=3,
        ),
    )


def test_to_dict_is_plain_and_yaml_safe():
    d = to_dict(_custom_config())
    assert d["train"]["optim"]["betas"] == [0.5, 0.75]
    assert d["train"]["lora"] == {"rank": 2, "targets": ["x"]}
    assert from_dict(Config, d) == _custom_config()


def test_dump_save_load_round_trip(tmp_path):
    cfg = _custom_config()
    text = dump_yaml(cfg)
    assert text.index("name:") < text.index("seed:") < text.index("train:")  # field order
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert path.read_text() == text
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left
    loaded = load_config(Config, path)
    assert loaded == cfg and loaded.name == "3e-4"  # the str that looks like a float stays a str
    assert load_config(Config, tmp_path / "run" / "config.yaml") == cfg
    save_config(Config(), path)  # overwrite in place
    assert load_config(Config, path) == Config()


# ---------------------------------------------------------------------------- docs


def _all_keys(cls, prefix=""):
    keys = []
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        sub = {"optim": Optim, "lora": Lora, "train": Train}.get(f.name)
        if sub is not None:
            keys += _all_keys(sub, prefix + f.name + ".")
    return keys


def test_field_docs_finds_every_field():
    docs = field_docs(Config)
    assert set(docs) == set(_all_keys(Config))
    assert docs["train.optim.lr"] == "Peak learning rate."
    assert docs["train.lora.targets"] == "Module names to adapt."
    assert docs["train"] == "Training options."


def test_field_docs_inherited_and_undocumented():
    @dataclass
    class Child(Optim):
        clip: float = 1.0
        """Gradient clip norm."""
        plain: int = 0

    docs = field_docs(Child)
    assert docs["lr"] == "Peak learning rate." and docs["clip"] == "Gradient clip norm."
    assert "plain" not in docs


def test_describe_lists_keys_types_defaults_docs():
    text = describe(Config)
    lines = text.splitlines()
    assert "name (str, default run): Run name." in lines
    assert "bf16 (bool, default true): Train in bfloat16." in lines
    assert "train: Training options." in lines
    assert "train.steps (int, default 200): Number of optimizer steps." in lines
    assert "train.optim.lr (float, default 0.0001): Peak learning rate." in lines
    assert "train.optim.betas (tuple[float, ...], default [0.9, 0.999]): Adam betas." in lines
    assert "train.optim.name (Literal['adamw', 'sgd'], default adamw): Optimizer to use." in lines
    assert "train.lora (Lora | None, default null): LoRA adapter; null trains all weights." in lines
    assert "train.lora.rank (int, default 8): LoRA rank." in lines
    assert ("train.reward_weights (dict[str, float], default {aesthetic: 1.0}): Weight of each reward model.") in lines
    assert "path (str, required): Where the data lives." in describe(Required).splitlines()


def test_the_shared_sections_give_one_name_per_setting_and_moved_keys_name_their_new_place(tmp_path):
    from spotlight.config import DiTRecipe
    from spotlight.core.config import LogSettings, TrainSettings
    from vlm.config import VLMRecipe

    shared = {f.name for f in dataclasses.fields(TrainSettings)}
    for recipe in (DiTRecipe(), VLMRecipe()):
        assert isinstance(recipe.train, TrainSettings) and isinstance(recipe.log, LogSettings)
        assert shared <= {f.name for f in dataclasses.fields(recipe.train)}
    # The shared checks run on both paths, under the same key.
    for cls in (DiTRecipe, VLMRecipe):
        with pytest.raises(ValueError, match=r"train\.group_size must be >= 2"):
            load_config(cls, None, ["train.group_size=1"])
        with pytest.raises(ValueError, match=r"train\.adam_beta2 must be in \(0, 1\)"):
            load_config(cls, None, ["train.adam_beta2=1.0"])
    # A subclass that only changes a default keeps the shared docstring.
    assert field_docs(VLMRecipe)["train.group_size"] == field_docs(DiTRecipe)["train.group_size"]
    assert load_config(VLMRecipe, None, ["train.group_size=4"]).train.group_size == 4
    # The VLM group size was rollout.group_size: a recipe or an override with it fails naming the new key.
    with pytest.raises(ValueError, match=r"command line: 'rollout\.group_size' is now 'train\.group_size'"):
        load_config(VLMRecipe, None, ["rollout.group_size=4"])
    old = tmp_path / "old.yaml"
    old.write_text("rollout:\n  group_size: 4\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(old))}: 'rollout\.group_size' is now 'train\.group_size'"):
        load_config(VLMRecipe, old)
