"""Typed-dataclass configs: build them from YAML recipes and dotted overrides, dump, document.

The dataclasses are the single source of truth; layers override them, later wins:

    dataclass defaults <- ``base`` dict <- YAML recipe <- ``key=value`` command-line overrides

Layers are merged as plain dicts and validated once, against the dataclass types; errors are
``ValueError`` naming the layer the bad value came from, the dotted key, and what to change. A
section may list keys that moved elsewhere in a ``MOVED`` class attribute (old key -> new dotted
key); a recipe or override that still uses one fails with the new name.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import os
import re
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

__all__ = [
    "describe",
    "dump_yaml",
    "field_docs",
    "from_dict",
    "load_config",
    "parse_override",
    "save_config",
    "to_dict",
]

T = TypeVar("T")
_Where = Callable[[str], str]  # dotted key -> the layer(s) it came from, for error messages
_MISSING: Any = dataclasses.MISSING
COMMAND_LINE = "command line"

# PyYAML implements YAML 1.1, whose floats need a dot and a signed exponent: `3e-4` and `1e5`
# load as *strings*. Our loader also reads the YAML 1.2 forms as floats, and our dumper uses the
# same rule so that a str field holding "3e-4" is quoted and round-trips as a string.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _Loader(yaml.SafeLoader):
    """yaml.SafeLoader that also reads `3e-4` as a float."""


class _Dumper(yaml.SafeDumper):
    """yaml.SafeDumper that quotes strings `_Loader` would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+.0123456789"))
_SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}


def from_dict(cls: type[T], data: dict, *, source: str = "") -> T:
    """Builds `cls` (recursively) from a plain dict; missing keys keep the dataclass defaults.

    Args:
        cls: a dataclass type.
        data: nested plain dict, e.g. loaded from YAML.
        source: where `data` came from (a recipe path), used to prefix error messages.
    """
    if not isinstance(data, dict):
        raise _error(source, "", f"expected a mapping of {cls.__name__} keys, got {_show(data)}")
    return _build(cls, data, "", lambda _key: source)


def _build(cls: type[T], data: dict, path: str, where: _Where, base: Any = None) -> T:
    """`base`, when given, is an instance of `cls` whose values replace the field defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown_key(key, list(fields), path, where, moved=getattr(cls, "MOVED", {}))
    kwargs = {}
    for name, f in fields.items():
        key = f"{path}.{name}" if path else name
        if name in data:
            default = getattr(base, name) if base is not None else _field_default(f)
            kwargs[name] = _convert(hints[name], data[name], key, where, default)
        elif base is not None:
            kwargs[name] = copy.deepcopy(getattr(base, name))
        elif f.default is _MISSING and f.default_factory is _MISSING:
            raise _error(where(key), key, "missing required key; set it in the recipe")
    try:
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)  # optional cross-field check hook
        if validate is not None:
            validate()
    except ValueError as e:
        raise _error(where(path), path, str(e)) from e
    return obj


def _convert(tp: Any, value: Any, path: str, where: _Where, default: Any = _MISSING) -> Any:
    """Checks `value` against the annotation `tp` and converts it (list->tuple, int->float, ...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)

    def bad(expected: str) -> ValueError:
        return _error(where(path), path, f"expected {expected}, got {_show(value)}")

    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        if len(arms) != 1:
            raise TypeError(f"{path}: only `X | None` unions are supported, not {_type_name(tp)}")
        return _convert(arms[0], value, path, where, default)
    if origin is Literal:
        # `type(...) is` so that True does not pass for Literal[1] (True == 1 in Python).
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise bad("one of " + ", ".join(repr(a) for a in args))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise bad(f"a mapping of {tp.__name__} keys")
        return _build(tp, value, path, where, default if isinstance(default, tp) else None)
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad(_type_name(tp))
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: tuple[int, str]
            if len(value) != len(args):
                raise bad(f"{len(args)} items ({_type_name(tp)})")
            item_types = list(args)
        else:
            item_types = [args[0] if args else Any] * len(value)
        items = [_convert(t, v, f"{path}[{i}]", where) for i, (t, v) in enumerate(zip(item_types, value))]
        return tuple(items) if tuple in (tp, origin) else items
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise bad(f"a mapping ({_type_name(tp)})")
        if isinstance(value, _DottedSection) and isinstance(default, dict):
            value = {**default, **value}  # `weights.ocr=3` adds to the default weights
        key_type, value_type = args or (Any, Any)
        return {
            _convert(key_type, k, f"{path} key", where): _convert(value_type, v, f"{path}.{k}", where)
            for k, v in value.items()
        }
    if tp in _SCALARS:
        # bool is a subclass of int, but `true` for a count or a learning rate is a mistake.
        if isinstance(value, _SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
            return float(value) if tp is float else value
        quote = tp is str and (value is None or isinstance(value, (bool, int, float)))
        raise bad("str (quote it to keep it a string)" if quote else tp.__name__)
    raise TypeError(f"{path}: unsupported config field type {tp!r}")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return f.default


def _unknown_key(key: Any, valid: list[str], path: str, where: _Where, moved: dict[str, str]) -> ValueError:
    """`moved`: the section's `MOVED` class attribute, keys that now live elsewhere -> their new dotted name."""
    prefix = f"{path}." if path else ""
    if key in moved:
        return _error(where(prefix + str(key)), "", f"'{prefix}{key}' is now '{moved[key]}'; rename it there")
    close = difflib.get_close_matches(str(key), valid, n=1)
    under = f" under '{path}'" if path else ""
    hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys{under}: {', '.join(valid)}"
    return _error(where(prefix + str(key)), "", f"unknown key '{prefix}{key}'; {hint}")


def _error(where: str, path: str, msg: str) -> ValueError:
    return ValueError(": ".join([p for p in (where, path) if p] + [msg]))


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    return getattr(tp, "__name__", repr(tp))


def parse_override(text: str) -> tuple[str, Any]:
    """Splits `train.lr=3e-4` into ("train.lr", 0.0003); the value is parsed as YAML.

    `[1,2]` is a list, `null` is None, `true` a bool, `3e-4` a float; an empty value is "".
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or "" in key.split("."):
        raise ValueError(f"override {text!r} must look like dotted.key=value, e.g. train.lr=3e-4")
    if not raw.strip():
        return key, ""
    try:
        return key, yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ValueError(
            f"{COMMAND_LINE}: cannot parse the value of {text!r} as YAML ({e}); quote strings that contain YAML syntax"
        ) from e


def load_config(
    cls: type[T], recipe: str | Path | None = None, overrides: Sequence[str] = (), *, base: dict | None = None
) -> T:
    """Resolves a config: dataclass defaults <- `base` <- `recipe` YAML <- `overrides`.

    Args:
        cls: the top-level config dataclass.
        recipe: path of a YAML recipe whose top level is a mapping, or None.
        overrides: `dotted.key=value` strings from the command line.
        base: a nested dict applied under the recipe (e.g. a saved run's config).
    """
    data: dict = {}
    origins: dict[str, str] = {}  # dotted key of each value set -> the layer that set it
    if base:
        _merge(data, base, "", "base", origins)
    if recipe is not None:
        _merge(data, read_recipe(Path(recipe)), "", str(recipe), origins)
    for text in overrides:
        _set_dotted(data, *parse_override(text), origins)
    fallback = str(recipe) if recipe is not None else ""

    def where(path: str) -> str:
        # The layers that set this key, one of its parents, or anything under it.
        hits = [
            src
            for key, src in origins.items()
            if not path or key == path or key.startswith(path + ".") or path.startswith((key + ".", key + "["))
        ]
        return " + ".join(dict.fromkeys(hits)) or fallback

    return _build(cls, data, "", where)


def check_recipe_kind(recipe: str | Path | None, cls: type, command: str, others: Sequence[tuple[type, str]]) -> None:
    """Raise a ValueError naming the right command when `recipe`'s top-level keys are not all
    fields of `cls` but are all fields of one of `others` ((config class, its command) pairs): a
    DiT recipe given to `spotlight vlm train`, say, instead of a "did you mean" about one key."""
    if recipe is None:
        return
    keys = set(read_recipe(Path(recipe)))
    if keys <= {f.name for f in dataclasses.fields(cls)}:
        return
    for other, other_command in others:
        if keys <= {f.name for f in dataclasses.fields(other)}:
            raise ValueError(
                f"{recipe} is a recipe for `{other_command}`, not for `{command}` (its sections "
                f"{', '.join(sorted(keys - {f.name for f in dataclasses.fields(cls)}))} are not {command}'s); "
                f"run `{other_command} {recipe}`"
            )


def read_recipe(path: Path) -> dict:
    """The top-level mapping of a YAML recipe; a ValueError naming the file when it is missing, not
    text, not YAML or not a mapping."""
    if not path.is_file():
        raise ValueError(f"recipe file {str(path)!r} not found (working directory: {os.getcwd()})")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file (byte {e.start} is not UTF-8); a recipe is a YAML file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the recipe ({e.strerror})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}: invalid YAML{line}: {getattr(e, 'problem', None) or e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config keys, got {type(data).__name__}")
    return data


def _merge(dst: dict, src: dict, prefix: str, source: str, origins: dict[str, str]) -> None:
    """Deep-merges mapping `src` into `dst`, recording the source of every leaf it sets."""
    for k, v in src.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # an empty mapping sets no leaf, so nothing is recorded for it
            if not isinstance(dst.get(k), dict):
                _forget(origins, key)
                dst[k] = {}
            _merge(dst[k], v, key + ".", source, origins)
        else:
            _forget(origins, key)
            dst[k] = copy.deepcopy(v)
            origins[key] = source


def _forget(origins: dict[str, str], key: str) -> None:
    for k in [k for k in origins if k == key or k.startswith(key + ".")]:
        del origins[k]


class _DottedSection(dict):
    """A mapping that only a dotted override created: for a dict-typed field it updates the
    field's default instead of replacing it (dataclass sections always fill in defaults)."""


def _set_dotted(data: dict, key: str, value: Any, origins: dict[str, str]) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        parent = ".".join(parts[: i + 1])
        child = node.get(part)
        if part not in node:
            child = node[part] = _DottedSection()
        elif child is None:  # e.g. `model.lora.rank=8` where the recipe says `lora: null`
            child = node[part] = {}
            _forget(origins, parent)
        elif not isinstance(child, dict):
            raise ValueError(f"{COMMAND_LINE}: cannot set '{key}': '{parent}' is {_show(child)}, not a section")
        node = child
    node[parts[-1]] = value
    _forget(origins, key)
    origins[key] = COMMAND_LINE


def to_dict(obj: Any) -> Any:
    """Converts a config dataclass to plain YAML-safe data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(obj: Any) -> str:
    """The config as YAML, in field order; `load_config` reads it back to an equal object."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def save_config(obj: Any, path: str | Path) -> Path:
    """Writes `dump_yaml(obj)` to `path` atomically (readers never see a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(dump_yaml(obj))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def field_docs(cls: type) -> dict[str, str]:
    """The docstring literal under each field, keyed by dotted name (nested sections included)."""
    hints = typing.get_type_hints(cls)
    own = _own_docs(cls)
    docs: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        if f.name in own:
            docs[f.name] = own[f.name]
        section = _section_type(hints[f.name])
        if section is not None:
            docs.update({f"{f.name}.{k}": v for k, v in field_docs(section).items()})
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # base classes first, so subclasses override their docs
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # built without source (REPL, make_dataclass): no docs
            continue
        body = ast.parse(source).body[0].body
        for stmt, nxt in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _section_type(tp: Any) -> type | None:
    """The dataclass behind a field annotated `Section` or `Section | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1 and dataclasses.is_dataclass(arms[0]):
            return arms[0]
    return None


def describe(cls: type) -> str:
    """One line per key, `key (type, default ...): doc`, for `--help`-style output."""
    docs = field_docs(cls)
    lines: list[str] = []

    def walk(klass: type, instance: Any, prefix: str) -> None:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if not f.init:
                continue
            key, tp = prefix + f.name, hints[f.name]
            default = getattr(instance, f.name) if instance is not None else _field_default(f)
            doc = docs.get(key, "")
            section = _section_type(tp)
            if section is not None and isinstance(default, section):
                lines.append(f"{key}: {doc}".rstrip())
            else:
                shown = "required" if default is _MISSING else f"default {_yaml_inline(default)}"
                lines.append(f"{key} ({_type_name(tp)}, {shown}): {doc}".rstrip())
            if section is not None:
                walk(section, default if isinstance(default, section) else None, key + ".")

    walk(cls, None, "")
    return "\n".join(lines)


def _yaml_inline(value: Any) -> str:
    text = yaml.dump(to_dict(value), Dumper=_Dumper, default_flow_style=True, width=10**9)
    return text.removesuffix("\n").removesuffix("\n...").strip()
