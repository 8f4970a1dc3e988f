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

from mhf_dist.config import Config, TopologyConfig, load_config, parse_overrides, split_assignment
from mhf_dist.errors import ConfigError, Interrupted, MhfError
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
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{help} (repeatable; a flag that sets the same key wins)",
    )


def _add_config_args(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    parser.add_argument("--config", default=default, help=f"preset name or YAML file (default: {default})")
    _add_set_arg(parser, "override one config key, e.g. --set train.steps=50")


def _add_key_flag(parser: argparse.ArgumentParser, flag: str, key: str, help: str, **kwargs: Any) -> None:
    """A flag that sets the config key `key`: see the module's docstring."""
    metavar = key.rsplit(".", 1)[-1].upper()
    default = "" if kwargs.get("required") else "; default: the config's"
    parser.add_argument(flag, dest=key, metavar=metavar, help=f"{help} (sets {key}{default})", **kwargs)


def _add_topology_flags(parser: argparse.ArgumentParser, *names: str) -> None:
    """`--workers`, `--gpus-per-worker`, `--zero-stage`, `--storage`: the config's `topology:` keys."""
    for name in names:
        field = TopologyConfig.model_fields[name]
        flag = "--" + name.replace("_", "-")
        _add_key_flag(parser, flag, f"topology.{name}", field.description, type=field.annotation)


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
    from mhf_dist.models import FAMILIES, forward_flops_per_token, param_count
    from mhf_dist.models.registry import resolved_config
    from mhf_dist.tables import markdown_table

    cfg = _config(args)
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


def add_prepare_parser(commands: argparse._SubParsersAction) -> None:
    prep = commands.add_parser(
        "prepare", help="tokenize, pack and sign a corpus into parquet shards on Ray (resumable)"
    )
    _add_config_args(prep)
    _add_key_flag(
        prep,
        "--corpus",
        "data.corpus",
        "builtin | hf:NAME | a file, directory or glob, local or s3:// / gs://, of .txt/.raw/.jsonl/.json "
        "(optionally .gz/.zst/.bz2), .parquet or .arrow (optionally .zst)",
    )
    _add_key_flag(
        prep, "--tokenizer", "data.tokenizer", "bpe | bytes | mistral-v0.3 | path to tokenizer.json"
    )
    _add_key_flag(prep, "--out", "data.path", "output directory, local or s3:// / gs://")
    prep.add_argument(
        "--overwrite", action="store_true", help="replace an existing output (in a bucket: only an mhf one)"
    )
    prep.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (default: all)")
    prep.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    prep.set_defaults(func=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> None:
    from mhf_dist.data.prepare import prepare

    cfg = _config(args)
    prepare(cfg, cfg.data.path, overwrite=args.overwrite, num_cpus=args.num_cpus, verbose=args.verbose)


def add_verify_data_parser(commands: argparse._SubParsersAction) -> None:
    verify = commands.add_parser(
        "verify-data", help="check every prepared shard against its manifest's sha256 (reads all the data)"
    )
    verify.add_argument("path", help="a prepared shard directory, local or s3:// / gs:// (mhf prepare --out)")
    verify.set_defaults(func=cmd_verify_data)


def cmd_verify_data(args: argparse.Namespace) -> None:
    from mhf_dist.data.shards import verify_shards
    from mhf_dist.storage import redact

    print(f"{verify_shards(args.path)} shards in {redact(args.path)} match their manifest's sha256")


def _add_run_options(parser: argparse.ArgumentParser, name: str) -> None:
    """What `mhf train` and `mhf cpt` share: the run's topology, name and tracking."""
    _add_topology_flags(parser, "workers", "gpus_per_worker", "zero_stage", "storage")
    parser.add_argument("--name", default=name, help=f"run name under the storage path (default: {name})")
    parser.add_argument("--experiment", default="mhf", help="MLflow experiment (default: mhf)")
    parser.add_argument(
        "--max-failures", type=int, default=0, help="worker-group restarts from the last checkpoint"
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
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
        "--resume", help="continue exactly from a checkpoint directory, or from a run name's newest"
    )
    fit.add_argument("--stop-at-step", type=int, help="end this run at this step, with a checkpoint")
    fit.add_argument(
        "--continue",
        dest="continue_run",
        action="store_true",
        help="continue the run --name from its newest checkpoint, logging to the same MLflow run",
    )
    fit.add_argument("--init-from", help="an exported model directory to start from (fresh optimizer)")
    fit.add_argument("--prepare", action="store_true", help=PREPARE_HELP)
    fit.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> None:
    cfg = _config(args)
    from mhf_dist.data.prepare import prepare_if_missing
    from mhf_dist.train.ray_trainer import train

    if args.prepare:
        prepare_if_missing(cfg, verbose=args.verbose)
    result = train(cfg, _train_options(args))
    _print_result(result, args.experiment)


def _init_new_rows(value: str) -> str:
    from mhf_dist.cpt import INIT_NEW_ROWS  # imports torch: only when `mhf cpt` parses its arguments

    if value not in INIT_NEW_ROWS:
        raise argparse.ArgumentTypeError(f"{value!r}: use one of {', '.join(INIT_NEW_ROWS)}")
    return value


def add_cpt_parser(commands: argparse._SubParsersAction) -> None:
    cpt = commands.add_parser(
        "cpt", help="continued pretraining with an expanded vocabulary (mhf: zero new parameters)"
    )
    _add_config_args(cpt)
    cpt.add_argument(
        "--from", dest="parent", required=True, help="exported model, checkpoint or run directory"
    )
    cpt.add_argument("--tokenizer", help="a tokenizer.json that appends tokens to the parent's")
    cpt.add_argument("--add-tokens", help="a file with one new token per line")
    cpt.add_argument("--train-new-tokens", type=int, default=0, help="learn N new BPE tokens from --corpus")
    cpt.add_argument("--corpus", help="text the new tokens are learned from (a file, directory or glob)")
    _add_key_flag(cpt, "--data", "data.corpus", "the corpus training continues on", required=True)
    cpt.add_argument(
        "--init-new-rows",
        type=_init_new_rows,
        default="subword",
        help="a baseline's new embedding/head rows: subword, the mean of the token's old pieces' rows "
        "(the authors'), or mean, of all old rows (mhf adds no rows; default: subword)",
    )
    _add_key_flag(cpt, "--replay", "data.replay.corpus", "a corpus to replay (e.g. the parent's)")
    _add_key_flag(
        cpt,
        "--replay-fraction",
        "data.replay.fraction",
        "share of the training tokens from --replay",
        type=float,
    )
    _add_run_options(cpt, name="mhf-cpt")
    cpt.set_defaults(func=cmd_cpt)


def cmd_cpt(args: argparse.Namespace) -> None:
    from mhf_dist.cpt import expanded_tokenizer, run_cpt
    from mhf_dist.data.corpus import corpus_texts

    cfg = _config(args)

    def new_tokenizer(parent: TextTokenizer) -> TextTokenizer:
        texts = (lambda: corpus_texts(args.corpus, cfg.data.text_field)) if args.corpus else None
        return expanded_tokenizer(parent, args.tokenizer, args.add_tokens, args.train_new_tokens, texts)

    options = _train_options(args)
    result = run_cpt(cfg, args.parent, new_tokenizer, options, init_new_rows=args.init_new_rows)
    _print_result(result.train_result, args.experiment)


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: use a whole number of at least 1")
    return int(value)


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="evaluate an exported model: ppl, bpb, lambada, hellaswag, card660"
    )
    evaluate.add_argument(
        "--model", required=True, help="an exported model directory (a checkpoint's model/): path or URI"
    )
    evaluate.add_argument("--task", required=True, help="ppl | bpb | lambada | hellaswag | card660 | recall")
    evaluate.add_argument(
        "--data", help="the task's file, a path or a URI (see README); recall generates its own"
    )
    evaluate.add_argument("--limit", type=int, default=0, help="first N examples only (default: all)")
    evaluate.add_argument("--seq-len", type=int, default=128, help="window length for ppl and bpb")
    evaluate.add_argument("--layer", type=int, default=-2, help="card660: hidden-state layer (default: -2)")
    evaluate.add_argument(
        "--batch-size",
        type=_positive_int,
        default=16,
        help="sequences per forward pass; the results do not depend on it (default: 16)",
    )
    evaluate.add_argument("--run-id", help="log the results to this MLflow run")
    evaluate.add_argument(
        "--storage",
        default="runs/train",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    evaluate.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> None:
    from mhf_dist.eval.tasks import run_task
    from mhf_dist.export import load_exported
    from mhf_dist.tables import markdown_table

    exported = load_exported(args.model)
    results = run_task(
        exported, args.task, args.data, args.limit, args.seq_len, args.layer, batch_size=args.batch_size
    )
    print(markdown_table([{"task": args.task, **results}], ["task", *results]))
    if args.task in ("ppl", "bpb"):
        print(f"scored in windows of {args.seq_len} tokens, no context carried across windows")
    if args.run_id:
        from mhf_dist.tracking import log_metrics, tracking_uri

        log_metrics(
            tracking_uri(args.storage), args.run_id, {f"eval.{args.task}.{k}": v for k, v in results.items()}
        )
        print(f"logged to MLflow run {args.run_id}")


def add_import_hf_parser(commands: argparse._SubParsersAction) -> None:
    importer = commands.add_parser(
        "import-hf", help="a reference MHF or transformers Qwen3 checkpoint -> an exported mhf-dist model"
    )
    importer.add_argument(
        "source", help="a Hugging Face checkpoint directory (config.json, safetensors): a path or a URI"
    )
    importer.add_argument("--out", required=True, help="the exported model directory to create (path or URI)")
    importer.set_defaults(func=cmd_import_hf)


def cmd_import_hf(args: argparse.Namespace) -> None:
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
    exporter.add_argument("model", help="an exported model directory (a checkpoint's model/): path or URI")
    exporter.add_argument("--out", required=True, help="the Hugging Face directory to create (path or URI)")
    exporter.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors shard: bytes or a size such as 500MB (default: 5GB, the Hub's convention)",
    )
    exporter.set_defaults(func=cmd_export_hf)


def cmd_export_hf(args: argparse.Namespace) -> None:
    from mhf_dist.hf_layout import export_hf

    print(f"wrote {export_hf(args.model, args.out, args.max_shard_size)}")


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="stream tokens from an exported model")
    gen.add_argument("--model", required=True, help="an exported model directory: a path or s3:// gs://")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, help="seed for reproducible sampling")
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> None:
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
    generated: list[int] = []
    shown = ""
    print(args.prompt, end="", flush=True)
    for token in generate(exported.model, prompt, args.max_new_tokens, sampling, stop_ids=[tokenizer.eos_id]):
        generated.append(token)
        text = tokenizer.decode(prompt + generated)[len(tokenizer.decode(prompt)) :]
        print(text[len(shown) :], end="", flush=True)
        shown = text
    print()


def add_demo_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="train mhf and Qwen3 baselines small on the built-in corpus")
    _add_config_args(demo)
    demo.add_argument("--workdir", default="runs/demo", help="where results are written (default: runs/demo)")
    demo.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds per family (default: 0 1)")
    _add_topology_flags(demo, "workers")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> None:
    from mhf_dist.demo import run_demo

    run_demo(args.config, config_overrides(args), Path(args.workdir), seeds=args.seeds, verbose=args.verbose)


def add_sweep_parser(commands: argparse._SubParsersAction) -> None:
    sweep = commands.add_parser("sweep", help="matched-baseline, seed or grid sweeps on Ray Tune")
    sweep.add_argument("--config", required=True, help="the sweep YAML file (see README: Sweeps)")
    sweep.add_argument(
        "--resume", action="store_true", help="finish an interrupted sweep; keeps finished trials"
    )
    _add_set_arg(sweep, "a config override for every trial, on top of the file's set:")
    sweep.add_argument("--storage", help="where the sweep, its trials and MLflow live (default: the file's)")
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
    print(comparison.table)
    print(f"tables and plots: {result.directory / 'compare'}; MLflow parent run {result.parent_run_id}")
    print(f"MLflow UI: {browse_hint(result.tracking_uri, spec.experiment)}")


def add_compare_parser(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser("compare", help="compare runs across seeds from MLflow: table, CSV, plots")
    compare.add_argument("--experiment", default="mhf-sweeps", help="MLflow experiment (default: mhf-sweeps)")
    compare.add_argument("--sweep", help="a sweep's parent run id: only its trials, results logged to it")
    compare.add_argument("--metric", default="val_nll", help="the metric compared (default: val_nll)")
    compare.add_argument(
        "--group-by",
        action="append",
        metavar="KEY",
        help="group by this MLflow param or tag, e.g. topology.zero_stage or model.family (repeatable; "
        "default: the sweep's group tag, else the family)",
    )
    compare.add_argument(
        "--storage",
        default="runs/sweeps",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    compare.add_argument(
        "--out", help="output directory or bucket URI (default: <storage>/compare/<sweep or experiment>)"
    )
    compare.add_argument(
        "--unstable-cv", type=float, default=0.05, help="coefficient of variation flagged unstable"
    )
    compare.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> None:
    from mhf_dist.compare import compare_runs
    from mhf_dist.storage import Location
    from mhf_dist.tracking import browse_hint, tracking_uri

    uri = tracking_uri(args.storage)
    out = args.out or Location.of(args.storage) / "compare" / (args.sweep or args.experiment)
    comparison = compare_runs(
        uri, args.experiment, out, args.metric, args.sweep, args.unstable_cv, args.group_by or ()
    )
    print(comparison.table)
    print(f"written: {', '.join(str(path) for path in comparison.files)}")
    print(f"MLflow UI: {browse_hint(uri, args.experiment)}")


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    planner = commands.add_parser(
        "plan", help="per-GPU memory at ZeRO 0-3, stage, micro-batch and days for a cluster"
    )
    _add_config_args(planner, default="1b")
    planner.add_argument(
        "--family", action="append", help="mhf | qwen3 | qwen3_matched (repeatable; default: mhf and qwen3)"
    )
    planner.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    planner.add_argument("--gpu-mem-gb", type=float, required=True, help="memory of one GPU in GiB")
    planner.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    planner.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    planner.add_argument(
        "--micro-batch",
        type=int,
        help="sequences per GPU per forward (default: recommended)",
    )
    planner.add_argument(
        "--vocab",
        type=int,
        action="append",
        help=f"vocabulary size (repeatable; default: the config's model.vocab_size and {QWEN3_VOCAB})",
    )
    planner.add_argument(
        "--tokens", type=float, help="training tokens (default: the config's steps x batch x seq_len)"
    )
    planner.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default: 0.4)")
    planner.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 peak per GPU (default: 989, H100/H200)"
    )
    planner.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from mhf_dist.plan import Cluster, plan, plan_rows
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


def add_submit_parser(commands: argparse._SubParsersAction) -> None:
    submit = commands.add_parser(
        "submit",
        help="submit a job spec to a Ray cluster through the Jobs API",
        usage="mhf submit SPEC [options] [-- ARGS appended to the spec's entrypoint]",
    )
    submit.add_argument("spec", help="a job spec YAML, e.g. jobs/pretrain.job.yaml")
    submit.add_argument(
        "--address", default=DEFAULT_ADDRESS, help=f"the cluster's dashboard (default: {DEFAULT_ADDRESS})"
    )
    submit.add_argument(
        "--wait", action="store_true", help="stream the job's logs and exit with its status (0: SUCCEEDED)"
    )
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="set a variable the spec names"
    )
    submit.add_argument("--submission-id", help="the job's id (default: Ray picks one)")
    submit.set_defaults(func=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    from mhf_dist.submit import follow_job, job_message, load_job_spec, submit_job

    spec = load_job_spec(args.spec)
    env = dict(split_assignment(item, "--env", "MHF_STORAGE=/shared/mhf") for item in args.env)
    client, job_id = submit_job(spec, args.address, args.extra, env, args.submission_id)
    print(f"submitted job {job_id} to {args.address}", flush=True)
    if not args.wait:
        print(f"follow it: ray job logs --address {args.address} --follow {job_id}")
        return 0
    try:
        status = follow_job(client, job_id, lambda text: print(text, end="", flush=True))
    except KeyboardInterrupt:
        print(f"\nstopped following; the job goes on (ray job stop --address {args.address} {job_id})")
        return 130
    message = job_message(client, job_id)
    print(f"job {job_id} {status}" + (f": {message}" if message else ""), file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def add_cluster_parser(commands: argparse._SubParsersAction) -> None:
    cluster = commands.add_parser(
        "cluster", help="start or stop a local multi-node Ray cluster (head + workers on 127.0.0.1)"
    )
    cluster.add_argument("action", choices=["start", "stop"])
    cluster.add_argument("--dir", default="runs/cluster", help="state and node logs (default: runs/cluster)")
    cluster.add_argument("--workers", type=int, default=1, help="worker nodes beside the head (default: 1)")
    cluster.add_argument("--cpus-per-node", type=int, default=2, help="logical CPUs per node (default: 2)")
    cluster.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default: 0)")
    cluster.add_argument(
        "--dashboard-port", type=int, default=8265, help="Jobs API and dashboard port (default: 8265)"
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhf", description="Train hash-based language models on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_parser in SUB_COMMANDS:
        add_parser(commands)
    return parser


def _terminated(signum: int, frame: object) -> None:
    raise Interrupted(
        "SIGTERM; rerun the command to start again (`mhf sweep --resume` keeps finished trials)", 143
    )


def _print_logs_hint(stream: TextIO) -> None:
    """A command that ran Ray ends by saying where what it kept off the console is."""
    if hint := logs_hint():
        print(hint, file=stream)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = build_parser()
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if extra and args.command != "submit":
        parser.error("arguments after -- are for `mhf submit` only")
    args.extra = extra
    previous = signal.signal(signal.SIGTERM, _terminated)  # unwinds like Ctrl-C: staging removed
    try:
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
    except Interrupted as err:
        _print_logs_hint(sys.stderr)
        print(f"interrupted: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as err:
        stop = _interruption_behind(err)
        if stop is None:
            raise
        # A library's clean-up (Ray Data's, say) failed while the interrupt unwound through it.
        print(f"interrupted: {stop}", file=sys.stderr)
        return stop.exit_code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interruption_behind(err: BaseException) -> Interrupted | None:
    """The `Interrupted` that `err` was raised while handling, if any."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, Interrupted):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
