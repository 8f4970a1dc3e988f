"""A sweep file and the trials it expands to.

```yaml
name: matched-tiny
kind: matched                 # matched | seeds | grid
config: tiny                  # preset name or config YAML every trial starts from
set: {train.steps: 100, topology.workers: 2}   # config overrides for every trial
families: [mhf, qwen3, qwen3_matched]   # matched: the families trained on the mhf config; an entry
                              # {group: mhf_vocab, family: mhf, set: {model.hash.loss: vocab}} is a variant
seeds: [0, 1]
grid: {train.lr: [1.0e-3, 3.0e-3]}      # grid: config keys (topology.* too) over value lists (x seeds)
asha: {metric: loss, grace_period: 20}  # grid, optional: ASHA early stopping
matched_to: mhf               # matched: the family parameter residuals are measured against
evaluate: [{task: bpb, data: test.txt}]  # `mhf eval` tasks run on each trial's exported model
```
A trial is one `mhf train` run: a name, a family, a seed and its config overrides (dotted keys for
`load_config`); its group, the trial without the seed, is what `mhf compare` aggregates over.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator

from mhf_dist.config import (
    DIRECTORY_NAME,
    DIRECTORY_NAME_RULE,
    MAX_NAME,
    Config,
    Place,
    Seed,
    StrictModel,
    TopologyConfig,
    check_topology,
    flatten,
    load_config,
    section_model,
)
from mhf_dist.errors import ConfigError, MhfError, first_problem, refused_value
from mhf_dist.eval import WINDOW, WINDOWED
from mhf_dist.plugins import FAMILIES
from mhf_dist.readers import check_file, read_yaml
from mhf_dist.storage import Location

VARIANT_FORM = "a variant mapping {group: NAME, family: FAMILY, set: {key: value}} (NAME: [A-Za-z0-9._-])"
STORAGE_KEY = "topology.storage"  # every trial's: the sweep's trials directory
MATCHING = ("families", "matched_to")  # what only a matched sweep reads
# Config keys the sweep sets for each trial itself: a `set:`, `grid:` or --set of one would be overridden.
SWEEP_KEYS = {
    "train.seed": "the sweep's `seeds`",
    STORAGE_KEY: "the sweep's `storage`",
    "preset": "the sweep's `config`",
}


def _merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Config overrides merged one dotted key at a time, later layers winning, as `mhf train` merges
    `--set`s: a later `train: {lr: ..}` keeps an earlier train.steps."""
    return {key: value for layer in layers for key, value in flatten(layer)}


def _keys_given(settings: dict[str, Any]) -> list[str]:
    """The dotted keys a `set:` or `grid:` gives values, nested ones too (`train: {seed: 1}`, or a grid's
    `train: [{seed: 1}, {seed: 2}]`)."""
    keys = []
    for key, value in flatten(settings):
        keys.append(key)
        for item in value if isinstance(value, list) else []:
            keys += [inner for inner, _ in flatten(item, f"{key}.")] if isinstance(item, dict) else []
    return keys


class AshaConfig(StrictModel):
    metric: str = "loss"  # reported by the workers at every log step
    mode: Literal["min", "max"] = "min"
    grace_period: int = Field(10, gt=0, description="steps every trial runs before it can be stopped")
    reduction_factor: float = Field(2.0, gt=1)


def _twice(values: list[Any]) -> Any:
    """The first value given more than once, or None."""
    return next((value for value in values if values.count(value) > 1), None)


def _a_location(location: str) -> str:
    """A path or URI `Location` reads (a mistyped URI is the sweep file's mistake, named by its key)."""
    try:
        Location.of(location)
    except MhfError as err:
        raise ValueError(str(err)) from None
    return location


Where = Annotated[Place, AfterValidator(_a_location)]


class TrialEval(StrictModel):
    """An `mhf eval` task run on a trial's exported model; logged as eval.<task>.<metric> at its last step."""

    task: str
    data: Where | None = None
    limit: int = Field(0, ge=0, description="the first N examples; 0: all")
    seq_len: int | None = Field(None, ge=2, description=f"ppl and bpb: the window length (default {WINDOW})")

    @model_validator(mode="before")
    @classmethod
    def _window_of_a_windowed_task(cls, raw: Any) -> Any:
        """ppl's and bpb's default window, given here: a spec read back from its dump is the same spec."""
        if isinstance(raw, dict) and raw.get("task") in WINDOWED and raw.get("seq_len") is None:
            return {**raw, "seq_len": WINDOW}
        return raw

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        from mhf_dist.eval.tasks import TASKS

        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        return task

    @model_validator(mode="after")
    def _data_as_the_task_reads(self) -> TrialEval:
        from mhf_dist.eval.tasks import check_task_data

        try:
            check_task_data(self.task, self.data is not None, option="data")
        except MhfError as err:
            raise ValueError(str(err)) from None
        if self.seq_len is not None and self.task not in WINDOWED:
            raise ValueError(f"seq_len is read by ppl and bpb only; drop it for task {self.task!r}")
        return self


class FamilyVariant(StrictModel):
    """A matched sweep's group that trains `family` with its own overrides (e.g. another objective)."""

    group: str = Field(pattern=r"^[A-Za-z0-9._-]+$")
    family: str
    set: dict[str, Any] = Field(default_factory=dict)

    @field_validator("set")
    @classmethod
    def _not_the_sweeps_keys(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        taken = {**SWEEP_KEYS, "model.family": "the variant's `family`"}
        chosen = [key for key in _keys_given(overrides) if key in taken]
        if chosen:
            raise ValueError(f"{chosen[0]} is set by {taken[chosen[0]]}, not by a variant's `set`")
        return overrides


class SweepConfig(StrictModel):
    name: str = Field(min_length=1)
    kind: Literal["matched", "seeds", "grid"]
    config: str = "tiny"
    set: dict[str, Any] = Field(default_factory=dict)
    families: list[str | FamilyVariant] = Field(default_factory=lambda: ["mhf", "qwen3", "qwen3_matched"])
    seeds: list[Seed] = Field([0], min_length=1)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    asha: AshaConfig | None = None
    max_concurrent: int = Field(0, ge=0, description="trials at once; 0: as many as the CPUs allow")
    storage: Where = "runs/sweeps"  # the sweep's root: its record, Tune's state, the trials, MLflow
    experiment: str = Field("mhf-sweeps", min_length=1)
    metric: str = Field("val_nll", min_length=1)  # what `mhf compare` aggregates
    matched_to: str = Field("mhf", description="matched: the family parameter residuals are measured against")
    evaluate: list[TrialEval] = Field(default_factory=list)
    unstable_cv: float = Field(0.05, gt=0, description="coefficient of variation over seeds flagged unstable")

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not re.fullmatch(DIRECTORY_NAME, name):
            raise ValueError(DIRECTORY_NAME_RULE)
        return name

    @field_validator("set", "grid")
    @classmethod
    def _not_the_sweeps_keys(cls, settings: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        taken = {
            **SWEEP_KEYS,
            **({"model.family": "its `families`"} if info.data.get("kind") == "matched" else {}),
        }
        chosen = next((key for key in _keys_given(settings) if key in taken), None)
        if chosen is not None:
            also = " or --set" if info.field_name == "set" else ""
            raise ValueError(f"{chosen} is set by {taken[chosen]}, not by `{info.field_name}:`{also}")
        return settings

    @field_validator("evaluate")
    @classmethod
    def _each_task_once(cls, evaluate: list[TrialEval]) -> list[TrialEval]:
        # both entries' metrics would be logged as eval.<task>.*
        if (twice := _twice([entry.task for entry in evaluate])) is not None:
            raise ValueError(
                f"task {twice!r} comes twice (both would log eval.{twice}.*); give each task once"
            )
        return evaluate

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if (twice := _twice(seeds)) is not None:
            raise ValueError(
                f"seed {twice} comes twice (it would train the same run twice); give each seed once"
            )
        return seeds

    @field_validator("families", mode="before")
    @classmethod
    def _variants(cls, families: Any) -> Any:
        """An entry is a family name or a variant mapping; one message for a malformed variant."""
        if not isinstance(families, list):
            return families
        parsed = []
        for index, entry in enumerate(families):
            if isinstance(entry, dict):
                try:
                    entry = FamilyVariant.model_validate(entry)
                except ValidationError as err:
                    where, problem = first_problem(err)
                    shape = err.errors()[0]["type"] != "value_error"  # not a refusal of a well-formed one
                    raise ValueError(
                        f"entry {index} ({where}): {problem}" + (f"; write {VARIANT_FORM}" if shape else "")
                    ) from None
            elif not isinstance(entry, str | FamilyVariant):
                raise ValueError(f"entry {index} is {entry!r}; an entry is a family name or {VARIANT_FORM}")
            parsed.append(entry)
        return parsed

    @field_validator("families")
    @classmethod
    def _known_families(cls, families: list[str | FamilyVariant]) -> list[str | FamilyVariant]:
        names = [entry.family if isinstance(entry, FamilyVariant) else entry for entry in families]
        unknown = [family for family in names if family not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown family {unknown[0]!r}; choose from {', '.join(FAMILIES)}")
        if not families:
            raise ValueError("list at least one family")
        groups = [group for _, group in family_groups(families)]
        repeated = sorted({group for group in groups if groups.count(group) > 1})
        if repeated:
            raise ValueError(f"group {repeated[0]!r} appears twice; give each variant its own `group`")
        return families

    @field_validator("matched_to")
    @classmethod
    def _known_reference(cls, family: str) -> str:
        return cls._known_families([family])[0]

    @model_validator(mode="after")
    def _kind_fields(self) -> SweepConfig:
        if self.kind == "grid" and not self.grid:
            raise ValueError("a grid sweep needs `grid: {key: [values, ...]}`")
        if self.kind != "grid" and (self.grid or self.asha):
            raise ValueError(f"`grid` and `asha` belong to grid sweeps, not {self.kind!r}")
        fields = type(self).model_fields
        matching = [
            getattr(self, key) != fields[key].get_default(call_default_factory=True) for key in MATCHING
        ]
        if self.kind != "matched" and any(matching):  # by value: a dumped spec is parsed again
            raise ValueError(
                f"`families` and `matched_to` belong to matched sweeps; a {self.kind!r} sweep trains the "
                "config's family (set model.family in `set:`)"
            )
        empty = [key for key, values in self.grid.items() if not values]
        if empty:
            raise ValueError(f"grid key {empty[0]!r} has no values; list at least one")
        return self


@dataclass(frozen=True)
class Trial:
    name: str
    group: str
    family: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)


def load_sweep(
    path: str | Path, storage: str | None = None, overrides: dict[str, Any] | None = None
) -> SweepConfig:
    """A sweep file, local or in a bucket, with the command line's `--storage` and `--set`s on top (which
    may be what makes it valid). A mistake the file makes alone names the file, any other the file with
    the flags."""
    where = check_file(path, ConfigError, "sweep file")
    raw = read_yaml(where, ConfigError, "fix the YAML syntax")
    flags = [flag for flag, given in (("--storage", storage), ("--set", overrides)) if given]
    if not flags or not isinstance(raw, dict) or not isinstance(raw.get("set", {}), dict):
        return parse_sweep(raw, str(where))  # (a `set:` that is no mapping: the file's mistake)
    given = {"set": _merged(raw.get("set", {}), overrides or {}), **({"storage": storage} if storage else {})}
    source = f"{where} with {' and '.join(flags)}"
    try:
        return parse_sweep({**raw, **given}, source)
    except ConfigError as err:
        mistake = str(err).removeprefix(f"{source}: ")
    try:
        parse_sweep(raw, str(where))
    except ConfigError as err:
        if str(err) == f"{where}: {mistake}":
            raise
    raise ConfigError(f"{source}: {mistake}")


def parse_sweep(raw: Any, source: str = "sweep") -> SweepConfig:
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} must be a YAML mapping with at least name and kind; see README: `mhf sweep`"
        )
    try:
        spec = SweepConfig.model_validate(raw)
    except ValidationError as err:
        where, message = first_problem(err)
        where = where or "sweep"
        if err.errors()[0]["type"] == "missing":
            message = f"missing; add `{where.rsplit('.', 1)[-1]}: ...` (README: `mhf sweep`)"
        elif err.errors()[0]["type"] == "extra_forbidden":
            allowed = section_model(err.errors()[0]["loc"][:-1], SweepConfig).model_fields
            message = f"unknown key; allowed: {', '.join(allowed)}"
            if where in TopologyConfig.model_fields:  # a sweep file older than the config's `topology:`
                message += f"; the run topology is set per trial: `set: {{topology.{where}: ...}}`"
        elif err.errors()[0]["type"] != "value_error":  # pydantic's own words: what came, where to look
            message += f"{refused_value(err)}; see README: `mhf sweep`"
        raise ConfigError(f"{source}: {where}: {message}") from None
    try:
        trial_configs(spec)  # every trial's config must resolve (unknown keys, bad values, topology)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    names = [trial.name for trial in expand_trials(spec)]
    if (twice := _twice(names)) is not None:
        raise ConfigError(
            f"{source}: trial {twice!r} comes twice (a family, group or grid value given twice, or two that "
            "name the same directory); give each once"
        )
    long = next((name for name in names if len(name) > MAX_NAME), None)
    if long is not None:  # its run's directory and MLflow name; the characters are already made safe
        raise ConfigError(
            f"{source}: trial {long[:40]!r}... is named by {len(long)} characters, over the {MAX_NAME} of a "
            "run name; give the grid shorter values (or a variant a shorter group)"
        )
    return spec


def expand_trials(spec: SweepConfig) -> list[Trial]:
    if spec.kind == "matched":
        variants = family_groups(spec.families)
    elif spec.kind == "seeds":
        variants = [({}, "")]  # one group: named after the family below
    else:
        points = [
            list(zip(spec.grid, values, strict=True)) for values in itertools.product(*spec.grid.values())
        ]
        variants = [(dict(point), ",".join(f"{k}={v}" for k, v in point)) for point in points]
    trials = []
    for overrides, group in variants:
        for seed in spec.seeds:
            trial_overrides = {**_merged(spec.set, overrides), "train.seed": seed}
            family = trial_overrides.get("model.family") or _family(spec.config, trial_overrides)
            group = group or family
            name = re.sub(r"[^A-Za-z0-9._=,-]+", "_", f"{group}-seed{seed}")
            trials.append(Trial(name, group, family, seed, trial_overrides))
    return trials


def _family(config: str, overrides: dict[str, Any]) -> str:
    """The trial's model family: its config's with its overrides (which may be what makes the config
    valid); a trial config that does not resolve is `trial_configs`' to report, naming the trial (unless
    its config does not resolve alone either: then the overrides' mistake is reported here)."""
    try:
        return load_config(config, overrides).model.family
    except ConfigError as err:
        with_overrides = err
    try:
        return load_config(config).model.family
    except ConfigError:
        raise with_overrides from None


def family_groups(families: list[str | FamilyVariant]) -> list[tuple[dict[str, Any], str]]:
    """A matched sweep's (overrides, group) per entry: a family is its own group."""
    return [
        ({**entry.set, "model.family": entry.family}, entry.group)
        if isinstance(entry, FamilyVariant)
        else ({"model.family": entry}, entry)
        for entry in families
    ]


def trial_configs(spec: SweepConfig) -> dict[str, Config]:
    """Every trial's validated config; a trial that cannot train (its batch over its workers, say) is
    an error naming it."""
    configs = {}
    for trial in expand_trials(spec):
        try:
            configs[trial.name] = cfg = load_config(spec.config, trial.overrides)
            check_topology(cfg)
        except ConfigError as err:
            raise ConfigError(f"trial {trial.name}: {err}") from None
    return configs
