"""The `mhf` command: parses arguments, loads the config, calls the library.

Each sub-command is a `cmd_<command>` beside the `add_<command>_parser` that declares it. A flag that
sets a config key (`--workers` sets `topology.workers`) has that key as its dest, defaults to None (the
config's own value holds) and wins over a `--set` of the same key. Every user mistake surfaces as one
line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from mhf_dist import arguments as kinds
from mhf_dist import interrupts
from mhf_dist.arguments import MhfParser
from mhf_dist.config import (
    INIT_NEW_ROWS,
    Config,
    TopologyConfig,
    check_topology,
    load_config,
    parse_overrides,
    split_assignment,
)
from mhf_dist.errors import ConfigError, Interrupted, MhfError, TrainingError
from mhf_dist.eval import LAYER as EVAL_LAYER
from mhf_dist.eval import TASKS as EVAL_TASKS
from mhf_dist.eval import WINDOW as EVAL_WINDOW
from mhf_dist.eval import WINDOWED as EVAL_WINDOWED
from mhf_dist.ray_utils import logs_hint
from mhf_dist.submit import DEFAULT_ADDRESS

if TYPE_CHECKING:
    from mhf_dist.data.tokenizer import TextTokenizer
    from mhf_dist.train.ray_trainer import TrainOptions, TrainResult


PREPARE_HELP = "first prepare data.path from data.corpus unless it holds shards (for jobs)"
VERBOSE_HELP = (
    "also show what Ray, its workers, Ray Train, Tune, DeepSpeed and MLflow print (by default only in "
    "Ray's session logs)"
)
QWEN3_VOCAB = 151_936  # Qwen3's own tokenizer: `mhf plan`'s second vocabulary by default


def _add_set_arg(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",  # the last of one key wins: a job spec's entrypoint is overridden after `--`
        default=[],
        type=kinds.ASSIGNMENT,
        metavar="KEY=VALUE",
        help=f"{help} (repeatable; the last of one key wins, and a flag that sets the same key wins)",
    )


def _add_config_args(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    parser.add_argument(
        "--config",
        type=kinds.NAME_OR_PATH,
        default=default,
        help=f"preset name or YAML file (default: {default})",
    )
    _add_set_arg(parser, "override one config key, e.g. --set train.steps=50")


def _add_key_flag(parser: argparse.ArgumentParser, flag: str, key: str, help: str, **kwargs: Any) -> None:
    """A flag that sets the config key `key`: see the module's docstring."""
    metavar = key.rsplit(".", 1)[-1].upper()
    default = "" if kwargs.get("required") else "; default: the config's"
    parser.add_argument(flag, dest=key, metavar=metavar, help=f"{help} (sets {key}{default})", **kwargs)


TOPOLOGY_KINDS = {
    "workers": kinds.COUNT,
    "gpus_per_worker": kinds.NATURAL,
    "zero_stage": kinds.ZERO_STAGE,
    "storage": kinds.OUTPUT_DIRECTORY,
}


def _add_topology_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """`--workers`, `--gpus-per-worker`, `--zero-stage`, `--storage`: the config's `topology:` keys."""
    for name in names:
        description = TopologyConfig.model_fields[name].description
        flag = "--" + name.replace("_", "-")
        _add_key_flag(parser, flag, f"topology.{name}", description, type=TOPOLOGY_KINDS[name])


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """A command line's config overrides: its `--set`s, then the flags given that set config keys."""
    flags = {dest: value for dest, value in vars(args).items() if "." in dest and value is not None}
    return {**parse_overrides(args.overrides), **flags}


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, config_overrides(args))


def add_config_parser(commands: argparse._SubParsersAction) -> None:
    show = commands.add_parser("config", help="print the resolved config as YAML")
    _add_config_args(show)
    show.set_defaults(func=cmd_config)


def cmd_config(args: argparse.Namespace) -> None:
    print(yaml.safe_dump(_config(args).model_dump(mode="json"), sort_keys=False), end="")


def add_count_parser(commands: argparse._SubParsersAction) -> None:
    count = commands.add_parser("count", help="analytic parameters and FLOPs of every family for a config")
    _add_config_args(count)
    count.set_defaults(func=cmd_count)


def cmd_count(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.models import FAMILIES, forward_flops_per_token, param_count
        from mhf_dist.models.registry import resolved_config
        from mhf_dist.signatures import scheme_for_config
        from mhf_dist.tables import markdown_table

    cfg = _config(args)
    scheme = scheme_for_config(cfg.model.hash)
    short = scheme.shortfall(cfg.model.vocab_size)
    if short is not None and cfg.model.hash.signature_scheme == "murmur32":
        raise ConfigError(f"{short}, collision-free); use more hashes or buckets")
    if short is not None and scheme.capacity == 2:  # the reference scheme at B=2: no table can be built
        raise ConfigError(
            f"{short}): at B=2 every token but the padding one has one signature; use more buckets"
        )
    mhf_total = param_count(cfg.model.model_copy(update={"family": "mhf"}))
    qwen3_total = param_count(cfg.model.model_copy(update={"family": "qwen3"}))
    rows, unmatched = [], []
    for family in FAMILIES:
        model_cfg = cfg.model.model_copy(update={"family": family})
        try:
            built = resolved_config(model_cfg).backbone
        except ConfigError as err:  # a parameter match out of reach: the other families still count
            unmatched.append(f"{family}: {err}")
            continue
        params = param_count(model_cfg)
        rows.append(
            {
                "family": family if family != "mhf" or built.kind == "qwen3" else f"mhf over {built.kind}",
                "layers": built.num_layers,
                "mlp": built.intermediate_size,
                "params": params,
                "vs mhf": params - mhf_total,
                "vs qwen3": params - qwen3_total,
                "fwd GFLOP/token": forward_flops_per_token(model_cfg, cfg.train.seq_len) / 1e9,
            }
        )
    print(
        f"preset {cfg.preset or args.config}, V={cfg.model.vocab_size}, {cfg.model.hash.spec}, "
        f"seq_len {cfg.train.seq_len}"
    )
    print(
        markdown_table(rows, ["family", "layers", "mlp", "params", "vs mhf", "vs qwen3", "fwd GFLOP/token"])
    )
    for line in unmatched:
        print(line)
    if short is not None:  # the reference scheme's redraw rule gives the rest duplicates
        shared = cfg.model.vocab_size - scheme_for_config(cfg.model.hash).capacity
        print(
            f"warning: {short}): {shared:,} tokens at least share another's signature and score alike; use "
            "more hashes or buckets"
        )


def add_prepare_parser(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "prepare", help="tokenize, pack and sign a corpus into parquet shards on Ray (resumable)"
    )
    _add_config_args(prep)
    _add_key_flag(
        prep,
        "--corpus",
        "data.corpus",
        "builtin | hf:NAME | dataset:package.module:function (returning a ray.data.Dataset) | a file, "
        "directory or glob, local or s3:// / gs://, of .txt/.raw/.jsonl/.json (optionally .gz/.zst/.bz2), "
        ".parquet or .arrow (optionally .zst)",
        type=kinds.CORPUS,
    )
    _add_key_flag(
        prep,
        "--tokenizer",
        "data.tokenizer",
        "bpe | bytes | mistral-v0.3 | path to tokenizer.json",
        type=kinds.NAME_OR_PATH,
    )
    _add_key_flag(
        prep, "--out", "data.path", "output directory, local or s3:// / gs://", type=kinds.OUTPUT_DIRECTORY
    )
    prep.add_argument(
        "--overwrite",
        action="store_true",
        help="replace shards an earlier prepare wrote there (a folder holding anything else is refused)",
    )
    prep.add_argument("--num-cpus", type=kinds.COUNT, help="CPUs of a local Ray instance (default: all)")
    prep.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    prep.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> None:
    from mhf_dist.data import recall
    from mhf_dist.data.prepare import prepare

    cfg = _config(args)
    try:
        prepare(cfg, cfg.data.path, overwrite=args.overwrite, num_cpus=args.num_cpus, verbose=args.verbose)
    except (KeyboardInterrupt, Interrupted) as err:
        generated = cfg.data.corpus == recall.CORPUS  # its rows are made again, in seconds
        kept = "" if generated else ": it goes on from the parts and shards already written"
        raise interrupts.restated(err, f"rerun the same command{kept}") from None


def add_verify_data_parser(commands: argparse._SubParsersAction) -> None:
    verify = commands.add_parser(
        "verify-data", help="check every prepared shard against its manifest's sha256 (reads all the data)"
    )
    verify.add_argument(
        "path",
        type=kinds.DIRECTORY,
        help="a prepared shard directory, local or s3:// / gs:// (mhf prepare --out)",
    )
    verify.set_defaults(func=cmd_verify_data)


def cmd_verify_data(args: argparse.Namespace) -> None:
    from mhf_dist.data.shards import verify_shards
    from mhf_dist.storage import redact

    count = verify_shards(args.path)
    print(
        f"{count} shards, tokenizer.json and the signature table in {redact(args.path)} match their manifest"
    )


def _add_run_options(parser: argparse.ArgumentParser, name: str) -> None:
    """What `mhf train` and `mhf cpt` share: the run's topology, name and tracking."""
    _add_topology_flags(parser, "workers", "gpus_per_worker", "zero_stage", "storage")
    parser.add_argument(
        "--name", type=kinds.RUN_NAME, default=name, help=f"run name under the storage path (default: {name})"
    )
    parser.add_argument(
        "--experiment", type=kinds.TEXT, default="mhf", help="MLflow experiment (default: mhf)"
    )
    parser.add_argument(
        "--max-failures", type=kinds.RETRIES, default=0, help="worker-group restarts from the last checkpoint"
    )
    parser.add_argument(
        "--peak-tflops",
        type=kinds.NON_NEGATIVE,
        default=0.0,
        help="peak TFLOP/s per worker for the MFU estimate (default: bf16 peak of known GPUs)",
    )
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def _train_options(args: argparse.Namespace) -> TrainOptions:
    from mhf_dist.train.ray_trainer import TrainOptions

    given = {field.name for field in dataclasses.fields(TrainOptions)} & set(vars(args))
    return TrainOptions(**{name: getattr(args, name) for name in given})


def _print_result(result: TrainResult, experiment: str) -> None:
    from mhf_dist.storage import redact
    from mhf_dist.tables import markdown_table
    from mhf_dist.tracking import browse_hint
    from mhf_dist.train.checkpoints import MODEL_DIR, read_history

    last = read_history(result.checkpoint)[-1:]
    columns = ["step", "loss", "val_nll", "val_ppl", "tokens_per_s", "peak_mem_gb"]
    print(markdown_table(last, [column for column in columns if column in last[0]]))
    print(f"last checkpoint: {result.checkpoint} (exported model: {result.checkpoint / MODEL_DIR})")
    print(f"MLflow run {result.run_id} at {redact(result.tracking_uri)}")
    print(f"MLflow UI: {browse_hint(result.tracking_uri, experiment)}")


def add_train_parser(commands: argparse._SubParsersAction) -> None:
    fit = commands.add_parser("train", help="train on prepared shards with Ray Train + DeepSpeed ZeRO")
    _add_config_args(fit)
    _add_run_options(fit, name="mhf-train")
    fit.add_argument(
        "--resume",
        type=kinds.NAME_OR_PATH,
        help="continue exactly from a checkpoint directory, or from a run name's newest",
    )
    fit.add_argument("--stop-at-step", type=kinds.COUNT, help="end this run at this step, with a checkpoint")
    fit.add_argument(
        "--continue",
        dest="continue_run",
        action="store_true",
        help="continue the run --name from its newest checkpoint, logging to the same MLflow run",
    )
    fit.add_argument(
        "--init-from",
        type=kinds.FILE_OR_DIRECTORY,
        help="an exported model directory to start from (fresh optimizer)",
    )
    fit.add_argument("--prepare", action="store_true", help=PREPARE_HELP)
    fit.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    cfg = _config(args)
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.data.prepare import prepare_if_missing
        from mhf_dist.storage import Location
        from mhf_dist.train.checkpoints import newest_checkpoint
        from mhf_dist.train.ray_trainer import train

    storage = Location.of(cfg.topology.storage)
    if args.continue_run and newest_checkpoint(storage / args.name) is None:  # (a sweep's trials: either)
        raise TrainingError(
            f"--continue: run {args.name!r} has no checkpoint in {storage} to go on from; leave --continue "
            "out to start it"
        )
    if args.prepare:
        check_topology(cfg)  # train() checks it too; here before minutes of preparing
        prepare_if_missing(cfg, verbose=args.verbose)
    result = train(cfg, _train_options(args))
    _print_result(result, args.experiment)


def add_cpt_parser(commands: argparse._SubParsersAction) -> None:
    cpt = commands.add_parser(
        "cpt", help="continued pretraining with an expanded vocabulary (mhf: zero new parameters)"
    )
    _add_config_args(cpt)
    cpt.add_argument(
        "--from",
        dest="parent",
        required=True,
        type=kinds.NAME_OR_PATH,  # a path on the cluster that runs it (jobs/cpt.job.yaml); checked there
        help="exported model, checkpoint or run directory",
    )
    cpt.add_argument(
        "--tokenizer", type=kinds.FILE, help="a tokenizer.json that appends tokens to the parent's"
    )
    cpt.add_argument("--add-tokens", type=kinds.FILE, help="a file with one new token per line")
    cpt.add_argument("--train-new-tokens", type=kinds.COUNT, help="learn N new BPE tokens from --corpus")
    cpt.add_argument(
        "--corpus", type=kinds.CORPUS, help="text the new tokens are learned from (a file, directory or glob)"
    )
    _add_key_flag(
        cpt, "--data", "data.corpus", "the corpus training continues on", required=True, type=kinds.CORPUS
    )
    cpt.add_argument(
        "--init-new-rows",
        choices=INIT_NEW_ROWS,
        default="subword",
        help="a baseline's new embedding/head rows: subword, the mean of the token's old pieces' rows "
        "(the authors'), or mean, of all old rows (mhf adds no rows; default: subword)",
    )
    _add_key_flag(
        cpt, "--replay", "data.replay.corpus", "a corpus to replay (e.g. the parent's)", type=kinds.CORPUS
    )
    _add_key_flag(
        cpt,
        "--replay-fraction",
        "data.replay.fraction",
        "share of the training tokens from --replay",
        type=kinds.SHARE,
    )
    _add_run_options(cpt, name="mhf-cpt")
    cpt.set_defaults(func=cmd_cpt)


def cmd_cpt(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.cpt import expanded_tokenizer, run_cpt
        from mhf_dist.data.corpus import corpus_texts

    cfg = _config(args)

    def new_tokenizer(parent: TextTokenizer) -> TextTokenizer:
        texts = (lambda: corpus_texts(args.corpus, cfg.data.text_field)) if args.corpus else None
        return expanded_tokenizer(parent, args.tokenizer, args.add_tokens, args.train_new_tokens or 0, texts)

    options = _train_options(args)
    result = run_cpt(cfg, args.parent, new_tokenizer, options, init_new_rows=args.init_new_rows)
    _print_result(result.train_result, args.experiment)


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="evaluate an exported model: ppl, bpb, lambada, hellaswag, card660"
    )
    evaluate.add_argument(
        "--model",
        required=True,
        type=kinds.DIRECTORY,
        help="an exported model directory (a checkpoint's model/): path or URI",
    )
    evaluate.add_argument("--task", required=True, choices=EVAL_TASKS, help=" | ".join(EVAL_TASKS))
    evaluate.add_argument(
        "--data",
        type=kinds.FILE_OR_DIRECTORY,
        help="the task's file, a path or a URI (see README); recall generates its own",
    )
    evaluate.add_argument("--limit", type=kinds.COUNT, default=0, help="first N examples only (default: all)")
    evaluate.add_argument(
        "--seq-len",
        type=kinds.WINDOW,
        help=f"ppl and bpb of a text file: window length (default: {EVAL_WINDOW})",
    )
    evaluate.add_argument(
        "--layer", type=kinds.INTEGER, help=f"card660: hidden-state layer (default: {EVAL_LAYER})"
    )
    evaluate.add_argument(
        "--batch-size",
        type=kinds.COUNT,
        default=16,
        help="sequences per forward pass; the results do not depend on it (default: 16)",
    )
    evaluate.add_argument("--run-id", type=kinds.TEXT, help="log the results to this MLflow run")
    evaluate.add_argument(
        "--storage",
        type=kinds.PLACE,
        default="runs/train",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    evaluate.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.eval.tasks import check_task_data, run_task
        from mhf_dist.export import load_exported
        from mhf_dist.storage import Location
        from mhf_dist.tables import markdown_table
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


def add_import_hf_parser(commands: argparse._SubParsersAction) -> None:
    importer = commands.add_parser(
        "import-hf", help="a reference MHF or transformers Qwen3 checkpoint -> an exported mhf-dist model"
    )
    importer.add_argument(
        "source",
        type=kinds.DIRECTORY,
        help="a Hugging Face checkpoint directory (config.json, safetensors): a path or a URI",
    )
    importer.add_argument(
        "--out",
        required=True,
        type=kinds.OUTPUT_DIRECTORY,
        help="the exported model directory to create (path or URI)",
    )
    importer.set_defaults(func=cmd_import_hf)


def cmd_import_hf(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.hf_layout import import_hf
        from mhf_dist.models import param_count
        from mhf_dist.storage import redact

    exported = import_hf(args.source, args.out)
    cfg = exported.config
    io = f", {cfg.hash.spec} {cfg.hash.io} I/O, loss {cfg.hash.loss}" if cfg.family == "mhf" else ""
    print(
        f"imported {cfg.family} ({param_count(cfg):,} parameters, V={cfg.vocab_size:,}{io}) "
        f"from {redact(args.source)} to {exported.path}"
    )


def add_export_hf_parser(commands: argparse._SubParsersAction) -> None:
    exporter = commands.add_parser(
        "export-hf", help="an exported model -> the reference layout (mhf) or a transformers Qwen3 directory"
    )
    exporter.add_argument(
        "model", type=kinds.DIRECTORY, help="an exported model directory (a checkpoint's model/): path or URI"
    )
    exporter.add_argument(
        "--out",
        required=True,
        type=kinds.OUTPUT_DIRECTORY,
        help="the Hugging Face directory to create (path or URI)",
    )
    exporter.add_argument(
        "--max-shard-size",
        type=kinds.SIZE,
        default="5GB",
        help="largest safetensors shard: bytes or a size such as 500MB (default: 5GB, the Hub's convention)",
    )
    exporter.set_defaults(func=cmd_export_hf)


def cmd_export_hf(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.hf_layout import export_hf

    print(f"wrote {export_hf(args.model, args.out, args.max_shard_size)}")


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="stream tokens from an exported model")
    gen.add_argument(
        "--model",
        required=True,
        type=kinds.DIRECTORY,
        help="an exported model directory: a path or s3:// gs://",
    )
    gen.add_argument("--prompt", required=True, type=kinds.TEXT, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=kinds.COUNT, default=64, help="tokens to add (default: 64)")
    gen.add_argument("--temperature", type=kinds.NON_NEGATIVE, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=kinds.NATURAL, default=0, help="sample from the k likeliest; 0: all")
    gen.add_argument(
        "--top-p", type=kinds.PROBABILITY, default=1.0, help="sample from the nucleus of this mass; 1: all"
    )
    gen.add_argument("--seed", type=kinds.SEED, help="seed for reproducible sampling")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.eval.tasks import check_positions
        from mhf_dist.export import load_exported
        from mhf_dist.models.generation import Sampling, generate

    exported = load_exported(args.model)
    tokenizer = exported.tokenizer
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as err:
        raise ConfigError(str(err)) from None
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


def add_demo_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="train mhf and Qwen3 baselines small on the built-in corpus")
    _add_config_args(demo)
    demo.add_argument(
        "--workdir",
        type=kinds.OUTPUT_DIRECTORY,
        default="runs/demo",
        help="where results are written (default: runs/demo)",
    )
    demo.add_argument(
        "--seeds",
        type=kinds.SEED,
        nargs="+",
        action=kinds.Distinct,
        default=[0, 1],
        help="seeds per family (default: 0 1)",
    )
    _add_topology_flags(demo, "workers")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> None:
    with interrupts.importing():  # torch, loaded by these
        from mhf_dist.demo import run_demo

    run_demo(args.config, config_overrides(args), Path(args.workdir), seeds=args.seeds, verbose=args.verbose)


def add_sweep_parser(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser("sweep", help="matched-baseline, seed or grid sweeps on Ray Tune")
    sweep.add_argument(
        "--config", required=True, type=kinds.FILE, help="the sweep YAML file (see README: Sweeps)"
    )
    sweep.add_argument(
        "--resume", action="store_true", help="finish an interrupted sweep; keeps finished trials"
    )
    _add_set_arg(sweep, "a config override for every trial, on top of the file's set:")
    sweep.add_argument(
        "--storage",
        type=kinds.OUTPUT_DIRECTORY,
        help="where the sweep, its trials and MLflow live (default: the file's)",
    )
    sweep.add_argument("--prepare", action="store_true", help=PREPARE_HELP)
    sweep.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sweep.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> None:
    from mhf_dist.sweep.runner import compare_sweep, run_sweep
    from mhf_dist.sweep.spec import load_sweep, parse_sweep
    from mhf_dist.tracking import browse_hint

    spec = load_sweep(args.config)
    changed = {"set": {**spec.set, **config_overrides(args)}, "storage": args.storage or spec.storage}
    spec = parse_sweep({**spec.model_dump(), **changed}, args.config)
    if args.prepare:
        from mhf_dist.data.prepare import prepare_if_missing
        from mhf_dist.sweep.spec import trial_configs

        for cfg in {cfg.data.path: cfg for cfg in trial_configs(spec).values()}.values():
            prepare_if_missing(cfg, verbose=args.verbose)
    result = run_sweep(spec, resume=args.resume, verbose=args.verbose)
    comparison = compare_sweep(spec, result)
    print(comparison.report)
    print(f"tables and plots: {result.directory / 'compare'}; MLflow parent run {result.parent_run_id}")
    print(f"MLflow UI: {browse_hint(result.tracking_uri, spec.experiment)}")


def add_compare_parser(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser("compare", help="compare runs across seeds from MLflow: table, CSV, plots")
    compare.add_argument(
        "--experiment", type=kinds.TEXT, default="mhf-sweeps", help="MLflow experiment (default: mhf-sweeps)"
    )
    compare.add_argument(
        "--sweep", type=kinds.TEXT, help="a sweep's parent run id: only its trials, results logged to it"
    )
    compare.add_argument(
        "--metric", type=kinds.TEXT, default="val_nll", help="the metric compared (default: val_nll)"
    )
    compare.add_argument(
        "--group-by",
        action=kinds.Distinct,
        type=kinds.TEXT,
        metavar="KEY",
        help="group by this MLflow param or tag, e.g. topology.zero_stage or model.family (repeatable; "
        "default: the sweep's group tag, else the family)",
    )
    compare.add_argument(
        "--storage",
        type=kinds.PLACE,
        default="runs/sweeps",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    compare.add_argument(
        "--out",
        type=kinds.OUTPUT_DIRECTORY,
        help="output directory or bucket URI (default: <storage>/compare/<sweep or experiment>)",
    )
    compare.add_argument(
        "--unstable-cv", type=kinds.POSITIVE, default=0.05, help="coefficient of variation flagged unstable"
    )
    compare.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> None:
    from mhf_dist.compare import compare_runs
    from mhf_dist.storage import Location
    from mhf_dist.tracking import browse_hint, reading_uri

    uri = reading_uri(args.storage)  # an absent embedded store is an error, not created
    out = args.out or Location.of(args.storage) / "compare" / (args.sweep or args.experiment)
    comparison = compare_runs(
        uri, args.experiment, out, args.metric, args.sweep, args.unstable_cv, args.group_by or ()
    )
    print(comparison.report)
    print(f"written: {', '.join(str(path) for path in comparison.files)}")
    print(f"MLflow UI: {browse_hint(uri, args.experiment)}")


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    planner = commands.add_parser(
        "plan", help="per-GPU memory at ZeRO 0-3, stage, micro-batch and days for a cluster"
    )
    _add_config_args(planner, default="1b")
    planner.add_argument(
        "--family",
        action=kinds.Distinct,
        type=kinds.TEXT,
        help="mhf | qwen3 | qwen3_matched (repeatable; default: mhf and qwen3)",
    )
    planner.add_argument("--gpus", type=kinds.COUNT, required=True, help="GPUs per node")
    planner.add_argument("--gpu-mem-gb", type=kinds.POSITIVE, required=True, help="memory of one GPU in GiB")
    planner.add_argument("--nodes", type=kinds.COUNT, default=1, help="nodes (default: 1)")
    planner.add_argument("--seq-len", type=kinds.WINDOW, help="tokens per sequence (default: the config's)")
    planner.add_argument(
        "--micro-batch",
        type=kinds.COUNT,
        help="sequences per GPU per forward (default: recommended)",
    )
    planner.add_argument(
        "--vocab",
        type=kinds.VOCABULARY,
        action=kinds.Distinct,
        help=f"vocabulary size (repeatable; default: the config's model.vocab_size and {QWEN3_VOCAB})",
    )
    planner.add_argument(
        "--tokens",
        type=kinds.POSITIVE,
        help="training tokens (default: the config's steps x batch x seq_len)",
    )
    planner.add_argument(
        "--mfu", type=kinds.PROBABILITY, default=0.4, help="model FLOPs utilisation (default: 0.4)"
    )
    planner.add_argument(
        "--peak-tflops",
        type=kinds.POSITIVE,
        default=989.0,
        help="bf16 peak per GPU (default: 989, H100/H200)",
    )
    planner.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from mhf_dist.plan import Cluster, check_fits, plan, plan_rows
    from mhf_dist.tables import markdown_table

    cfg = _config(args)
    seq_len = args.seq_len or cfg.train.seq_len
    tokens = args.tokens or cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
    cluster = Cluster(args.gpus, args.nodes, args.gpu_mem_gb, args.peak_tflops)
    vocabs = args.vocab or dict.fromkeys([cfg.model.vocab_size, QWEN3_VOCAB])
    plans = [
        plan(cfg, family, vocab, cluster, seq_len, args.micro_batch, tokens, args.mfu)
        for vocab in vocabs
        for family in args.family or ["mhf", "qwen3"]
    ]
    print(
        f"preset {cfg.preset or args.config}, {cfg.model.hash.spec}, seq_len {seq_len}; "
        f"{args.nodes} node(s) x {args.gpus} GPU(s) of {args.gpu_mem_gb:g} GB, "
        f"{args.peak_tflops:g} TFLOP/s at MFU {args.mfu:g}; {tokens / 1e9:.1f}B tokens"
    )
    rows = plan_rows(plans)
    print(markdown_table(rows, list(rows[0])))
    checkpointing = {"none": "no checkpointing", "layers": "layers checkpointed"}[
        cfg.train.activation_checkpointing
    ]
    states = (
        "bf16-pure: bf16 weights, grads and Adam moments, no fp32 copy"
        if cfg.train.precision == "bf16-pure"
        else "bf16 mixed precision: fp32 master weights and Adam states"
    )
    print(
        f"GB: GiB per GPU. ZeRO-k GB: weights, grads and Adam states ({states}); act GB/seq: "
        f"activations of one sequence, {checkpointing}; stage and micro-batch: what fits in 90% of a GPU "
        "(train with --zero-stage S --set train.micro_batch_size=M)."
    )
    check_fits(plans, cluster)  # the table above shows what each needs; the error line is the last


def add_submit_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser(
        "submit",
        help="submit a job spec to a Ray cluster through the Jobs API",
        usage="mhf submit SPEC [options] [-- ARGS appended to the spec's entrypoint]",
    )
    submit.add_argument("spec", type=kinds.FILE, help="a job spec YAML, e.g. jobs/pretrain.job.yaml")
    submit.add_argument(
        "--address",
        type=kinds.JOBS_API,
        default=DEFAULT_ADDRESS,
        help=f"the cluster's dashboard (default: {DEFAULT_ADDRESS})",
    )
    submit.add_argument(
        "--wait", action="store_true", help="stream the job's logs and exit with its status (0: SUCCEEDED)"
    )
    submit.add_argument(
        "--env",
        action=kinds.DistinctKeys,
        default=[],
        type=kinds.VARIABLE,
        metavar="NAME=VALUE",
        help="set a variable the spec names",
    )
    submit.add_argument(
        "--submission-id", type=kinds.SUBMISSION_ID, help="the job's id (default: Ray picks one)"
    )
    submit.set_defaults(func=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    from mhf_dist.submit import follow_job, job_message, load_job_spec, submit_job

    spec = load_job_spec(args.spec)
    env = dict(split_assignment(item, "--env", "MHF_STORAGE=/shared/mhf") for item in args.env)
    try:
        client, job_id = submit_job(spec, args.address, args.extra, env, args.submission_id)
    except (KeyboardInterrupt, Interrupted) as err:  # rerunning could submit a second copy
        raise interrupts.restated(
            err, f"the job may be submitted already: look with `ray job list --address {args.address}`"
        ) from None
    print(f"submitted job {job_id} to {args.address}", flush=True)
    if not args.wait:
        print(f"follow it: ray job logs --address {args.address} --follow {job_id}")
        return 0
    try:
        status = follow_job(client, job_id, lambda text: print(text, end="", flush=True))
    except (KeyboardInterrupt, Interrupted) as err:
        raise interrupts.restated(
            err,
            f"job {job_id} goes on; follow it with `ray job logs --address {args.address} --follow "
            f"{job_id}`, stop it with `ray job stop --address {args.address} {job_id}`",
        ) from None
    message = job_message(client, job_id)
    print(f"job {job_id} {status}" + (f": {message}" if message else ""), file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def add_cluster_parser(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser(
        "cluster", help="start or stop a local multi-node Ray cluster (head + workers on 127.0.0.1)"
    )
    cluster.add_argument("action", choices=["start", "stop"])
    cluster.add_argument(
        "--dir",
        type=kinds.PLACE,
        default="runs/cluster",
        help="state and node logs (default: runs/cluster)",
    )
    cluster.add_argument(
        "--workers", type=kinds.COUNT, default=1, help="worker nodes beside the head (default: 1)"
    )
    cluster.add_argument(
        "--cpus-per-node", type=kinds.COUNT, default=2, help="logical CPUs per node (default: 2)"
    )
    cluster.add_argument("--gpus-per-node", type=kinds.NATURAL, default=0, help="GPUs per node (default: 0)")
    cluster.add_argument(
        "--dashboard-port", type=kinds.PORT, default=8265, help="Jobs API and dashboard port (default: 8265)"
    )
    cluster.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> None:
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


SUB_COMMANDS = (  # in the order `mhf --help` lists them
    add_demo_parser,
    add_sweep_parser,
    add_compare_parser,
    add_prepare_parser,
    add_verify_data_parser,
    add_train_parser,
    add_cpt_parser,
    add_eval_parser,
    add_import_hf_parser,
    add_export_hf_parser,
    add_generate_parser,
    add_config_parser,
    add_count_parser,
    add_plan_parser,
    add_submit_parser,
    add_cluster_parser,
)


def build_parser() -> MhfParser:
    parser = MhfParser(prog="mhf", description="Train hash-based language models on Ray.")
    commands = parser.add_commands(dest="command", required=True)
    for add_parser in SUB_COMMANDS:
        add_parser(commands)
    return parser


def _parse(argv: list[str], extra: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the sub-command they were given to, whose --help lists what it takes
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and args.command != "submit":
        parser.error("arguments after -- are for `mhf submit` only")
    args.extra = extra
    return args


def _print_logs_hint(stream: TextIO) -> None:
    """A command that ran Ray ends by saying where what it kept off the console is."""
    if hint := logs_hint():
        print(hint, file=stream)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    with interrupts.running():
        try:
            extra = argv[argv.index("--") + 1 :] if "--" in argv else []
            try:
                args = _parse(argv[: argv.index("--")] if "--" in argv else argv, extra)
            except SystemExit as done:  # --help, or argparse's one error line (MhfParser.error)
                return int(done.code or 0)
            status = args.func(args) or 0
            _print_logs_hint(sys.stdout)
            sys.stdout.flush()  # a reader that left (`mhf count | head -1`) shows here, not at exit
            return status
        except BrokenPipeError:
            # Python's documented recipe: stdout goes nowhere, so the flush at exit raises no second error.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        except MhfError as err:
            _print_logs_hint(sys.stderr)  # before the error: the error stays the last line
            print(f"error: {err}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, Interrupted, Exception) as err:
            # An interrupt (SIGTERM's Interrupted, SIGINT's KeyboardInterrupt), or a library's clean-up
            # (Ray Data's, say) that failed while one unwound through it.
            stop = interrupts.as_interrupted(err)
            if stop is None:
                raise
            _print_logs_hint(sys.stderr)
            print(f"interrupted: {interrupts.console_line(stop, argv)}", file=sys.stderr)
            return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
