"""Readers of the files a user hands in (local or in a bucket): a missing, damaged, empty or non-UTF-8 file
is one line of the caller's `MhfError` naming the file, where in it, and the caller's `fix`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mhf_dist.errors import MhfError, problem_line
from mhf_dist.storage import Location, StorageError

PathLike = str | Path | Location
JSON_KINDS = {dict: "an object", list: "an array", str: "a string", bool: "true or false",
              int: "a whole number", float: "a number", type(None): "null"}  # fmt: skip


def json_kind(value: Any) -> str:
    """`value`'s JSON type (json.loads gives only these), as an error line names it: "an array"."""
    return JSON_KINDS[type(value)]


def check_file(path: PathLike, error: type[MhfError], what: str = "") -> Location:
    """`path`, which must be a file: else `error` that it does not exist or (a folder, a device) is not a
    file, naming `what` it was to be first (e.g. "config file")."""
    where = Location.of(path)
    if not where.is_file():
        missing = "is not a file" if where.exists() else "does not exist"
        raise error(f"{what}{' ' if what else ''}{str(where)!r} {missing}; check the path")
    return where


def read_text(path: PathLike, error: type[MhfError], fix: str) -> str:
    """The file as strict UTF-8; an undecodable byte is `error` naming its offset and line."""
    where = Location.of(path)
    try:
        data = where.read_bytes()
    except (FileNotFoundError, StorageError):
        check_file(where, error)  # says what is there instead, if anything (one more request, on failure)
        raise
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise error(
            f"{str(where)!r} is not UTF-8: byte 0x{data[err.start]:02x} at byte offset {err.start} "
            f"(line {line}) cannot be decoded; {fix}"
        ) from None


class RepeatedKeyError(ValueError):
    """A key given twice in one JSON object (its `args[0]`): valid JSON, but `json` keeps the last one."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    unique: dict[str, Any] = {}
    for key, value in pairs:
        if key in unique:
            raise RepeatedKeyError(key)
        unique[key] = value
    return unique


def read_json(path: PathLike, error: type[MhfError], fix: str) -> Any:
    """The parsed file; an empty file, invalid JSON or a key given twice is `error` naming the line."""
    where = Location.of(path)
    text = read_text(where, error, fix)
    if not text.strip():
        raise error(f"{str(where)!r} is empty; {fix}")
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise error(f"{str(where)!r} is damaged (invalid JSON at line {err.lineno}); {fix}") from None
    except RepeatedKeyError as err:
        raise error(f"{str(where)!r} gives the key {err.args[0]!r} twice in one object; {fix}") from None


Record = TypeVar("Record", bound=BaseModel)


def read_record(path: PathLike, model: type[Record], error: type[MhfError], fix: str) -> Record:
    """`read_json` of a file mhf-dist wrote, as `model` (`as_record`)."""
    return as_record(read_json(path, error, fix), model, path, error, fix)


def as_record(raw: Any, model: type[Record], path: PathLike, error: type[MhfError], fix: str) -> Record:
    """The file's JSON `raw` as `model`; one of another shape is `error` in one line."""
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        where = str(Location.of(path))
        raise error(f"{where!r} is damaged or was edited ({problem_line(err)}); {fix}") from None


def read_jsonl(
    path: PathLike, error: type[MhfError], fix: str, fields: Mapping[str, type] | None = None
) -> list[dict[str, Any]]:
    """One JSON object per line (blank ones skipped) holding `fields`; else `error` at `file:line`."""
    return [row for _, row in read_jsonl_located(path, error, fix, fields)]


def read_jsonl_located(
    path: PathLike, error: type[MhfError], fix: str, fields: Mapping[str, type] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """`read_jsonl`'s rows, each after its `file:line` (for errors a caller finds in a row later)."""
    where = Location.of(path)
    rows = []
    for number, line in enumerate(read_text(where, error, fix).splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{where}:{number}"
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            raise error(f"{at}: not valid JSON ({err.msg}, column {err.colno}); {fix}") from None
        except RepeatedKeyError as err:
            raise error(f"{at}: the key {err.args[0]!r} is given twice; keep one of the two") from None
        if not isinstance(row, dict):
            raise error(f"{at}: {json_kind(row)}, not a JSON object; {fix}")
        for name, kind in (fields or {}).items():
            if name not in row:
                raise error(f"{at}: missing field {name!r}; each line needs {', '.join(fields)}")
            value = row[name]
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise error(f"{at}: field {name!r} must be {JSON_KINDS[kind]}, not {json_kind(value)}")
        rows.append((at, row))
    return rows


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader by YAML 1.2's core schema (`010` is 10; `yes`, `1:30`, `2024-01-01` text), so a
    value means the same in a file and in `--set`; a key given twice (PyYAML keeps the last) is refused."""


class _QuotingDumper(yaml.SafeDumper):
    """PyYAML's safe dumper that also quotes text YAML 1.2 reads as another type (`1e3`, `0o17`), so that
    `load_yaml` and PyYAML alike read back what was written."""


_UniqueKeyLoader.yaml_implicit_resolvers = {}
_CORE = {
    "null": (r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    "bool": (r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    "int": (r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    "float": (r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)",
              list("-+.0123456789")),
    "merge": (r"<<", ["<"]),
}  # fmt: skip
for _tag, (_pattern, _first) in _CORE.items():
    for _yaml in (_UniqueKeyLoader, _QuotingDumper):  # the dumper keeps PyYAML's own as well
        _yaml.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", re.compile(f"^(?:{_pattern})$"), _first)


def dump_yaml(value: Any) -> str:
    """`value` as YAML, keys in their order, that `load_yaml` reads back as `value`."""
    return yaml.dump(value, Dumper=_QuotingDumper, sort_keys=False)


def _core_number(loader: _UniqueKeyLoader, node: yaml.ScalarNode) -> int | float:
    """An int or float by YAML 1.2's core schema, also under an explicit `!!int` or `!!float` tag
    (SafeLoader's reads `010` as 8 and `!!float 1:30` as 90)."""
    text, kind = loader.construct_scalar(node), node.tag.rsplit(":", 1)[-1]
    if not re.fullmatch(_CORE[kind][0], text):
        problem = f"{text!r} is no YAML 1.2 {kind}"
        raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark)
    if kind == "float":
        return float(text.lower().replace(".inf", "inf").replace(".nan", "nan"))
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    return int(text[2:] if base != 10 else text, base)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _core_number)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _core_number)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one YAML mapping: valid syntax, but one of the two would be ignored."""

    fix = "keep one of the two"


def _mapping_of_unique_keys(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        # `<<: *anchor` merges another mapping (its keys may be overridden)
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: construct_mapping names it
            break
        if repeated:
            raise DuplicateKeyError(
                "while reading a mapping", node.start_mark, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_of_unique_keys)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` by YAML 1.2's core schema; a key given twice, or nesting deeper than Python's
    recursion limit, is a `yaml.YAMLError`."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except RecursionError:
        raise yaml.MarkedYAMLError(problem="nested deeper than a config can be") from None


def read_yaml(path: PathLike, error: type[MhfError], fix: str) -> Any:
    """`load_yaml` of the file (an empty one is None); invalid YAML is `error` naming the line and column."""
    where = Location.of(path)
    try:
        return load_yaml(read_text(where, error, "save it as UTF-8"))  # `fix` is for the YAML itself
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        advice = err.fix if isinstance(err, DuplicateKeyError) else fix
        raise error(f"cannot parse {where}{at}: {problem}; {advice}") from None
