"""The paper's vocabulary-expansion experiment at small scale: an English model grows Arabic, Chinese and
Hindi tokens and continues pretraining on mixed text.

1. English: WikiText-2 raw (valid split, from ../shared/data) or the built-in corpus, a BPE of
   model.vocab_size tokens; `mhf` and `qwen3` train on it with `mhf train` (Ray Train + DeepSpeed).
2. New tokens: --new-tokens BPE tokens learned from the Arabic, Chinese and Hindi training text (XQuAD
   contexts and questions), appended to the English tokenizer (every old id keeps its string).
3. Continued pretraining: each family continues on English + the three languages with `mhf cpt`'s code.
4. Report: per language, exact NLL per token and bits per UTF-8 byte (comparable across the two
   tokenizers) on held-out PUD sentences, before and after; parameters added (mhf 0, qwen3 dV x d).

    python jobs/cpt_multilingual.py                      # tiny models, a few minutes on 2 CPUs
    python jobs/cpt_multilingual.py --seeds 0 1 2        # three seeds (a rerun skips the finished ones)
    python jobs/cpt_multilingual.py --preset 100m --base-steps 5000 --cpt-steps 2000 --workers 8
    ray job submit --working-dir . -- python jobs/cpt_multilingual.py ...   # on a Ray cluster

Results: <workdir>/results.json and a Markdown table on stdout; every run is in MLflow (<workdir>/mlflow.db).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from pathlib import Path

from mhf_dist.config import load_config
from mhf_dist.cpt import run_cpt
from mhf_dist.data.prepare import prepare
from mhf_dist.eval.perplexity import text_scores
from mhf_dist.export import load_exported
from mhf_dist.files import write_json_atomic, write_text_atomic
from mhf_dist.tables import markdown_table
from mhf_dist.train.checkpoints import MODEL_DIR
from mhf_dist.train.ray_trainer import TrainOptions, train

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
NEW_LANGUAGES = ("ar", "zh", "hi")
HELD_OUT_LINES = 200


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
        language: text_scores(exported.model, exported.tokenizer, texts, seq_len)
        for language, texts in held_out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--families", nargs="+", default=["mhf", "qwen3"])
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--cpt-steps", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=512, help="BPE tokens learned from ar+zh+hi")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each repeat")
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
    base_overrides = [f"data.corpus={english}", f"data.path={workdir / 'english'}"]
    base_overrides.append(f"train.steps={args.base_steps}")
    base = load_config(args.preset, base_overrides)
    if not (workdir / "english" / "manifest.json").is_file():
        prepare(base, base.data.path)

    mixed_texts = [text for texts in train_text.values() for text in texts]
    mixed = write_text_atomic(
        workdir / "mixed.jsonl",
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in mixed_texts),
    )
    settings = {k: str(v) for k, v in vars(args).items() if k != "seeds"}
    results_file = workdir / "results.json"
    previous = json.loads(results_file.read_text()) if results_file.is_file() else {}
    results = previous.get("results", []) if previous.get("args") == settings else []
    done = {(row["family"], row.get("seed", 0)) for row in results}
    for seed, family in itertools.product(args.seeds, args.families):
        if (family, seed) in done:
            print(f"{family} seed {seed}: found in {results_file}; not run again")
            continue
        seeded = [f"train.seed={seed}"]
        family_cfg = load_config(args.preset, [*base_overrides, *seeded, f"model.family={family}"])
        options = TrainOptions(workers=args.workers, storage=str(workdir / "runs"))
        parent = (
            train(family_cfg, dataclasses.replace(options, name=f"{family}-english-seed{seed}")).checkpoint
            / MODEL_DIR
        )
        before = scores(parent, held_out, base.train.seq_len)

        cpt_cfg = load_config(args.preset, [f"data.corpus={mixed}", f"train.steps={args.cpt_steps}", *seeded])
        cpt = run_cpt(
            cpt_cfg,
            str(parent),
            lambda old: old.with_trained_tokens(
                [text for language in NEW_LANGUAGES for text in train_text[language]], args.new_tokens
            ),
            dataclasses.replace(options, name=f"{family}-cpt-seed{seed}"),
        )
        after = scores(cpt.train_result.checkpoint / MODEL_DIR, held_out, base.train.seq_len)
        for language in held_out:
            results.append(
                {
                    "family": family,
                    "seed": seed,
                    "language": language,
                    "bpb_before": before[language]["bits_per_byte"],
                    "bpb_after": after[language]["bits_per_byte"],
                    "nll_before": before[language]["val_nll"],
                    "nll_after": after[language]["val_nll"],
                    "tokens_before": before[language]["val_tokens"],
                    "tokens_after": after[language]["val_tokens"],
                    "vocab": f"{cpt.expansion.old_vocab_size}->{cpt.expansion.config.vocab_size}",
                    "params_added": cpt.expansion.params_added,
                }
            )
        payload = {"args": settings, "english": english, "results": results}
        write_json_atomic(results_file, payload)  # after each run: a rerun skips what is done
    print(markdown_table(results, list(results[0])))
    print(f"wrote {results_file}")


if __name__ == "__main__":
    main()
