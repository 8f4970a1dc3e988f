"""The paper's vocabulary-expansion experiment at small scale: an English model grows Arabic, Chinese and
Hindi tokens and continues pretraining on mixed text.

1. English: WikiText-2 raw (valid split, from ../shared/data) or the built-in corpus, a BPE of
   model.vocab_size tokens; `mhf` and `qwen3` train on it with `mhf train` (Ray Train + DeepSpeed).
2. New tokens: --new-tokens BPE tokens learned from the Arabic, Chinese and Hindi training text (XQuAD
   contexts and questions), appended to the English tokenizer (every old id keeps its string).
3. Continued pretraining: each family continues on English + the three languages with `mhf cpt`'s code,
   with the authors' recipe by default (HUIYINXUE/MHF main_ve.py: only decoder layers 0, 1, -2, -1, the
   final norm, the token tables/head and mhf's hash I/O train; --trainable all trains everything), the
   baseline's new rows at the mean of their old pieces (--init-new-rows), and optionally a replayed share
   of the English pretraining corpus (--replay-fraction, default 0).
4. Report: per language, exact NLL per token and bits per UTF-8 byte (comparable across the two
   tokenizers) on held-out PUD sentences, before and after; parameters added (mhf 0, qwen3 dV x d) and
   trained; then the mean and spread over the seeds.

    python jobs/cpt_multilingual.py                      # tiny models, 3 seeds (see README for the time)
    python jobs/cpt_multilingual.py --seeds 0 --trainable all --replay-fraction 0.25
    python jobs/cpt_multilingual.py --preset 100m --base-steps 5000 --cpt-steps 2000 --workers 8
    ray job submit --working-dir . -- python jobs/cpt_multilingual.py ...   # on a Ray cluster

The English parents (`<family>-english-<preset>-L<layers>-s<steps>-seed<seed>`) are trained once and
reused by every setting; a rerun with the same settings skips the finished (family, seed) pairs.
Results: <workdir>/results.json and Markdown tables on stdout; every run is in MLflow (<workdir>/mlflow.db).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import statistics
import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from mhf_dist.config import load_config
from mhf_dist.cpt import INIT_NEW_ROWS, run_cpt
from mhf_dist.data.prepare import prepare
from mhf_dist.eval.perplexity import text_scores
from mhf_dist.export import load_exported
from mhf_dist.files import write_json_atomic
from mhf_dist.storage import Location
from mhf_dist.tables import markdown_table
from mhf_dist.train.checkpoints import MODEL_DIR, checkpoint_step, newest_checkpoint
from mhf_dist.train.ray_trainer import TrainOptions, train

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
NEW_LANGUAGES = ("ar", "zh", "hi")
HELD_OUT_LINES = 200
ROW_COLUMNS = [
    "family",
    "seed",
    "setting",
    "trainable",
    "replay_realised",
    "init_new_rows",
    "language",
    "bpb_before",
    "bpb_after",
    "nll_before",
    "nll_after",
    "tokens_before",
    "tokens_after",
    "vocab",
    "params_added",
    "trainable_params",
    "total_params",
    "seconds",
]


def lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def language_texts(shared: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(training text, held-out text) per language: XQuAD to train on, PUD sentences to evaluate."""
    train_text, held_out = {}, {}
    for language in (*NEW_LANGUAGES, "en"):
        folder = shared / "multilingual" / language
        train_text[language] = lines(folder / f"xquad.{language}.contexts.txt") + lines(
            folder / f"xquad.{language}.questions.txt"
        )
        held_out[language] = lines(folder / f"{language}_pud-ud-test.txt")[:HELD_OUT_LINES]
    return train_text, held_out


def scores(model_dir: Path, held_out: dict[str, list[str]], seq_len: int) -> dict[str, dict[str, float]]:
    exported = load_exported(model_dir)
    return {
        language: text_scores(
            exported.model, exported.tokenizer, texts, seq_len, document_format=exported.document_format
        )
        for language, texts in held_out.items()
    }


def english_parent(family_cfg, name: str) -> Path:
    """The English model: the newest checkpoint of run `name` if it was trained before, else trained now."""
    existing = newest_checkpoint(Path(family_cfg.topology.storage) / name)
    if existing is not None and checkpoint_step(existing) == family_cfg.train.steps:
        print(f"{name}: reusing {existing}")
        return existing / MODEL_DIR
    options = TrainOptions(name=name, continue_run=existing is not None)  # continues an interrupted one
    return train(family_cfg, options).checkpoint / MODEL_DIR


def summary(results: list[dict]) -> list[dict]:
    """Mean and spread (min-max) over seeds of bits/byte after cpt, per family, language and setting."""
    keys = ("family", "setting", "trainable", "replay_realised", "init_new_rows", "language")
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        groups.setdefault(tuple(row[key] for key in keys), []).append(row)
    rows = []
    for group, members in groups.items():
        after = [row["bpb_after"] for row in members]
        rows.append(
            {
                **dict(zip(keys, group, strict=True)),
                "seeds": len(members),
                "bpb_before": statistics.mean(row["bpb_before"] for row in members),
                "bpb_after": statistics.mean(after),
                "bpb_after_spread": max(after) - min(after),
                "trained_params": members[0]["trainable_params"],
                "params_added": members[0]["params_added"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--families", nargs="+", default=["mhf", "qwen3"])
    parser.add_argument(
        "--layers",
        type=int,
        default=6,
        help="decoder layers (model.backbone.num_layers; default 6: with tiny's 2, layers 0, 1, -2, -1 are "
        "all of them and the authors' split freezes nothing)",
    )
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--cpt-steps", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=512, help="BPE tokens learned from ar+zh+hi")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="train.seed of each repeat")
    parser.add_argument(
        "--trainable",
        choices=["authors", "all"],
        default="authors",
        help="cpt trains the authors' split (layers 0, 1, -2, -1, norm, tables, hash I/O) or everything",
    )
    parser.add_argument(
        "--replay-fraction",
        type=float,
        default=0.0,
        help="share of the cpt training tokens replayed from the English pretraining corpus",
    )
    parser.add_argument("--init-new-rows", choices=INIT_NEW_ROWS, default="subword")
    parser.add_argument("--workdir", type=Path, default=Path("runs/jobs/cpt-multilingual"))
    parser.add_argument("--shared", type=Path, default=SHARED, help="the shared data directory")
    args = parser.parse_args()
    if not (args.shared / "multilingual").is_dir():
        parser.error(
            f"{args.shared / 'multilingual'} is missing; pass --shared with the shared data directory"
        )

    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    wiki = args.shared / "wikitext-2-raw" / "wiki.valid.raw"
    english = str(wiki) if wiki.is_file() else "builtin"
    train_text, held_out = language_texts(args.shared)
    topology = {"topology.workers": args.workers, "topology.storage": str(workdir / "runs")}
    base_overrides = {
        "data.corpus": english,
        "data.path": str(workdir / "english"),
        "train.steps": args.base_steps,
        "model.backbone.num_layers": args.layers,
        **topology,
    }
    base = load_config(args.preset, base_overrides)
    if not (workdir / "english" / "manifest.json").is_file():
        prepare(base, base.data.path)

    mixed_texts = [text for texts in train_text.values() for text in texts]
    mixed = workdir / "mixed.jsonl"
    Location.of(mixed).write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in mixed_texts)
    )
    setting = f"{args.trainable}-r{args.replay_fraction:g}-{args.init_new_rows}"
    cpt_overrides = {"data.corpus": str(mixed), "train.steps": args.cpt_steps, **topology}
    if args.trainable == "all":
        cpt_overrides["train.trainable"] = []  # unset (null) is the authors' split
    if args.replay_fraction > 0:
        cpt_overrides |= {"data.replay.corpus": english, "data.replay.fraction": args.replay_fraction}
    # Results of every cpt setting (trainable, replay, init) over the same parents share one file.
    per_setting = ("seeds", "trainable", "replay_fraction", "init_new_rows")
    settings = {k: str(v) for k, v in vars(args).items() if k not in per_setting}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]  # run names
    results_file = workdir / "results.json"
    previous = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results = previous.get("results", []) if previous.get("args") == settings else []
    done = {(row["family"], row.get("seed", 0), row.get("setting")) for row in results}
    for seed, family in itertools.product(args.seeds, args.families):
        if (family, seed, setting) in done:
            print(f"{family} seed {seed} {setting}: found in {results_file}; not run again")
            continue
        started = time.perf_counter()
        family_cfg = load_config(args.preset, {**base_overrides, "train.seed": seed, "model.family": family})
        parent_name = f"{family}-english-{args.preset}-L{args.layers}-s{args.base_steps}-seed{seed}"
        parent = english_parent(family_cfg, parent_name)
        before = scores(parent, held_out, base.train.seq_len)

        cpt_cfg = load_config(args.preset, {**cpt_overrides, "train.seed": seed})
        cpt = run_cpt(
            cpt_cfg,
            str(parent),
            lambda old: old.with_trained_tokens(
                [text for language in NEW_LANGUAGES for text in train_text[language]], args.new_tokens
            ),
            TrainOptions(name=f"{family}-cpt-{setting}-{digest}-seed{seed}"),
            init_new_rows=args.init_new_rows,
        )
        after = scores(cpt.train_result.checkpoint / MODEL_DIR, held_out, base.train.seq_len)
        tags = MlflowClient(cpt.train_result.tracking_uri).get_run(cpt.train_result.run_id).data.tags
        seconds = time.perf_counter() - started
        for language in held_out:
            results.append(
                {
                    "family": family,
                    "seed": seed,
                    "setting": setting,
                    "trainable": tags["cpt_trainable"],
                    "replay_realised": round(float(tags["cpt_replay_fraction"]), 4),
                    "init_new_rows": cpt.expansion.init_new_rows,
                    "language": language,
                    "bpb_before": before[language]["bits_per_byte"],
                    "bpb_after": after[language]["bits_per_byte"],
                    "nll_before": before[language]["val_nll"],
                    "nll_after": after[language]["val_nll"],
                    "tokens_before": before[language]["val_tokens"],
                    "tokens_after": after[language]["val_tokens"],
                    "vocab": f"{cpt.expansion.old_vocab_size}->{cpt.expansion.config.vocab_size}",
                    "params_added": cpt.expansion.params_added,
                    "trainable_params": int(tags["trainable_params"]),
                    "total_params": int(tags["total_params"]),
                    "seconds": round(seconds),  # this (family, seed): parent, scoring, cpt
                }
            )
        payload = {"args": settings, "english": english, "results": results, "summary": summary(results)}
        write_json_atomic(results_file, payload)  # after each run: a rerun skips what is done
    print(markdown_table(results, ROW_COLUMNS))  # results.json keeps its keys sorted
    print()
    print("mean over seeds (bits/byte on held-out PUD sentences; spread = max - min):")
    rows = summary(results)
    print(markdown_table(rows, list(rows[0])))
    print(f"wrote {results_file}")


if __name__ == "__main__":
    main()
