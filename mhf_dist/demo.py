"""`mhf demo`: the whole flow, small, on the built-in corpus and local Ray.

Prepares the corpus in Ray tasks, runs a `matched` sweep on Ray Tune (`demo_groups` x seeds, each an
`mhf train` run on Ray Train workers), compares the runs from MLflow and samples from each group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mhf_dist.compare import COMPARE_DIR, Comparison
from mhf_dist.config import Config, Overrides, load_config, parse_overrides
from mhf_dist.data.prepare import prepare
from mhf_dist.errors import Resumable
from mhf_dist.export import load_exported
from mhf_dist.models.generation import Sampling, generate
from mhf_dist.models.registry import resolved_config
from mhf_dist.sweep.runner import TRIALS_DIR, compare_sweep, run_sweep
from mhf_dist.sweep.spec import expand_trials, parse_sweep
from mhf_dist.tracking import browse_hint
from mhf_dist.train.checkpoints import MODEL_DIR, newest_checkpoint

# mhf under the paper's objective and under the exact-vocabulary one (where a user should start), then
# the baselines: a group per entry.
MHF_OBJECTIVES = {"mhf_coordinates": "coordinates", "mhf_vocab": "vocab"}
BASELINES = ("qwen3", "qwen3_matched")
PROMPT = "The history of"
EVAL_PASSES = 8  # validation passes per trial unless train.eval_every is given: curves with a shape
PROGRESS_LINES = 4  # console lines per trial unless train.log_every is given: 8 trials fit on a screen
SAMPLING = {"temperature": 0.8, "top_k": 40}


def run_demo(
    config: str,
    overrides: Overrides,
    workdir: Path,
    seeds: Sequence[int] = (0, 1),
    log: Callable[[str], None] = print,
    verbose: bool = False,
) -> Comparison:
    """The demo on `config` with every trial's `overrides`, its data, sweep and comparison under `workdir`."""
    workdir = workdir.resolve()
    data_dir = workdir / "data"
    settings = {**parse_overrides(overrides), "data.path": str(data_dir)}
    cfg = load_config(config, settings)
    settings.setdefault("train.eval_every", max(1, cfg.train.steps // EVAL_PASSES))
    settings.setdefault("train.log_every", max(1, cfg.train.steps // PROGRESS_LINES))
    groups = demo_groups(cfg, log)
    started = time.monotonic()

    def stage(text: str) -> None:
        elapsed = int(time.monotonic() - started)
        log(f"{text} ({elapsed // 60}:{elapsed % 60:02d} so far)")

    spec = parse_sweep(
        {
            "name": time.strftime("demo-%Y%m%d-%H%M%S"),
            "kind": "matched",
            "config": config,
            "set": settings,
            "families": groups,
            "seeds": list(seeds),
            "storage": str(workdir / "sweeps"),
            "experiment": "mhf-demo",
        },
        "demo sweep",
    )
    # Every trial's config is checked above (parse_sweep), before the minutes of work.
    stage(f"[1/3] preparing corpus {cfg.data.corpus!r} on Ray -> {data_dir}")
    # Replaces an earlier demo's shards; a WORKDIR/data that is not ours is refused, never deleted.
    prepare(cfg, data_dir, overwrite=True, log=log, verbose=verbose, flag="--workdir")
    stage(
        f"[2/3] matched sweep on Ray Tune: {len(groups)} groups x seeds {list(seeds)}, "
        f"{cfg.topology.workers} Ray Train workers per trial"
    )
    try:
        result = run_sweep(spec, log=log, verbose=verbose)
    except Resumable as stop:  # the sweep's `--resume` is not the demo's
        raise Resumable(
            f"{stop} (sweep {spec.name!r}); the demo does not resume: a rerun prepares the data again and "
            "runs a new sweep",
            stop.exit_code,
            flag="",
            lead="rerun",
        ) from None

    stage("[3/3] comparing the runs from MLflow")
    out_dir = result.directory / COMPARE_DIR
    comparison = compare_sweep(spec, result)
    sampling = Sampling(**SAMPLING, seed=seeds[0])
    for trial in [trial for trial in expand_trials(spec) if trial.seed == seeds[0]]:
        checkpoint = newest_checkpoint(result.directory / TRIALS_DIR / trial.name)
        exported = load_exported(checkpoint / MODEL_DIR)
        prompt = exported.tokenizer.encode_batch([PROMPT])[0]
        tokens = list(generate(exported.model, prompt, max_new_tokens=24, sampling=sampling))
        sample = exported.tokenizer.decode(prompt + tokens)
        log(f"{trial.group} (seed {seeds[0]}, temperature {SAMPLING['temperature']}) sample: {sample!r}")
    log("\n" + comparison.report)
    log(
        f"{spec.metric}: exact validation NLL per token over the real vocabulary (mhf renormalised over "
        "V_actl); mean/std/min/max over seeds; param_residual: parameters minus mhf's; objective: what "
        "the group trains on (coordinates: the paper's sum of H B-way cross-entropies; vocab: the exact "
        "NLL over V, the one to start from; softmax: a V-way head's cross-entropy)"
    )
    log(f"tables and plots: {out_dir} (curves.png: {spec.metric}; loss.png: training loss)")
    stage("done")
    log(f"MLflow UI: {browse_hint(result.tracking_uri, spec.experiment)}")
    return comparison


def demo_groups(cfg: Config, log: Callable[[str], None]) -> list[str | dict[str, Any]]:
    """`mhf` under each objective, then the baselines (`qwen3_matched` where its layers are not `qwen3`'s)."""
    mhf = [
        {"group": group, "family": "mhf", "set": {"model.hash.loss": loss}}
        for group, loss in MHF_OBJECTIVES.items()
    ]
    model = cfg.model.model_copy(update={"family": "qwen3_matched"})
    layers = resolved_config(model).backbone.num_layers
    if layers != cfg.model.backbone.num_layers:
        return [*mhf, *BASELINES]
    log(f"qwen3_matched skipped: at this size its closest match has qwen3's own {layers} layers")
    return [*mhf, *(family for family in BASELINES if family != "qwen3_matched")]
