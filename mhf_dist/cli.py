"""The `mhf` command: parses arguments, loads the config, calls the library.

`mhf <command>` runs `cmd_<command>` (`-` written `_`), whose docstring is its help and whose `@command`
declares its arguments. A flag that sets a config key (`--workers`: `topology.workers`) has the key as its
dest, defaults to None (the config's value holds) and wins over a `--set` of the key. Every user mistake
is one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mhf_dist import arguments as kinds
from mhf_dist import errors, interrupts
from mhf_dist.arguments import MhfParser
from mhf_dist.config import (
    INIT_NEW_ROWS,
    Config,
    TopologyConfig,
    load_config,
    parse_overrides,
)
from mhf_dist.console import quiet_driver
from mhf_dist.errors import ConfigError, Interrupted, MhfError, TrainingError
from mhf_dist.eval import LAYER as EVAL_LAYER
from mhf_dist.eval import TASKS as EVAL_TASKS
from mhf_dist.eval import WINDOW as EVAL_WINDOW
from mhf_dist.eval import WINDOWED as EVAL_WINDOWED
from mhf_dist.ray_utils import logs_hint
from mhf_dist.readers import dump_yaml
from mhf_dist.storage import Location, redact
from mhf_dist.submit import DEFAULT_ADDRESS
from mhf_dist.tables import markdown_table

if TYPE_CHECKING:
    from mhf_dist.data.tokenizer import TextTokenizer
    from mhf_dist.train.ray_trainer import TrainOptions, TrainResult

Argument = tuple[str, dict[str, Any]]
# name -> (its function's name, add_parser's options, the arguments), in this file's order (`mhf --help`'s)
COMMANDS: dict[str, tuple[str, dict[str, Any], tuple[Argument, ...]]] = {}
EXPORTED_MODEL = "an exported model directory (a checkpoint's model/): path or URI"
MLFLOW_STORAGE = "where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set"
QWEN3_VOCAB = 151_936  # Qwen3's own tokenizer: `mhf plan`'s second vocabulary by default


def command(*arguments: Argument, **options: Any) -> Callable[[Callable], Callable]:
    """Declare `cmd_<command>` below as `mhf <command>` with `arguments` (and add_parser's `options`)."""

    def declare(run: Callable) -> Callable:
        name = run.__name__.removeprefix("cmd_").replace("_", "-")
        COMMANDS[name] = (run.__name__, {"help": run.__doc__, **options}, arguments)
        return run

    return declare


def arg(name: str, kind: kinds.Kind | None = None, help: str | None = None, **options: Any) -> Argument:
    """`add_argument(name, type=kind, help=help, **options)`: all but a choice or a `switch` have a kind."""
    if kind is not None:
        options["type"] = kind
    return name, {"help": help, **options}


def switch(name: str, help: str, **options: Any) -> Argument:
    """A flag without a value: True if given."""
    return arg(name, help=help, action="store_true", **options)


def with_default(name: str, kind: kinds.Kind, help: str, default: Any, **options: Any) -> Argument:
    """An argument whose help ends by naming its default."""
    return arg(name, kind, f"{help} (default: {default})", default=default, **options)


def key_flag(flag: str, key: str, kind: kinds.Kind, help: str, **options: Any) -> Argument:
    """A flag that sets the config key `key` (see the module's docstring)."""
    default = "" if options.get("required") else "; default: the config's"
    metavar = key.rsplit(".", 1)[-1].upper()
    return arg(flag, kind, f"{help} (sets {key}{default})", dest=key, metavar=metavar, **options)


def set_arg(help: str) -> Argument:
    return arg(
        "--set",
        kinds.ASSIGNMENT,
        f"{help} (repeatable; the last of one key wins, and a flag that sets the same key wins)",
        action="append",  # the last of one key wins: a job spec's entrypoint is overridden after `--`
        dest="overrides",
        default=[],
        metavar="KEY=VALUE",
    )


def config_args(default: str = "tiny") -> tuple[Argument, ...]:
    return (
        with_default("--config", kinds.NAME_OR_PATH, "preset name or YAML file", default),
        set_arg("override one config key, e.g. --set train.steps=50"),
    )


# `--workers`, `--gpus-per-worker`, `--zero-stage`, `--storage`: flags of the config's `topology:` keys
# (the numbers' bounds are their config fields')
TOPOLOGY_FLAGS = {
    name: key_flag(
        f"--{name.replace('_', '-')}",
        f"topology.{name}",
        kind if isinstance(kind, kinds.Kind) else kinds.bounded_as(TopologyConfig.model_fields[name], kind),
        TopologyConfig.model_fields[name].description,
    )
    for name, kind in {
        "workers": kinds.COUNT.takes,
        "gpus_per_worker": kinds.NATURAL.takes,
        "zero_stage": "use a ZeRO stage: 0, 1, 2 or 3",
        "storage": kinds.OUTPUT_DIRECTORY,
    }.items()
}
VERBOSE = switch(
    "--verbose",
    "also show what Ray, its workers, Ray Train, Tune, DeepSpeed and MLflow print (by default only in "
    "Ray's session logs)",
)
PREPARE = switch("--prepare", "first prepare data.path from data.corpus unless it holds shards (for jobs)")


def run_options(name: str) -> tuple[Argument, ...]:
    """What `mhf train` and `mhf cpt` share: the run's topology, name and tracking."""
    return (
        *TOPOLOGY_FLAGS.values(),
        with_default("--name", kinds.RUN_NAME, "run name under the storage path", name),
        switch(
            "--continue",
            "continue the run --name from its newest checkpoint, logging to the same MLflow run",
            dest="continue_run",
        ),
        with_default("--experiment", kinds.TEXT, "MLflow experiment", "mhf"),
        arg("--max-failures", kinds.RETRIES, "worker-group restarts from the last checkpoint", default=0),
        arg(
            "--peak-tflops",
            kinds.NON_NEGATIVE,
            "peak TFLOP/s per worker for the MFU estimate (default: bf16 peak of known GPUs)",
            default=0.0,
        ),
        VERBOSE,
    )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """A command line's config overrides: its `--set`s, then the flags given that set config keys."""
    flags = {dest: value for dest, value in vars(args).items() if "." in dest and value is not None}
    return {**parse_overrides(args.overrides), **flags}


def _refuse_overrides(args: argparse.Namespace, section: str, why: str) -> None:
    """A `--set` (or flag) of a key in `section` that the command could only ignore is refused."""
    if keys := [key for key in config_overrides(args) if key.split(".")[0] == section]:
        raise ConfigError(f"--set {keys[0]}: {why}; drop it")


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, config_overrides(args))


def _config_name(source: str, cfg: Config) -> str:
    """How `count` and `plan` name the config: `preset 1b`, or a file and the preset it starts from."""
    if source == cfg.preset:
        return f"preset {source}"
    return f"config {redact(source)}" + (f" (preset {cfg.preset})" if cfg.preset else "")


@command(
    *config_args(),
    with_default("--workdir", kinds.OUTPUT_DIRECTORY, "where results are written", "runs/demo"),
    arg(
        "--seeds",
        kinds.SEED,
        "seeds per family (default: 0 1)",
        nargs="+",
        action=kinds.Distinct,
        default=[0, 1],
    ),
    TOPOLOGY_FLAGS["workers"],
    VERBOSE,
)
def cmd_demo(args: argparse.Namespace) -> None:
    """train mhf and Qwen3 baselines small on the built-in corpus"""
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.demo import run_demo

    run_demo(args.config, config_overrides(args), Path(args.workdir), seeds=args.seeds, verbose=args.verbose)


@command(
    arg("--config", kinds.FILE, "the sweep YAML file (see README: `mhf sweep`)", required=True),
    switch("--resume", "finish an interrupted sweep; keeps finished trials"),
    set_arg("a config override for every trial, on top of the file's set:"),
    arg(
        "--storage",
        kinds.OUTPUT_DIRECTORY,
        "where the sweep, its trials and MLflow live (default: the file's)",
    ),
    PREPARE,
    VERBOSE,
)
def cmd_sweep(args: argparse.Namespace) -> None:
    """matched-baseline, seed or grid sweeps on Ray Tune"""
    from mhf_dist.sweep.runner import check_before_data, compare_sweep, run_sweep
    from mhf_dist.sweep.spec import load_sweep, trial_configs
    from mhf_dist.tracking import browse_hint

    spec = load_sweep(args.config, args.storage, config_overrides(args))
    if args.prepare:
        from mhf_dist.data.prepare import prepare_if_missing

        configs = trial_configs(spec)
        check_before_data(spec, configs)  # run_sweep checks it too; here before minutes of preparing
        for cfg in {cfg.data.path: cfg for cfg in configs.values()}.values():
            prepare_if_missing(cfg, verbose=args.verbose)
    result = run_sweep(spec, resume=args.resume, verbose=args.verbose)
    comparison = compare_sweep(spec, result)
    print(comparison.report)
    print(f"tables and plots: {result.directory / 'compare'}; MLflow parent run {result.parent_run_id}")
    print(f"MLflow UI: {browse_hint(result.tracking_uri, spec.experiment)}")


@command(
    with_default("--experiment", kinds.TEXT, "MLflow experiment", "mhf-sweeps"),
    arg("--sweep", kinds.TEXT, "a sweep's parent run id: only its trials, results logged to it"),
    with_default("--metric", kinds.TEXT, "the metric compared", "val_nll"),
    arg(
        "--group-by",
        kinds.TEXT,
        "group by this MLflow param or tag, e.g. topology.zero_stage or model.family (repeatable; "
        "default: the sweep's group tag, else the family)",
        action=kinds.Distinct,
        metavar="KEY",
    ),
    arg("--storage", kinds.PLACE, MLFLOW_STORAGE, default="runs/sweeps"),
    arg(
        "--out",
        kinds.OUTPUT_DIRECTORY,
        "output directory or bucket URI (default: <storage>/compare/<sweep or experiment>)",
    ),
    arg("--unstable-cv", kinds.POSITIVE, "coefficient of variation flagged unstable", default=0.05),
)
def cmd_compare(args: argparse.Namespace) -> None:
    """compare runs across seeds from MLflow: table, CSV, plots"""
    from mhf_dist.compare import COMPARE_DIR, compare_runs
    from mhf_dist.tracking import browse_hint, reading_uri

    uri = reading_uri(args.storage)  # an absent embedded store is an error, not created
    out = args.out or Location.of(args.storage) / COMPARE_DIR / (args.sweep or args.experiment)
    comparison = compare_runs(
        uri, args.experiment, out, args.metric, args.sweep, args.unstable_cv, args.group_by or ()
    )
    print(comparison.report)
    print(f"written: {', '.join(str(path) for path in comparison.files)}")
    print(f"MLflow UI: {browse_hint(uri, args.experiment)}")


@command(
    *config_args(),
    key_flag(
        "--corpus",
        "data.corpus",
        kinds.CORPUS,
        "builtin | hf:NAME | dataset:package.module:function (returning a ray.data.Dataset) | a file, "
        "directory or glob, local or s3:// / gs://, of .txt/.raw/.jsonl/.json (optionally .gz/.zst/.bz2), "
        ".parquet or .arrow (optionally .zst)",
    ),
    key_flag(
        "--tokenizer",
        "data.tokenizer",
        kinds.NAME_OR_PATH,
        "bpe | bytes | mistral-v0.3 | a tokenizer.json: path or s3:// / gs:// URI",
    ),
    key_flag("--out", "data.path", kinds.OUTPUT_DIRECTORY, "output directory, local or s3:// / gs://"),
    switch(
        "--overwrite",
        "replace shards an earlier prepare wrote there (a folder holding anything else is refused)",
    ),
    arg("--num-cpus", kinds.COUNT, "CPUs of a local Ray instance (default: all)"),
    VERBOSE,
)
def cmd_prepare(args: argparse.Namespace) -> None:
    """tokenize, pack and sign a corpus into parquet shards on Ray (resumable)"""
    from mhf_dist.data import recall
    from mhf_dist.data.prepare import prepare

    cfg = _config(args)
    generated = cfg.data.corpus == recall.CORPUS  # its rows are made again, in seconds
    kept = "" if generated else ": it goes on from the parts and shards already written"
    with errors.advising(f"rerun the same command{kept}"):
        prepare(cfg, cfg.data.path, overwrite=args.overwrite, num_cpus=args.num_cpus, verbose=args.verbose)


@command(
    arg("path", kinds.DIRECTORY, "a prepared shard directory, local or s3:// / gs:// (mhf prepare --out)"),
)
def cmd_verify_data(args: argparse.Namespace) -> None:
    """check every prepared shard against its manifest's sha256 (reads all the data)"""
    from mhf_dist.data.shards import verify_shards

    count = verify_shards(args.path)
    print(
        f"{count} shards, tokenizer.json and the signature table in {redact(args.path)} match their manifest"
    )


def _train_options(args: argparse.Namespace, cfg: Config) -> TrainOptions:
    """The run's options, checked before any preparing: --continue needs a checkpoint to go on from."""
    from mhf_dist.train.checkpoints import newest_checkpoint
    from mhf_dist.train.ray_trainer import TrainOptions

    storage = Location.of(cfg.topology.storage)
    if args.continue_run and newest_checkpoint(storage / args.name) is None:  # (a sweep's trials: either)
        raise TrainingError(
            f"--continue: run {args.name!r} has no checkpoint in {storage} to go on from; leave --continue "
            "out to start it"
        )
    given = {field.name for field in dataclasses.fields(TrainOptions)} & set(vars(args))
    return TrainOptions(**{name: getattr(args, name) for name in given})


def _print_result(result: TrainResult, experiment: str) -> None:
    from mhf_dist.tracking import browse_hint
    from mhf_dist.train.checkpoints import MODEL_DIR, read_history

    last = read_history(result.checkpoint)[-1:]
    columns = ["step", "loss", "val_nll", "val_ppl", "tokens_per_s", "peak_mem_gb"]
    print(markdown_table(last, [column for column in columns if column in last[0]]))
    print(f"last checkpoint: {result.checkpoint} (exported model: {result.checkpoint / MODEL_DIR})")
    print(f"MLflow run {result.run_id} at {redact(result.tracking_uri)}")
    print(f"MLflow UI: {browse_hint(result.tracking_uri, experiment)}")


@command(
    *config_args(),
    *run_options(name="mhf-train"),
    arg(
        "--resume",
        kinds.NAME_OR_PATH,
        "continue exactly from a checkpoint directory, or from a run name's newest",
    ),
    arg("--stop-at-step", kinds.COUNT, "end this run at this step, with a checkpoint"),
    arg(
        "--init-from", kinds.FILE_OR_DIRECTORY, "an exported model directory to start from (fresh optimizer)"
    ),
    PREPARE,
)
def cmd_train(args: argparse.Namespace) -> None:
    """train on prepared shards with Ray Train + DeepSpeed ZeRO"""
    cfg = _config(args)
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.data.prepare import prepare_if_missing
        from mhf_dist.train.ray_trainer import check_run, train

    options = _train_options(args, cfg)  # refused before preparing
    if args.prepare:
        check_run(cfg, options)  # train() checks it too; here before minutes of preparing
        prepare_if_missing(cfg, verbose=args.verbose)
    result = train(cfg, options)
    _print_result(result, args.experiment)


@command(
    *config_args(),
    arg(
        "--from",
        kinds.NAME_OR_PATH,  # a path on the cluster that runs it (jobs/cpt.job.yaml); checked there
        "exported model, checkpoint or run directory",
        dest="parent",
        required=True,
    ),
    arg("--tokenizer", kinds.FILE, "a tokenizer.json that appends tokens to the parent's"),
    arg("--add-tokens", kinds.FILE, "a file with one new token per line"),
    arg("--train-new-tokens", kinds.COUNT, "learn N new BPE tokens from --corpus"),
    arg("--corpus", kinds.CORPUS, "text the new tokens are learned from (a file, directory or glob)"),
    key_flag("--data", "data.corpus", kinds.CORPUS, "the corpus training continues on", required=True),
    arg(
        "--init-new-rows",
        help="a baseline's new embedding/head rows: subword, the mean of the token's old pieces' rows "
        "(the authors'), or mean, of all old rows (mhf adds no rows; default: subword)",
        choices=INIT_NEW_ROWS,
        default="subword",
    ),
    key_flag("--replay", "data.replay.corpus", kinds.CORPUS, "a corpus to replay (e.g. the parent's)"),
    key_flag(
        "--replay-fraction", "data.replay.fraction", kinds.SHARE, "share of the training tokens from --replay"
    ),
    *run_options(name="mhf-cpt"),
)
def cmd_cpt(args: argparse.Namespace) -> None:
    """continued pretraining with an expanded vocabulary (mhf: zero new parameters)"""
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.cpt import check_expansion, expanded_tokenizer, run_cpt
        from mhf_dist.data.corpus import corpus_texts

    check_expansion(args.tokenizer, args.add_tokens, args.train_new_tokens or 0, args.corpus is not None)
    _refuse_overrides(args, "model", "mhf cpt trains the parent's model as it is")
    cfg = _config(args)

    def new_tokenizer(parent: TextTokenizer) -> TextTokenizer:
        texts = (lambda: corpus_texts(args.corpus, cfg.data.text_field)) if args.corpus else None
        return expanded_tokenizer(parent, args.tokenizer, args.add_tokens, args.train_new_tokens or 0, texts)

    options = _train_options(args, cfg)
    result = run_cpt(
        cfg, args.parent, new_tokenizer, options, init_new_rows=args.init_new_rows, config_source=args.config
    )
    _print_result(result.train_result, args.experiment)


@command(
    arg("--model", kinds.DIRECTORY, EXPORTED_MODEL, required=True),
    arg("--task", required=True, choices=EVAL_TASKS, help=" | ".join(EVAL_TASKS)),
    arg(
        "--data",
        kinds.FILE_OR_DIRECTORY,
        "the task's file, a path or a URI (see README); recall generates its own",
    ),
    arg("--limit", kinds.COUNT, "first N examples only (default: all)", default=0),
    arg("--seq-len", kinds.WINDOW, f"ppl and bpb of a text file: window length (default: {EVAL_WINDOW})"),
    arg("--layer", kinds.INTEGER, f"card660: hidden-state layer (default: {EVAL_LAYER})"),
    with_default(
        "--batch-size", kinds.COUNT, "sequences per forward pass; the results do not depend on it", 16
    ),
    arg("--run-id", kinds.TEXT, "log the results to this MLflow run"),
    arg("--storage", kinds.PLACE, MLFLOW_STORAGE, default="runs/train"),
)
def cmd_eval(args: argparse.Namespace) -> None:
    """evaluate an exported model: ppl, bpb, lambada, hellaswag, card660"""
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.eval.tasks import check_task_data, run_task
        from mhf_dist.export import load_exported
        from mhf_dist.tracking import check_run, log_metrics, reading_uri

    uri = reading_uri(args.storage) if args.run_id else None
    if uri is not None:  # the run is looked up before the scoring whose results it gets
        check_run(uri, args.run_id)
    check_task_data(args.task, args.data is not None)  # before the flags it reads
    windows = args.task in EVAL_WINDOWED and not (args.data and Location.of(args.data).is_dir())
    for flag, given, applies, where in (
        ("--seq-len", args.seq_len, windows, "ppl and bpb of a text file (prepared shards keep their rows)"),
        ("--layer", args.layer, args.task == "card660", "card660"),
    ):
        if given is not None and not applies:
            raise ConfigError(f"{flag} is read by {where} only; drop it for --task {args.task}")
    seq_len = args.seq_len or EVAL_WINDOW
    exported = load_exported(args.model)
    layer = EVAL_LAYER if args.layer is None else args.layer
    results = run_task(exported, args.task, args.data, args.limit, seq_len, layer, batch_size=args.batch_size)
    print(markdown_table([{"task": args.task, **results}], ["task", *results]))
    if windows and "short_window" in results:
        print(f"scored in one window of {results['short_window']} tokens: the text is shorter than {seq_len}")
    elif windows:
        last = f", the last of {results['last_window']}" if "last_window" in results else ""
        print(f"scored in windows of {seq_len} tokens{last}, no context carried across windows")
    if uri is not None:
        log_metrics(uri, args.run_id, {f"eval.{args.task}.{k}": v for k, v in results.items()})
        print(f"logged to MLflow run {args.run_id}")


@command(
    arg(
        "source",
        kinds.DIRECTORY,
        "a Hugging Face checkpoint directory (config.json, safetensors): a path or a URI",
    ),
    arg(
        "--out", kinds.OUTPUT_DIRECTORY, "the exported model directory to create (path or URI)", required=True
    ),
)
def cmd_import_hf(args: argparse.Namespace) -> None:
    """a reference MHF or transformers Qwen3 checkpoint -> an exported mhf-dist model"""
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.hf_layout import import_hf
        from mhf_dist.models import param_count

    exported = import_hf(args.source, args.out)
    cfg = exported.config
    io = f", {cfg.hash.spec} {cfg.hash.io} I/O, loss {cfg.hash.loss}" if cfg.family == "mhf" else ""
    print(
        f"imported {cfg.family} ({param_count(cfg):,} parameters, V={cfg.vocab_size:,}{io}) "
        f"from {redact(args.source)} to {exported.path}"
    )


@command(
    arg("model", kinds.DIRECTORY, EXPORTED_MODEL),
    arg("--out", kinds.OUTPUT_DIRECTORY, "the Hugging Face directory to create (path or URI)", required=True),
    arg(
        "--max-shard-size",
        kinds.SIZE,
        "largest safetensors shard: bytes or a size such as 500MB (default: 5GB, the Hub's convention)",
        default="5GB",
    ),
)
def cmd_export_hf(args: argparse.Namespace) -> None:
    """an exported model -> the reference layout (mhf) or a transformers Qwen3 directory"""
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.hf_layout import export_hf

    print(f"wrote {export_hf(args.model, args.out, args.max_shard_size)}")


@command(
    arg("--model", kinds.DIRECTORY, EXPORTED_MODEL, required=True),
    arg("--prompt", kinds.TEXT, "the text to continue", required=True),
    with_default("--max-new-tokens", kinds.COUNT, "tokens to add", 64),
    arg(
        "--temperature",
        kinds.NON_NEGATIVE,
        "0: greedy (default); --top-k/--top-p/--seed need more",
        default=0.0,
    ),
    arg("--top-k", kinds.NATURAL, "sample from the k likeliest; 0: all", default=0),
    arg("--top-p", kinds.PROBABILITY, "sample from the nucleus of this mass; 1: all", default=1.0),
    arg("--seed", kinds.SEED, "seed for reproducible sampling"),
)
def cmd_generate(args: argparse.Namespace) -> None:
    """stream tokens from an exported model"""
    sampling_only = {"--top-k": args.top_k > 0, "--top-p": args.top_p < 1, "--seed": args.seed is not None}
    if not args.temperature and any(sampling_only.values()):
        given = ", ".join(flag for flag, on in sampling_only.items() if on)
        raise ConfigError(
            f"{given} only apply when sampling and --temperature 0 is greedy; give --temperature above 0 "
            "or leave them out"
        )
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.eval.tasks import check_positions
        from mhf_dist.export import load_exported
        from mhf_dist.models.generation import Sampling, generate

    exported = load_exported(args.model)
    tokenizer = exported.tokenizer
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)  # its bounds: the flags' kinds
    prompt = tokenizer.encode_batch([args.prompt])[0]
    if not prompt:
        raise ConfigError("the prompt is empty; give --prompt some text")
    prompt = tokenizer.context_prefix(exported.document_format) + prompt  # `<s>` first for bos models
    check_positions(  # the last new token is only predicted, never read
        exported,
        len(prompt) + args.max_new_tokens - 1,
        "the prompt and --max-new-tokens read a sequence of length",
        "shorten the prompt or lower --max-new-tokens",
    )
    generated: list[int] = []
    shown = ""
    print(args.prompt, end="", flush=True)
    try:
        for token in generate(
            exported.model, prompt, args.max_new_tokens, sampling, stop_ids=[tokenizer.eos_id]
        ):
            generated.append(token)
            text = tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
            print(text[len(shown) :], end="", flush=True)
            shown = text
    finally:  # the text ends its line, also when an error or interrupt line follows
        print(flush=True)


@command(*config_args())
def cmd_config(args: argparse.Namespace) -> None:
    """print the resolved config as YAML"""
    print(dump_yaml(_config(args).model_dump(mode="json")), end="")


@command(*config_args())
def cmd_count(args: argparse.Namespace) -> None:
    """analytic parameters and FLOPs of every family for a config"""
    with interrupts.importing():
        from mhf_dist.plan import family_counts

    cfg = _config(args)
    crowded = _shared_signatures(cfg, [cfg.model.vocab_size])
    rows, unmatched = family_counts(cfg)
    print(
        f"{_config_name(args.config, cfg)}, V={cfg.model.vocab_size}, {cfg.model.hash.spec}, "
        f"seq_len {cfg.train.seq_len}"
    )
    print(
        markdown_table(rows, ["family", "layers", "mlp", "params", "vs mhf", "vs qwen3", "fwd GFLOP/token"])
    )
    for line in [*unmatched, *crowded]:
        print(line)


def _shared_signatures(cfg: Config, vocab_sizes: list[int]) -> list[str]:
    """A warning per vocabulary whose tokens must share signatures under model.hash (the reference
    scheme's redraw rule gives the rest duplicates); SignatureError where no table of it can be built."""
    from mhf_dist.signatures import scheme_for_config

    scheme = scheme_for_config(cfg.model.hash)
    return [
        f"warning: {short}): {vocab - scheme.capacity:,} tokens at least share another's signature and score "
        "alike; use more hashes or buckets"
        for vocab in vocab_sizes
        if (short := scheme.room_for(vocab)) is not None
    ]


@command(
    *config_args(default="1b"),
    arg(
        "--family",
        kinds.TEXT,
        "mhf | qwen3 | qwen3_matched (repeatable; default: mhf and qwen3)",
        action=kinds.Distinct,
    ),
    arg("--gpus", kinds.COUNT, "GPUs per node", required=True),
    arg("--gpu-mem-gb", kinds.POSITIVE, "memory of one GPU in GiB", required=True),
    with_default("--nodes", kinds.COUNT, "nodes", 1),
    key_flag("--seq-len", "train.seq_len", kinds.WINDOW, "tokens per sequence"),
    key_flag(
        "--micro-batch",
        "train.micro_batch_size",
        kinds.COUNT,
        "sequences per GPU per forward; where the config sets none, the largest that fits",
    ),
    arg(
        "--vocab",
        kinds.VOCABULARY,
        f"vocabulary size (repeatable; default: the config's model.vocab_size and {QWEN3_VOCAB})",
        action=kinds.Distinct,
    ),
    arg(
        "--tokens",
        kinds.POSITIVE,
        "training tokens (default: the config's steps x batch x seq_len, --seq-len's if given)",
    ),
    with_default("--mfu", kinds.PROBABILITY, "model FLOPs utilisation", 0.4),
    arg("--peak-tflops", kinds.POSITIVE, "bf16 peak per GPU (default: 989, H100/H200)", default=989.0),
)
def cmd_plan(args: argparse.Namespace) -> None:
    """per-GPU memory at ZeRO 0-3, stage, micro-batch and days for a cluster"""
    from mhf_dist.plan import (
        Cluster,
        batch_split,
        check_fits,
        plan,
        plan_legend,
        plan_rows,
        readable,
        token_count,
    )

    _refuse_overrides(args, "topology", "mhf plan plans --gpus x --nodes at every ZeRO stage")
    cfg = _config(args)  # --seq-len is its train.seq_len: checked against the model's positions
    seq_len = cfg.train.seq_len
    tokens = args.tokens or cfg.train.steps * cfg.train.batch_size * seq_len
    cluster = Cluster(args.gpus, args.nodes, args.gpu_mem_gb, args.peak_tflops)
    vocabs = args.vocab or dict.fromkeys([cfg.model.vocab_size, QWEN3_VOCAB])
    families = args.family or ["mhf", "qwen3"]
    plans = [plan(cfg, family, vocab, cluster, tokens, args.mfu) for vocab in vocabs for family in families]
    crowded = _shared_signatures(cfg, list(vocabs) if "mhf" in families else [])
    print(
        f"{_config_name(args.config, cfg)}, {cfg.model.hash.spec}, seq_len {readable(seq_len, '')}; "
        f"{readable(args.nodes, '')} node(s) x {readable(args.gpus, '')} GPU(s) of {args.gpu_mem_gb:g} GB, "
        f"{args.peak_tflops:g} TFLOP/s at MFU {args.mfu:g}; {token_count(tokens)} tokens"
    )
    rows = plan_rows(plans)
    print(markdown_table(rows, list(rows[0])))
    print(plan_legend(cfg))
    for line in [*crowded, *batch_split(cfg, cluster.gpus)]:
        print(line)
    check_fits(plans, cluster)  # the table above shows what each needs; the error line is the last


@command(
    arg("spec", kinds.FILE, "a job spec YAML, e.g. jobs/pretrain.job.yaml"),
    with_default("--address", kinds.JOBS_API, "the cluster's dashboard", DEFAULT_ADDRESS),
    switch("--wait", "stream the job's logs and exit with its status (0: SUCCEEDED)"),
    arg(
        "--env",
        kinds.VARIABLE,
        "set a variable the spec names",
        action=kinds.DistinctKeys,
        default=[],
        metavar="NAME=VALUE",
    ),
    arg("--submission-id", kinds.SUBMISSION_ID, "the job's id (default: Ray picks one)"),
    VERBOSE,
    usage="mhf submit SPEC [options] [-- ARGS appended to the spec's entrypoint]",
)
def cmd_submit(args: argparse.Namespace) -> int:
    """submit a job spec to a Ray cluster through the Jobs API"""
    import ray.job_submission  # noqa: F401  (its import sets its loggers to INFO: they are quieted after it)

    from mhf_dist.submit import follow_job, job_message, load_job_spec, submit_job

    quiet_driver(args.verbose)
    spec = load_job_spec(args.spec)
    env = dict(item.split("=", 1) for item in args.env)  # NAME=VALUE: kinds.VARIABLE
    address = f"--address {args.address}"
    # An interrupt's advice: rerunning could submit a second copy; the job goes on without its follower.
    with errors.advising(f"the job may be submitted already: look with `ray job list {address}`"):
        client, job_id = submit_job(spec, args.address, args.extra, env, args.submission_id)
    print(f"submitted job {job_id} to {args.address}", flush=True)
    logs = f"ray job logs {address} --follow {job_id}"
    if not args.wait:
        print(f"follow it: {logs}")
        return 0
    stop = f"stop it with `ray job stop {address} {job_id}`"
    with errors.advising(f"job {job_id} goes on; follow it with `{logs}`, {stop}"):
        status = follow_job(client, job_id, lambda text: print(text, end="", flush=True))
    message = job_message(client, job_id)
    print(f"job {job_id} {status}" + (f": {message}" if message else ""), file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


@command(
    arg("action", choices=["start", "stop"]),
    with_default(
        "--dir", kinds.LOCAL_PLACE, "state and node logs (the nodes run on this machine)", "runs/cluster"
    ),
    with_default("--workers", kinds.COUNT, "worker nodes beside the head", 1),
    with_default("--cpus-per-node", kinds.COUNT, "logical CPUs per node", 2),
    with_default("--gpus-per-node", kinds.NATURAL, "GPUs per node", 0),
    with_default("--dashboard-port", kinds.PORT, "Jobs API and dashboard port", 8265),
)
def cmd_cluster(args: argparse.Namespace) -> None:
    """start or stop a local multi-node Ray cluster (head + workers on 127.0.0.1)"""
    from mhf_dist.local_cluster import start_local_cluster, stop_local_cluster

    if args.action == "stop":
        stop_local_cluster(args.dir)
        print(f"stopped the local cluster in {args.dir}")
        return
    cluster = start_local_cluster(
        args.dir, args.workers, args.cpus_per_node, args.gpus_per_node, args.dashboard_port
    )
    print(f"Ray cluster up: head + {args.workers} worker node(s) on 127.0.0.1, logs in {args.dir}/logs")
    print(f"  export RAY_AUTH_MODE=token RAY_ADDRESS={cluster.address}   # drivers: mhf train, ray.init")
    print(f"  mhf submit jobs/pretrain.job.yaml --address {cluster.dashboard_url} --wait")
    print(f"  dashboard {cluster.dashboard_url}; stop: mhf cluster stop --dir {args.dir}")


def build_parser() -> MhfParser:
    parser = MhfParser(prog="mhf", description="Train hash-based language models on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    parser.commands = commands.choices
    for name, (_, options, arguments) in COMMANDS.items():
        sub = commands.add_parser(name, **options)
        for argument, settings in arguments:
            sub.add_argument(argument, **settings)
    return parser


def _print_logs_hint(stream: TextIO) -> None:
    """A command that ran Ray ends by saying where what it kept off the console is."""
    if hint := logs_hint():
        print(hint, file=stream)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with interrupts.running():
        try:
            end = argv.index("--") if "--" in argv else len(argv)
            parser, extra = build_parser(), argv[end + 1 :]
            try:
                args, unknown = parser.parse_known_args(argv[:end])
                if unknown:  # named by the sub-command they were given to, whose --help lists what it takes
                    parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
                if extra and args.command != "submit":
                    parser.error("arguments after -- are for `mhf submit` only")
            except SystemExit as done:  # --help, or argparse's one error line (MhfParser.error)
                return int(done.code or 0)
            args.extra = extra
            # Looked up by its name when it runs, as a test replaces one (`cli.cmd_count = ...`).
            status = globals()[COMMANDS[args.command][0]](args) or 0
            _print_logs_hint(sys.stdout)
            sys.stdout.flush()  # a reader that left (`mhf count | head -1`) shows here, not at exit
            return status
        except BrokenPipeError:
            # Python's documented recipe: stdout goes nowhere, so the flush at exit raises no second error.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except MhfError as err:
            _print_logs_hint(sys.stderr)  # before the error: the error stays the last line
            print(f"error: {errors.console_line(err, argv)}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, Interrupted, Exception) as err:
            # An interrupt (SIGTERM's Interrupted, SIGINT's KeyboardInterrupt), or a library's clean-up
            # (Ray Data's, say) that failed while one unwound through it.
            stop = errors.as_interrupted(err)
            if stop is None:
                raise
            _print_logs_hint(sys.stderr)
            print(f"interrupted: {errors.console_line(stop, argv)}", file=sys.stderr)
            return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
