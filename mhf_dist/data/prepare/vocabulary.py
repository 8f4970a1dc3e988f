"""The tokenizer the shards are cut with (named, or a BPE learned from the corpus) and the signature
table they carry (built by model.hash, or an exported model's)."""

from __future__ import annotations

from collections.abc import Iterator

from mhf_dist.config import Config
from mhf_dist.data.corpus import CorpusFile, read_documents
from mhf_dist.data.mixture import Source
from mhf_dist.data.shards import TOKENIZER_FILE, is_validation
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import DataError
from mhf_dist.signatures import SignatureTable, build_for_config, load_table
from mhf_dist.storage import Location, local_copy, redact


def named_tokenizer(cfg: Config) -> TextTokenizer:
    """The tokenizer `data.tokenizer` names when it is not learned from the corpus."""
    return _check_vocab_size(cfg, TextTokenizer.resolve(cfg.data.tokenizer, cfg.model.vocab_size, []))


def _check_vocab_size(cfg: Config, tokenizer: TextTokenizer) -> TextTokenizer:
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
            f"set --set model.vocab_size={tokenizer.vocab_size}"
        )
    return tokenizer


def learned_tokenizer(
    cfg: Config, work: Location, sources: list[Source], files: list[list[CorpusFile]]
) -> TextTokenizer:
    """The BPE learned from every source's training documents, or the one a resumed run learned."""
    saved = work / TOKENIZER_FILE
    if saved.is_file():
        return TextTokenizer.load(local_copy(saved))
    val_percent = cfg.data.val_percent
    documents = [0] * len(sources)  # each source's, held out or not
    learned_from = 0

    def training_texts() -> Iterator[str]:
        nonlocal learned_from
        for index, (source, source_files) in enumerate(zip(sources, files, strict=True)):
            for file in source_files:
                for batch in read_documents(file, source.text_field):
                    for text in batch["text"].to_pylist():
                        documents[index] += 1
                        if not is_validation(text, val_percent):
                            learned_from += 1
                            yield text

    learned = TextTokenizer.train_bpe(training_texts(), cfg.model.vocab_size)
    for source, count in zip(sources, documents, strict=True):
        if count == 0:  # a BPE learned from nothing has the bytes alone: not a vocab_size to advise
            raise no_text(source)
    if learned_from == 0:
        raise DataError(
            f"all {sum(documents)} documents are held out for validation (data.val_percent={val_percent:g}), "
            "none is left to learn the BPE from; use more text or a smaller data.val_percent"
        )
    return _check_vocab_size(cfg, learned)


def no_text(source: Source) -> DataError:
    return DataError(
        f"corpus {redact(source.corpus)!r} holds no text; pass a corpus with at least one document"
    )


def given_table(cfg: Config) -> SignatureTable:
    """The table `data.signatures` names (a model's: the one its config.json records), checked against
    model.hash."""
    path = Location.of(cfg.data.signatures)
    if path.is_dir():
        from mhf_dist.export import exported_table, read_export_config  # imports torch: for a model only

        table = exported_table(path, read_export_config(path))
    else:
        table = load_table(path)
    fix = "set model.hash to the model's, or prepare without data.signatures"
    table.check_follows(cfg.model.hash, f"data.signatures {str(path)!r}", DataError, fix)
    return table


def signature_table(
    cfg: Config, tokenizer: TextTokenizer, given: SignatureTable | None = None
) -> SignatureTable:
    """The table `data.signatures` names (`given`, when `given_table` has loaded it already), checked to be
    the tokenizer's vocabulary's; else a new one."""
    if cfg.data.signatures is None:
        return build_for_config(cfg.model.hash, tokenizer.vocabulary(), tokenizer.pad_token)
    table = given or given_table(cfg)
    difference = table.vocabulary_difference(tokenizer.vocabulary())
    if difference is not None:
        raise DataError(
            f"data.signatures {str(Location.of(cfg.data.signatures))!r} is the table of another vocabulary "
            f"than the tokenizer's ({difference}); set data.tokenizer to that model's tokenizer.json"
        )
    return table


def check_model_documents(cfg: Config, document_format: str) -> None:
    """Shards for the exported model `data.signatures` names are framed as its training documents."""
    if cfg.data.signatures:
        from mhf_dist.export import check_documents_fit  # imports torch (2-3 s): only when it is needed

        check_documents_fit(
            cfg.data.signatures, document_format, f"corpus {redact(cfg.data.corpus)!r} as prepared"
        )
