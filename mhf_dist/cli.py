"""The `mhf` command: parses arguments, loads the config, calls the library.

Every user mistake surfaces as one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mhf_dist.config import Config, load_config
from mhf_dist.errors import ConfigError, Interrupted, MhfError
from mhf_dist.submit import DEFAULT_ADDRESS

if TYPE_CHECKING:
    from mhf_dist.data.tokenizer import TextTokenizer
    from mhf_dist.train.ray_trainer import TrainOptions, TrainResult


PREPARE_HELP = "first prepare data.path from data.corpus unless it holds shards (for jobs)"
VERBOSE_HELP = "also show Ray Train's and Tune's own progress lines (by default only in Ray's session logs)"


def _add_config_args(parser: argparse.ArgumentParser, default: str = "tiny") -> None:
    parser.add_argument("--config", default=default, help=f"preset name or YAML file (default: {default})")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.steps=50 (repeatable)",
    )


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def cmd_config(args: argparse.Namespace) -> None:
    print(yaml.safe_dump(_config(args).model_dump(mode="json"), sort_keys=False), end="")


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


def cmd_prepare(args: argparse.Namespace) -> None:
    from mhf_dist.data.prepare import prepare

    flags = {"data.corpus": args.corpus, "data.tokenizer": args.tokenizer, "data.path": args.out}
    overrides = [f"{key}={value}" for key, value in flags.items() if value is not None]
    cfg = load_config(args.config, [*overrides, *args.overrides])
    prepare(cfg, cfg.data.path, overwrite=args.overwrite, num_cpus=args.num_cpus)


def cmd_verify_data(args: argparse.Namespace) -> None:
    from mhf_dist.data.shards import verify_shards

    print(f"{verify_shards(args.path)} shards in {args.path} match their manifest's sha256")


def cmd_train(args: argparse.Namespace) -> None:
    from mhf_dist.data.prepare import prepare_if_missing
    from mhf_dist.train.ray_trainer import train

    cfg = _config(args)
    if args.prepare:
        prepare_if_missing(cfg)
    result = train(cfg, _train_options(args))
    _print_result(result)


def _print_result(result: TrainResult) -> None:
    from mhf_dist.tables import markdown_table
    from mhf_dist.train.checkpoints import MODEL_DIR, read_history

    last = read_history(result.checkpoint)[-1:]
    columns = ["step", "loss", "val_nll", "val_ppl", "tokens_per_s", "peak_mem_gb"]
    print(markdown_table(last, [column for column in columns if column in last[0]]))
    print(f"last checkpoint: {result.checkpoint} (exported model: {result.checkpoint / MODEL_DIR})")
    print(f"MLflow run {result.run_id} at {result.tracking_uri}")


def cmd_cpt(args: argparse.Namespace) -> None:
    from mhf_dist.cpt import expanded_tokenizer, run_cpt
    from mhf_dist.data.corpus import corpus_texts

    replay = {"data.replay.corpus": args.replay, "data.replay.fraction": args.replay_fraction}
    flags = [f"{key}={value}" for key, value in replay.items() if value is not None]
    cfg = load_config(args.config, [*args.overrides, f"data.corpus={args.data}", *flags])

    def new_tokenizer(parent: TextTokenizer) -> TextTokenizer:
        texts = (lambda: corpus_texts(args.corpus, cfg.data.text_field)) if args.corpus else None
        return expanded_tokenizer(parent, args.tokenizer, args.add_tokens, args.train_new_tokens, texts)

    options = _train_options(args)
    result = run_cpt(cfg, args.parent, new_tokenizer, options, init_new_rows=args.init_new_rows)
    _print_result(result.train_result)


def cmd_eval(args: argparse.Namespace) -> None:
    from mhf_dist.eval.tasks import run_task
    from mhf_dist.export import load_exported
    from mhf_dist.tables import markdown_table

    exported = load_exported(args.model)
    data = Path(args.data) if args.data else None
    results = run_task(exported, args.task, data, args.limit, args.seq_len, args.layer)
    print(markdown_table([{"task": args.task, **results}], ["task", *results]))
    if args.task in ("ppl", "bpb"):
        print(f"scored in windows of {args.seq_len} tokens, no context carried across windows")
    if args.run_id:
        from mhf_dist.tracking import log_metrics, tracking_uri

        log_metrics(
            tracking_uri(args.storage), args.run_id, {f"eval.{args.task}.{k}": v for k, v in results.items()}
        )
        print(f"logged to MLflow run {args.run_id}")


def cmd_import_hf(args: argparse.Namespace) -> None:
    from mhf_dist.hf_layout import import_hf
    from mhf_dist.models import param_count

    exported = import_hf(args.source, args.out)
    cfg = exported.config
    io = f", {cfg.hash.spec} {cfg.hash.io} I/O, loss {cfg.hash.loss}" if cfg.family == "mhf" else ""
    print(
        f"imported {cfg.family} ({param_count(cfg):,} parameters, V={cfg.vocab_size:,}{io}) "
        f"from {args.source} to {exported.path}"
    )


def cmd_export_hf(args: argparse.Namespace) -> None:
    from mhf_dist.hf_layout import export_hf

    print(f"wrote {export_hf(args.model, args.out)}")


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


def cmd_demo(args: argparse.Namespace) -> None:
    from mhf_dist.demo import run_demo

    run_demo(
        args.config,
        args.overrides,
        Path(args.workdir),
        seeds=args.seeds,
        workers=args.workers,
        verbose=args.verbose,
    )


def cmd_sweep(args: argparse.Namespace) -> None:
    from mhf_dist.sweep.runner import compare_sweep, run_sweep
    from mhf_dist.sweep.spec import load_sweep, parse_sweep

    spec = load_sweep(args.config)
    # Values parsed as YAML, as config --set values are, so they match the file's own typed `set:`.
    overrides = {key: yaml.safe_load(value) for key, value in map(_key_value, args.overrides)}
    changed = {"set": {**spec.set, **overrides}, "storage": args.storage or spec.storage}
    spec = parse_sweep({**spec.model_dump(), **changed}, args.config)
    if args.prepare:
        from mhf_dist.data.prepare import prepare_if_missing
        from mhf_dist.sweep.spec import trial_configs

        for cfg in {cfg.data.path: cfg for cfg in trial_configs(spec).values()}.values():
            prepare_if_missing(cfg)
    result = run_sweep(spec, resume=args.resume, verbose=args.verbose)
    comparison = compare_sweep(spec, result)
    print(comparison.table)
    print(f"tables and plots: {result.directory / 'compare'}; MLflow parent run {result.parent_run_id}")


def cmd_compare(args: argparse.Namespace) -> None:
    from mhf_dist.compare import compare_runs
    from mhf_dist.tracking import tracking_uri

    uri = tracking_uri(args.storage)
    out = Path(args.out or Path(args.storage) / "compare" / (args.sweep or args.experiment))
    comparison = compare_runs(uri, args.experiment, out, args.metric, args.sweep, args.unstable_cv)
    print(comparison.table)
    print(f"written: {', '.join(str(path) for path in comparison.files)}")


def cmd_plan(args: argparse.Namespace) -> None:
    from mhf_dist.plan import Cluster, plan, plan_rows
    from mhf_dist.tables import markdown_table

    cfg = load_config(args.preset, args.overrides)
    seq_len = args.seq_len or cfg.train.seq_len
    tokens = args.tokens or cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
    cluster = Cluster(args.gpus, args.nodes, args.gpu_mem_gb, args.peak_tflops)
    plans = [
        plan(cfg, family, vocab, cluster, seq_len, args.micro_batch, tokens, args.mfu)
        for vocab in args.vocab or [32000, 151936]
        for family in args.family or ["mhf", "qwen3"]
    ]
    print(
        f"preset {cfg.preset or args.preset}, {cfg.model.hash.spec}, seq_len {seq_len}; "
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


def cmd_submit(args: argparse.Namespace) -> int:
    from mhf_dist.submit import follow_job, job_message, load_job_spec, submit_job

    spec = load_job_spec(args.spec)
    env = dict(_key_value(item, "--env") for item in args.env)
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


def _key_value(item: str, flag: str = "--set") -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"{flag} {item!r} is not KEY=VALUE")
    return key, value


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


def _add_train_options(parser: argparse.ArgumentParser, storage: str, name: str) -> None:
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers (default: 2)")
    parser.add_argument(
        "--gpus-per-worker", type=int, default=0, help="GPUs per worker; 0 trains on CPU in fp32"
    )
    parser.add_argument(
        "--zero-stage", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage"
    )
    parser.add_argument("--storage", default=storage, help=f"Ray Train storage path (default: {storage})")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhf", description="Train hash-based language models on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train mhf and Qwen3 baselines small on the built-in corpus")
    _add_config_args(demo)
    demo.add_argument("--workdir", default="runs/demo", help="where results are written (default: runs/demo)")
    demo.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds per family (default: 0 1)")
    demo.add_argument("--workers", type=int, default=2, help="Ray Train workers per trial (default: 2)")
    demo.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    demo.set_defaults(func=cmd_demo)

    sweep = commands.add_parser("sweep", help="matched-baseline, seed or grid sweeps on Ray Tune")
    sweep.add_argument("--config", required=True, help="the sweep YAML file (see README: Sweeps)")
    sweep.add_argument(
        "--resume", action="store_true", help="finish an interrupted sweep; keeps finished trials"
    )
    sweep.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every trial, on top of the file's set: (repeatable)",
    )
    sweep.add_argument("--storage", help="where the sweep, its trials and MLflow live (default: the file's)")
    sweep.add_argument("--prepare", action="store_true", help=PREPARE_HELP)
    sweep.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sweep.set_defaults(func=cmd_sweep)

    compare = commands.add_parser("compare", help="compare runs across seeds from MLflow: table, CSV, plots")
    compare.add_argument("--experiment", default="mhf-sweeps", help="MLflow experiment (default: mhf-sweeps)")
    compare.add_argument("--sweep", help="a sweep's parent run id: only its trials, results logged to it")
    compare.add_argument("--metric", default="val_nll", help="the metric compared (default: val_nll)")
    compare.add_argument(
        "--storage",
        default="runs/sweeps",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    compare.add_argument("--out", help="output directory (default: <storage>/compare/<sweep or experiment>)")
    compare.add_argument(
        "--unstable-cv", type=float, default=0.05, help="coefficient of variation flagged unstable"
    )
    compare.set_defaults(func=cmd_compare)

    prep = commands.add_parser(
        "prepare", help="tokenize, pack and sign a corpus into parquet shards on Ray Data"
    )
    _add_config_args(prep)
    prep.add_argument(
        "--corpus", help="builtin | file, directory or glob of .txt/.raw/.jsonl/.parquet | hf:NAME"
    )
    prep.add_argument(
        "--tokenizer", help="bpe | bytes | mistral-v0.3 | path to tokenizer.json (default: data.tokenizer)"
    )
    prep.add_argument("--out", help="output directory (default: data.path)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    prep.add_argument("--num-cpus", type=int, help="CPUs of a local Ray instance (default: all)")
    prep.set_defaults(func=cmd_prepare)

    verify = commands.add_parser(
        "verify-data", help="check every prepared shard against its manifest's sha256 (reads all the data)"
    )
    verify.add_argument("path", help="a prepared shard directory (mhf prepare --out)")
    verify.set_defaults(func=cmd_verify_data)

    fit = commands.add_parser("train", help="train on prepared shards with Ray Train + DeepSpeed ZeRO")
    _add_config_args(fit)
    _add_train_options(fit, storage="runs/train", name="mhf-train")
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
    cpt.add_argument("--data", required=True, help="the corpus training continues on (as data.corpus)")
    cpt.add_argument(
        "--init-new-rows",
        choices=["subword", "mean"],
        default="subword",
        help="a baseline's new embedding/head rows: mean of the token's old pieces' rows (the authors') "
        "or of all old rows (mhf adds no rows)",
    )
    cpt.add_argument("--replay", help="a corpus to replay (e.g. the parent's), as data.replay.corpus")
    cpt.add_argument(
        "--replay-fraction",
        type=float,
        help="share of the training tokens from --replay (data.replay.fraction, default 0)",
    )
    _add_train_options(cpt, storage="runs/cpt", name="mhf-cpt")
    cpt.set_defaults(func=cmd_cpt)

    evaluate = commands.add_parser(
        "eval", help="evaluate an exported model: ppl, bpb, lambada, hellaswag, card660"
    )
    evaluate.add_argument(
        "--model", required=True, help="an exported model directory (a checkpoint's model/)"
    )
    evaluate.add_argument("--task", required=True, help="ppl | bpb | lambada | hellaswag | card660 | recall")
    evaluate.add_argument("--data", help="the task's local file (see README); recall generates its own")
    evaluate.add_argument("--limit", type=int, default=0, help="first N examples only (default: all)")
    evaluate.add_argument("--seq-len", type=int, default=128, help="window length for ppl and bpb")
    evaluate.add_argument("--layer", type=int, default=-2, help="card660: hidden-state layer (default: -2)")
    evaluate.add_argument("--run-id", help="log the results to this MLflow run")
    evaluate.add_argument(
        "--storage",
        default="runs/train",
        help="where the embedded MLflow lives, unless MLFLOW_TRACKING_URI is set",
    )
    evaluate.set_defaults(func=cmd_eval)

    importer = commands.add_parser(
        "import-hf", help="a reference MHF or transformers Qwen3 checkpoint -> an exported mhf-dist model"
    )
    importer.add_argument("source", help="a Hugging Face checkpoint directory (config.json, safetensors)")
    importer.add_argument("--out", required=True, help="the exported model directory to create")
    importer.set_defaults(func=cmd_import_hf)
    exporter = commands.add_parser(
        "export-hf", help="an exported model -> the reference layout (mhf) or a transformers Qwen3 directory"
    )
    exporter.add_argument("model", help="an exported model directory (a checkpoint's model/)")
    exporter.add_argument("--out", required=True, help="the Hugging Face directory to create")
    exporter.set_defaults(func=cmd_export_hf)

    gen = commands.add_parser("generate", help="stream tokens from an exported model")
    gen.add_argument("--model", required=True, help="an exported model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, help="seed for reproducible sampling")
    gen.set_defaults(func=cmd_generate)

    show = commands.add_parser("config", help="print the resolved config as YAML")
    _add_config_args(show)
    show.set_defaults(func=cmd_config)

    count = commands.add_parser("count", help="analytic parameters and FLOPs of every family for a config")
    _add_config_args(count)
    count.set_defaults(func=cmd_count)

    planner = commands.add_parser(
        "plan", help="per-GPU memory at ZeRO 0-3, stage, micro-batch and days for a cluster"
    )
    planner.add_argument("--preset", default="1b", help="preset name or config YAML (default: 1b)")
    planner.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    planner.add_argument(
        "--family", action="append", help="mhf | qwen3 | qwen3_matched (repeatable; default: mhf and qwen3)"
    )
    planner.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    planner.add_argument("--gpu-mem-gb", type=float, required=True, help="memory of one GPU in GiB")
    planner.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    planner.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    planner.add_argument(
        "--micro-batch",
        type=int,
        help="sequences per GPU per forward (default: recommended)",
    )
    planner.add_argument(
        "--vocab", type=int, action="append", help="vocabulary size (repeatable; default: 32000 and 151936)"
    )
    planner.add_argument(
        "--tokens", type=float, help="training tokens (default: the preset's steps x batch x seq_len)"
    )
    planner.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation (default: 0.4)")
    planner.add_argument(
        "--peak-tflops", type=float, default=989.0, help="bf16 peak per GPU (default: 989, H100/H200)"
    )
    planner.set_defaults(func=cmd_plan)

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
    return parser


def _terminated(signum: int, frame: object) -> None:
    raise Interrupted(
        "SIGTERM; rerun the command to start again (`mhf sweep --resume` keeps finished trials)", 143
    )


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
        return args.func(args) or 0
    except MhfError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:
        print(f"interrupted: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted (SIGINT)", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
