"""The command line's contract, over every sub-command: a mistake is one `error:` line and exit 2, before
any work, nothing deleted or half written.

The rows are built from the parser itself: every argument that takes a value is fed a bad value of its
kind (`mhf_dist.arguments`), one argument of each kind all of that kind's bad values (`EXAMPLES`); every
required one is left out, every choice is missed. An argument declared without a kind, or a kind without
examples, fails `test_every_argument_takes_a_kind`, a sub-command without a row in `VALID` fails
`test_every_sub_command_has_a_valid_row`: new commands and flags join the table or the test fails. The
file rows hand damaged, empty and non-UTF-8 files to every argument that reads one, and run the real
command.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhf_dist import arguments as kinds
from mhf_dist import cli
from mhf_dist.config import Config, load_config
from mhf_dist.data.corpus import builtin_documents
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.export import export_model
from mhf_dist.models import build_model
from mhf_dist.signatures import SignatureTable

REPO = Path(__file__).resolve().parents[1]
SECONDS = 20  # a refused input is refused at once: well inside this, on this 2-core machine
NON_UTF8 = b"good start \xff\xfe then more\n"

# One argument list per sub-command that parses; the bad-value rows change one argument of it.
VALID = {
    "demo": ["demo", "--workdir", "{new}"],
    "sweep": ["sweep", "--config", "{sweep}"],
    "compare": ["compare", "--storage", "{new}"],
    "prepare": ["prepare", "--out", "{new}"],
    "verify-data": ["verify-data", "{dir}"],
    "train": ["train"],
    "cpt": ["cpt", "--from", "{model}", "--data", "builtin"],
    "eval": ["eval", "--model", "{model}", "--task", "ppl", "--data", "{text}"],
    "import-hf": ["import-hf", "{dir}", "--out", "{new}"],
    "export-hf": ["export-hf", "{model}", "--out", "{new}"],
    "generate": ["generate", "--model", "{model}", "--prompt", "hello"],
    "config": ["config"],
    "count": ["count"],
    "plan": ["plan", "--gpus", "8", "--gpu-mem-gb", "80"],
    "submit": ["submit", "{spec}"],
    "cluster": ["cluster", "start"],
}
TOO_LONG = "/tmp/" + "n" * 300  # a path component over every common filesystem's 255 bytes
NO_HOME = "~no-such-user-of-mhf/x"  # `~user` of no account: Path.expanduser raises
URIS = ["s3://bucket/x"]  # checked by the command that opens them
# a slash lost; another machine's file; a space before (a local folder ` s3:`)
MISTYPED_URIS = ["s3:/bucket/x", "file://host/x", " s3://bucket/x"]
# (bad, good) texts of each kind ("{...}": a path of `ws`), the most telling bad one first: one a laxer
# kind would take. A number kind (`kinds.number`) brings its own, from its bounds.
EXAMPLES = {
    kinds.TEXT: (["   ", ""], ["x", "héllo wörld"]),
    kinds.NAME_OR_PATH: ([""], ["tiny", "my-run"]),
    kinds.RUN_NAME: (["a/b", "../up", "has space", ".hidden", ""], ["pretrain-7", "lr=0.003-seed0"]),
    kinds.SUBMISSION_ID: (["a/b", "has space", "-x", "../up", ""], ["pretrain-7", "run_2026.12"]),
    kinds.VARIABLE: (["MHF_STORAGE", "=5", "A B=x", "1A=x", ""], ["MHF_STORAGE=/x", "A="]),
    kinds.ASSIGNMENT: (["steps", "=5", " =5", ""], ["train.steps=5", "data.corpus=a=b"]),
    kinds.SIZE: (["5XB", "0", "-5", ""], ["500MB", "1000"]),
    kinds.JOBS_API: (
        ["127.0.0.1:8265", "http://", "http://h:99999", "http://h:0", "ftp://h:1"],
        ["http://127.0.0.1:8265", "https://ray.example.com", "ray://head:10001", "auto"],
    ),
    kinds.CORPUS: (
        [
            "{missing}",
            "",
            "hf:",
            "hf: x",
            "hf:a b",
            "hf:a/b/c",
            "dataset:",
            "dataset:module",
            "dataset:a b:f",
            NO_HOME,
        ],
        [
            "builtin",
            "recall",
            "hf:wikitext",
            "hf:Salesforce/wikitext",
            "dataset:corpora.wiki:load",
            "s3://bucket/*.jsonl.gz",
            "texts/*.jsonl",
            "{text}",
            "{dir}",
        ],
    ),
    kinds.FILE: (
        ["{missing}", "{dir}", "/dev/null", "", TOO_LONG, NO_HOME, *MISTYPED_URIS],
        ["{text}", "file://{text}", *URIS],
    ),
    kinds.DIRECTORY: (
        ["{missing}", "{text}", "/dev/null", "", TOO_LONG, NO_HOME, *MISTYPED_URIS],
        ["{dir}", "file://{dir}", *URIS],
    ),
    kinds.FILE_OR_DIRECTORY: (
        ["{missing}", "", TOO_LONG, NO_HOME, *MISTYPED_URIS],
        ["{dir}", "{text}", *URIS],
    ),
    kinds.OUTPUT_DIRECTORY: (
        ["{text}", "{text}/below", "/proc/x/out", "", TOO_LONG, NO_HOME, *MISTYPED_URIS],
        ["{new}", "{dir}", "{new}/deeper", "file://{new}", *URIS],
    ),
    kinds.PLACE: (
        ["{text}", "{text}/below", "", TOO_LONG, NO_HOME, *MISTYPED_URIS],
        ["{new}", "{dir}", *URIS],
    ),
    kinds.LOCAL_PLACE: (
        ["{text}", "{text}/below", "", TOO_LONG, NO_HOME, *MISTYPED_URIS, *URIS],
        ["{new}", "{dir}", "file://{new}"],
    ),
}
PARSER = cli.build_parser()


def examples(kind: kinds.Kind) -> tuple[list[str], list[str]]:
    """(bad, good) texts of `kind`; every kind refuses text that is not UTF-8."""
    bad, good = EXAMPLES.get(kind, (kind.bad, kind.good))
    return [*bad, "\udcff\udcfe"], list(good)


def arguments() -> list[tuple[str, argparse.Action]]:
    """(sub-command, argument) for every argument of every sub-command that takes a value."""
    return [
        (command, action)
        for command, sub in PARSER.commands.items()
        for action in sub._actions
        if action.nargs != 0 and not isinstance(action, argparse._HelpAction)
    ]


def _name(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def value_rows(which: int) -> list[tuple[str, str, str]]:
    """(sub-command, argument, text): the first `examples` text (`which`: 0 bad, 1 good) of its kind for
    every argument, all of them for the first argument of each kind; a choice missed, or every choice."""
    rows, seen = [], set()
    for command, action in arguments():
        if action.choices is not None:
            texts = [["nope"], list(action.choices)][which]
        elif isinstance(action.type, kinds.Kind):
            texts = examples(action.type)[which][: 1 if action.type in seen else None]
            seen.add(action.type)
        else:
            continue  # test_every_argument_takes_a_kind fails for it
        rows += [(command, _name(action), text) for text in texts]
    return rows


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict[str, str]:
    """What the rows name: a file, a directory, a small exported model, a sweep file, a job spec."""
    root = tmp_path_factory.mktemp("contract")
    (root / "dir").mkdir()
    (root / "text.txt").write_text("some text\n")
    tokenizer = TextTokenizer.train_bpe(builtin_documents()[:20], 300)
    tokenizer.save(root / "tokenizer.json")
    cfg = load_config("tiny", ["model.vocab_size=300", "model.hash.spec=H2B64"])
    table = SignatureTable.build(tokenizer.vocabulary(), 2, 64)
    torch.manual_seed(0)
    export_model(build_model(cfg.model, table), cfg.model, table, root / "tokenizer.json", root / "model")
    (root / "sweep.yaml").write_text((REPO / "jobs" / "matched.sweep.yaml").read_text())
    return {
        "root": str(root),
        "dir": str(root / "dir"),
        "text": str(root / "text.txt"),
        "model": str(root / "model"),
        "sweep": str(root / "sweep.yaml"),
        "spec": str(REPO / "jobs" / "pretrain.job.yaml"),
        "new": str(root / "new-output"),
        "missing": str(root / "missing"),
    }


def filled(argv: list[str], ws: dict[str, str]) -> list[str]:
    return [text.format(**ws) for text in argv]


@pytest.fixture
def nothing_runs(monkeypatch):
    """Every command's body replaced by a recorder: the rows below test parsing, and a kind that let a
    bad value through must not start a cluster or a demo."""
    ran = []
    for name in dir(cli):
        if name.startswith("cmd_"):
            monkeypatch.setattr(cli, name, lambda args, name=name: ran.append(name))
    return ran


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def refused(argv: list[str], capsys) -> str:
    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < SECONDS
    return one_error_line(capsys)


def test_every_argument_takes_a_kind():
    untyped = [
        f"mhf {command} {_name(action)}"
        for command, action in arguments()
        if action.choices is None and not isinstance(action.type, kinds.Kind)
    ]
    assert not untyped, f"declare these with a kind from mhf_dist.arguments: {untyped}"
    typed = {action.type for _, action in arguments() if isinstance(action.type, kinds.Kind)}
    undescribed = [kind.takes for kind in typed if not all(EXAMPLES.get(kind, (kind.bad, kind.good)))]
    assert not undescribed, f"give these kinds bad and good texts in EXAMPLES: {undescribed}"


def test_every_sub_command_has_a_valid_row(ws, nothing_runs):
    assert set(VALID) == set(PARSER.commands)
    for command, argv in VALID.items():
        assert cli.main(filled(argv, ws)) == 0
        assert nothing_runs[-1] == "cmd_" + command.replace("-", "_")


@pytest.mark.parametrize(("command", "argument", "text"), value_rows(0))
def test_a_bad_value_is_one_line_before_any_work(command, argument, text, ws, nothing_runs, capsys):
    line = refused(with_argument(filled(VALID[command], ws), argument, text.format(**ws)), capsys)
    assert line.startswith(f"error: mhf {command}: argument {argument}"), line
    assert not nothing_runs
    assert not Path(ws["new"]).exists()


@pytest.mark.parametrize(("command", "argument", "text"), value_rows(1))
def test_a_good_value_is_taken(command, argument, text, ws, nothing_runs):
    """What each kind promises to take (bucket URIs, corpus names, globs, file:// paths, new outputs
    under existing directories) parses, and the command runs."""
    argv = with_argument(filled(VALID[command], ws), argument, text.format(**ws))
    assert cli.main(argv) == 0
    assert nothing_runs == ["cmd_" + command.replace("-", "_")]


def test_a_folder_named_like_a_built_in_corpus_is_read_as_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("recall", "builtin"):
        (tmp_path / name).mkdir()
        assert (kinds.CORPUS(f"./{name}"), kinds.CORPUS(f"{name}/"), kinds.CORPUS(name)) == (
            f"./{name}",
        ) * 2 + (name,)


def test_a_corpus_flag_refuses_an_hf_name_in_the_configs_words(capsys):
    """The hub's rule for a dataset name, worded as `data.corpus` words it, not the kind's list of forms."""
    for name in ("hf: wikitext", "hf:a b", "hf:a/b/c"):
        assert cli.main(["prepare", "--corpus", name]) == 2
        assert f"argument --corpus: {name!r} names no dataset; write hf:NAME or hf:OWNER/NAME" in (
            one_error_line(capsys)
        )


def test_a_device_is_neither_a_file_nor_a_directory_to_a_path_argument(tmp_path):
    for kind, wrong in ((kinds.FILE, tmp_path), (kinds.DIRECTORY, __file__)):
        with pytest.raises(argparse.ArgumentTypeError, match=r"is (a directory|a file); give a"):
            kind(str(wrong))
        with pytest.raises(argparse.ArgumentTypeError, match=r"'/dev/null' is not a (file|directory); "):
            kind("/dev/null")


def with_argument(argv: list[str], argument: str, text: str) -> list[str]:
    """`argv` with `argument` (a flag, or the one positional) given `text`."""
    if not argument.startswith("-"):
        return [argv[0], text, *argv[2:]]  # each sub-command has at most one positional, right after its name
    if argument in argv:
        at = argv.index(argument)
        argv = argv[:at] + argv[at + 2 :]
    return [*argv, argument, text]


@pytest.mark.parametrize(
    ("command", "argument"),
    [(command, _name(action)) for command, action in arguments() if action.required],
)
def test_a_missing_required_argument_is_one_line(command, argument, ws, nothing_runs, capsys):
    argv = filled(VALID[command], ws)
    if argument.startswith("-"):
        at = argv.index(argument)
        del argv[at : at + 2]
    else:
        del argv[1]
    line = refused(argv, capsys)
    assert "the following arguments are required" in line and argument in line, line
    assert not nothing_runs


@pytest.mark.parametrize(
    ("command", "argument"),
    [(command, _name(action)) for command, action in arguments() if isinstance(action, kinds.Distinct)],
)
def test_a_value_given_twice_where_values_must_differ_is_one_line(
    command, argument, ws, nothing_runs, capsys
):
    action = next(action for name, action in arguments() if name == command and _name(action) == argument)
    good = examples(action.type)[1]
    value = good[0]
    argv = with_argument(filled(VALID[command], ws), argument, value)
    twice = [*argv, value] if action.nargs == "+" else [*argv, argument, value]
    line = refused(twice, capsys)
    repeated = action.identity(action.type(value))  # a key of KEY=VALUE
    assert line.endswith(f"argument {argument}: {repeated} is given twice; give each {action.unit} once; "
                         f"see `mhf {command} --help`"), line  # fmt: skip
    if action.nargs == "+":  # given again, the flag would drop the values it had
        line = refused([*argv, argument, good[-1]], capsys)
        assert line.endswith(f"argument {argument} is given twice; give all its values after one; see `mhf "
                             f"{command} --help`"), line  # fmt: skip
    assert not nothing_runs


@pytest.mark.parametrize("command", sorted(VALID))
def test_an_unknown_flag_is_named_by_its_sub_command(command, ws, nothing_runs, capsys):
    line = refused([*filled(VALID[command], ws), "--no-such-flag"], capsys)
    assert line == f"error: mhf {command}: unrecognized arguments: --no-such-flag; see `mhf {command} --help`"


def tree(root: str | Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (and every directory, empty ones too)."""
    root = Path(root)
    if root.is_file():
        return {"": root.read_bytes()}
    return {
        str(path.relative_to(root)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(root.rglob("*"))
    }


def damaged_files(root: Path) -> dict[str, Path]:
    """A damaged, an empty and a non-UTF-8 file of each kind a user hands in."""
    files = {
        "yaml-damaged": "train: {steps: 5\n",
        "yaml-empty": "",
        "yaml-list": "- just\n- a list\n",
        "json-damaged": '{"format": "mhf-export", "con',
        "jsonl-damaged": '{"text": "fine"}\n{"text": broken\n',
        "empty": "",
        "tokens-empty": "",
    }
    paths = {}
    for name, content in files.items():
        paths[name] = root / f"{name}.{name.split('-')[0]}"
        paths[name].write_text(content)
    paths["non-utf8"] = root / "non-utf8.txt"
    paths["non-utf8"].write_bytes(NON_UTF8)
    return paths


def model_with(ws: dict[str, str], root: Path, name: str, damage: dict[str, bytes]) -> str:
    """A copy of the exported model with some of its files replaced by `damage`."""
    import shutil

    copy = root / name
    shutil.copytree(ws["model"], copy)
    for file, content in damage.items():
        (copy / file).write_bytes(content)
    return str(copy)


def nan_safetensors(path: Path) -> bytes:
    """The weights file at `path` with every floating-point tensor nan (a diverged run's checkpoint)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save

    with safe_open(path, "pt") as weights:
        metadata = weights.metadata()
    tensors = {
        name: t.fill_(float("nan")) if t.is_floating_point() else t for name, t in load_file(path).items()
    }
    return save(tensors, metadata)


def file_rows(ws: dict[str, str], root: Path) -> list[tuple[str, list[str]]]:
    """(row name, argv): every argument that reads a file, handed one that is damaged, empty or not
    UTF-8, and every store or run looked up that is not there."""
    bad = damaged_files(root)
    model = ws["model"]
    weights = next(Path(model).glob("*.safetensors")).name
    damaged_config = model_with(ws, root, "model-config", {"config.json": b'{"family": "mh'})
    truncated_weights = model_with(ws, root, "model-weights", {weights: b"\x08\x00\x00\x00\x00\x00\x00\x00{"})
    broken_tokenizer = model_with(ws, root, "model-tokenizer", {"tokenizer.json": b'{"model": '})
    config = json.loads((Path(model) / "config.json").read_text())
    config["model"]["family"] = "no-such-family"
    unknown_family = model_with(ws, root, "model-family", {"config.json": json.dumps(config).encode()})
    del config["signature_fingerprint"]
    no_fingerprint = model_with(ws, root, "model-fingerprint", {"config.json": json.dumps(config).encode()})
    nan_weights = model_with(ws, root, "model-nan", {weights: nan_safetensors(Path(model) / weights)})
    lambada = root / "lambada.jsonl"
    lambada.write_text('{"text": "the cat sat on the mat"}\n')
    shards = root / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text('{"format": "mhf-shards", "spl')
    rows = []
    for name in ("yaml-damaged", "yaml-empty", "yaml-list", "non-utf8"):
        for command in ("config", "count", "plan", "prepare", "train", "cpt", "demo"):
            argv = [*VALID[command], "--config", str(bad[name])]
            rows.append((f"{command} --config {name}", [text.format(**ws) for text in argv]))
        rows.append((f"sweep --config {name}", ["sweep", "--config", str(bad[name])]))
        rows.append((f"submit {name}", ["submit", str(bad[name])]))
    for task in ("ppl", "bpb", "lambada", "hellaswag", "card660"):
        for name in ("empty", "non-utf8", "jsonl-damaged"):
            rows.append(
                (f"eval {task} {name}", ["eval", "--model", model, "--task", task, "--data", str(bad[name])])
            )
    for label, broken in (
        ("config", damaged_config),
        ("weights", truncated_weights),
        ("tokenizer", broken_tokenizer),
        ("family", unknown_family),
        ("fingerprint", no_fingerprint),
    ):
        rows.append(
            (f"eval model {label}", ["eval", "--model", broken, "--task", "ppl", "--data", ws["text"]])
        )
        rows.append((f"generate model {label}", ["generate", "--model", broken, "--prompt", "hi"]))
        rows.append((f"export-hf model {label}", ["export-hf", broken, "--out", ws["new"]]))
        rows.append(
            (f"cpt from {label}", ["cpt", "--from", broken, "--data", "builtin", "--add-tokens", ws["text"]])
        )
    for label, extra in (("greedy", []), ("sampling", ["--temperature", "0.8"])):
        rows.append(
            (f"generate nan model {label}", ["generate", "--model", nan_weights, "--prompt", "hi", *extra])
        )
    for task, data in (("ppl", ws["text"]), ("lambada", str(lambada))):
        rows.append(
            (f"eval nan model {task}", ["eval", "--model", nan_weights, "--task", task, "--data", data])
        )
    rows += [
        ("verify-data damaged manifest", ["verify-data", str(shards)]),
        ("verify-data no manifest", ["verify-data", ws["dir"]]),
        ("train damaged manifest", ["train", "--set", f"data.path={shards}"]),
        ("import-hf no config", ["import-hf", ws["dir"], "--out", ws["new"]]),
        (
            "cpt add-tokens empty",
            ["cpt", "--from", model, "--data", "builtin", "--add-tokens", str(bad["empty"])],
        ),
        (
            "cpt add-tokens non-utf8",
            ["cpt", "--from", model, "--data", "builtin", "--add-tokens", str(bad["non-utf8"])],
        ),
        (
            "cpt tokenizer damaged",
            ["cpt", "--from", model, "--data", "builtin", "--tokenizer", str(bad["json-damaged"])],
        ),
        (
            "prepare corpus with a malformed line",
            ["prepare", "--corpus", str(bad["jsonl-damaged"]), "--out", ws["new"]],
        ),
        (
            "prepare tokenizer damaged",
            ["prepare", "--out", ws["new"], "--tokenizer", str(bad["json-damaged"])],
        ),
        ("generate prompt non-utf8", ["generate", "--model", model, "--prompt", "abc\udcff\udcfe"]),
        ("config unknown preset", ["config", "--config", "no-such-preset"]),
        ("config unknown key", ["config", "--set", "train.no_such_key=1"]),
        ("config truth value for a count", ["config", "--set", "topology.workers=true"]),
        ("config nan", ["config", "--set", "train.lr=nan"]),
        ("plan unknown family", ["plan", "--gpus", "8", "--gpu-mem-gb", "80", "--family", "nope"]),
        ("plan nothing fits", ["plan", "--gpus", "1", "--gpu-mem-gb", "0.001"]),
        ("compare no store", ["compare", "--storage", ws["new"]]),
        (
            "eval unknown run",
            [
                "eval",
                "--model",
                model,
                "--task",
                "ppl",
                "--data",
                ws["text"],
                "--run-id",
                "0" * 32,
                "--storage",
                ws["new"],
            ],
        ),
        ("train resume unknown run", ["train", "--resume", "no-such-run", "--storage", ws["new"]]),
        ("prepare overwrite a foreign folder", ["prepare", "--overwrite", "--out", ws["dir"]]),
        ("prepare overwrite a file", ["prepare", "--overwrite", "--out", ws["text"]]),
    ]
    return rows


@pytest.fixture(scope="module")
def rows(ws) -> dict[str, list[str]]:
    root = Path(ws["root"]) / "files"
    root.mkdir()
    (Path(ws["dir"]) / "thesis.txt").write_text("four years of work\n")
    (Path(ws["dir"]) / "chapters").mkdir()
    (Path(ws["dir"]) / "chapters" / "one.txt").write_text("chapter one\n")
    return dict(file_rows(ws, root))


READS = (kinds.FILE, kinds.DIRECTORY, kinds.FILE_OR_DIRECTORY, kinds.NAME_OR_PATH, kinds.CORPUS)
# (sub-command, argument) whose files only a training run opens, after its start-up; they go through
# the readers these rows check (tests/test_cpt.py and test_ray_train.py run them).
OPEN_BY_A_RUN = {("train", "--init-from"), ("cpt", "--corpus"), ("cpt", "--data"), ("cpt", "--replay")}


def test_every_file_reading_argument_has_file_rows(ws, rows):
    """Each argument that reads a file or directory is handed a damaged one by a row of `file_rows`."""
    covered = {(argv[0], arg) for argv in rows.values() for arg in argv[1:] if arg.startswith("-")}
    covered |= {(argv[0], _name(action)) for argv in rows.values() for action in positionals(argv[0])}
    missing = [
        f"mhf {command} {_name(action)}"
        for command, action in arguments()
        if action.type in READS and (command, _name(action)) not in covered | OPEN_BY_A_RUN
    ]
    assert not missing, f"add rows to file_rows for: {missing}"


def positionals(command: str) -> list[argparse.Action]:
    return [action for action in PARSER.commands[command]._actions if not action.option_strings]


def test_a_damaged_file_is_one_line(ws, rows, capfd):
    """Every file row, run for real: exit 2, one `error:` line naming the file, nothing changed."""
    before = tree(ws["root"])
    failures = []
    for name, argv in rows.items():
        start = time.monotonic()
        try:
            status = cli.main(argv)
        except Exception as raw:  # what the console shows as a traceback
            status = f"raised {type(raw).__name__}: {str(raw)[:200]}"
        took = time.monotonic() - start
        err = capfd.readouterr().err
        lines = [line for line in err.strip().splitlines() if not line.startswith("Ray's logs")]
        if status != 2 or "Traceback" in err or len(lines) != 1 or not lines[0].startswith("error: "):
            failures.append(f"{name}: exit {status}, stderr {err.strip()[-300:]!r}")
        elif took > SECONDS:
            failures.append(f"{name}: took {took:.0f} s")
    assert not failures, "\n".join(failures)
    assert not Path(ws["new"]).exists()
    assert tree(ws["root"]) == before


CONFIG_KEYS = sorted(
    f"{section}.{key}"
    for section, model in Config.model_fields.items()
    if isinstance(model.annotation, type) and hasattr(model.annotation, "model_fields")
    for key in model.annotation.model_fields
)
VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "no", "null", "[1, 2]", "{a: 1}", "010", "1:30", "", "H2B64", "nan", "-0"]),
    st.text(max_size=12),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(CONFIG_KEYS), value=VALUES)
def test_any_set_override_is_a_config_or_one_line(key, value, capsys):
    """`mhf config --set KEY=VALUE` for any key and value: the config, or one `error:` line."""
    status = cli.main(["config", "--set", f"{key}={value}"])
    if status == 0:
        assert capsys.readouterr().out.startswith("preset: ")
    else:
        assert status == 2
        one_error_line(capsys)


PLAN_NUMBERS = [
    "--gpus",
    "--gpu-mem-gb",
    "--nodes",
    "--seq-len",
    "--micro-batch",
    "--vocab",
    "--tokens",
    "--mfu",
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flag=st.sampled_from(PLAN_NUMBERS),
    value=st.one_of(st.integers(-5, 2**40).map(str), st.floats().map(repr), st.text(max_size=6)),
)
def test_any_number_for_plan_is_a_plan_or_one_line(flag, value, capsys):
    argv = ["plan", "--config", "100m", "--gpus", "8", "--gpu-mem-gb", "80"]
    if flag in argv:
        at = argv.index(flag)
        del argv[at : at + 2]
    status = cli.main([*argv, flag, value])
    out = capsys.readouterr().out if status == 0 else ""
    if status == 0:
        assert "nan" not in out and "inf" not in out
    else:
        assert status == 2
        one_error_line(capsys)


STARTING = (0.0, 0.5, 1.2)  # seconds after mhf's code runs: the CLI's imports, parsing, first work


def catching(process: subprocess.Popen, sig: int) -> None:
    """Wait until `process` handles `sig` itself (its SigCgt mask): mhf's first code has run. Before
    that, in the interpreter's own start, a signal has Python's default effect (README: Known limits)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        status = Path(f"/proc/{process.pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (sig - 1) & 1:
            return
        time.sleep(0.005)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_while_starting_is_one_line(sig, ws):
    """Every sub-command (and mhf-lm-eval), signalled at three moments of its start: exit 128+sig with
    one `interrupted:` line last, or done before the signal came (exit 0, or 2 for a refusal such as
    submit's absent cluster); never a traceback, a crash or a signal's bare death."""
    scripts = Path(sys.executable).parent
    runs = [[str(scripts / "mhf"), *filled(argv, ws)] for argv in VALID.values()]
    runs.append([str(scripts / "mhf-lm-eval"), "--model", "mhf", "--model_args", f"path={ws['model']}"])
    failures = []
    for batch_start in range(0, len(runs) * len(STARTING), 6):
        batch = [(argv, delay) for argv in runs for delay in STARTING][batch_start : batch_start + 6]
        started = [
            (
                argv,
                delay,
                subprocess.Popen(
                    argv, cwd=ws["root"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
                ),
            )
            for argv, delay in batch
        ]
        for _, _, process in started:
            catching(process, signal.SIGTERM)  # SIGINT is Python's own from the start
        begin = time.monotonic()
        for _, delay, process in sorted(started, key=lambda item: item[1]):
            time.sleep(max(0.0, begin + delay - time.monotonic()))
            process.send_signal(sig)
        for argv, delay, process in started:
            err = process.communicate(timeout=120)[1]
            last = (err.strip().splitlines() or [""])[-1]
            interrupted = process.returncode == 128 + sig and last.startswith("interrupted: ")
            finished = process.returncode in (0, 2) and "Traceback" not in err
            if not (interrupted or finished) or "Traceback" in err:
                failures.append(
                    f"{Path(argv[0]).name} {argv[1]} at {delay} s: exit {process.returncode}, {err[-300:]!r}"
                )
    assert not failures, "\n".join(failures)
