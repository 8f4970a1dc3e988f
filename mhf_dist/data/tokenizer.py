"""Tokenizers (any `tokenizer.json`, Mistral-7B-v0.3's, a trained byte-level BPE, raw bytes), all
`tokenizers.Tokenizer` objects that save as the `tokenizer.json` shards and models carry.

A document's boundary tokens follow the tokenizer (`document_format`): `bos` documents are `<s> text`
(a tokenizer whose default special tokens put a BOS first, e.g. Mistral's); `eos` documents are
`text EOS` (e.g. byte-level BPEs and raw bytes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers, trainers

from mhf_dist.data.recall import recall_vocabulary
from mhf_dist.errors import DataError, first_line
from mhf_dist.readers import read_text
from mhf_dist.storage import Location

EOS = "<|endoftext|>"
EOS_CANDIDATES = (EOS, "</s>", "<eos>")
BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]")
BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>")
UNK_TOKENS = ("<unk>", "[UNK]", "<|unk|>")  # a word-level tokenizer with one of these may meet unknown words
SHOWN_WORDS = 5  # unknown words an error names
DOCUMENT_FORMATS = ("bos", "eos")
LEGACY_FORMAT = "eos"  # what manifests and exported models written before the format was recorded hold
FORMAT_TEXT = {"bos": "BOS first, no EOS", "eos": "EOS after each"}


def check_document_format(
    data_format: str, model_format: str, data: str, model: str, error: type[Exception] = DataError
) -> None:
    """Data and model must frame documents alike: a mismatch is one line naming both and the fix."""
    if data_format != model_format:
        raise error(
            f"{data} holds {data_format}-format documents ({FORMAT_TEXT[data_format]}) but {model} was "
            f"trained on {model_format}-format documents ({FORMAT_TEXT[model_format]}); re-prepare the "
            f"data with --set data.document_format={model_format}"
        )


def byte_level_alphabet() -> list[str]:
    """The GPT-2 byte-to-character table in byte order (`tokenizers` only gives an unordered set)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    others = iter(range(256, 512))  # the unprintable bytes, in order, take the characters from U+0100
    return [chr(byte) if byte in printable else chr(next(others)) for byte in range(256)]


def check_utf8(texts: Iterable[str]) -> None:
    """Refuse text that is not UTF-8: a command line keeps undecodable bytes as surrogates (U+DC80..)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            char = text[err.start]
            byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else repr(char)
            raise DataError(
                f"text {text[:40]!r} is not valid UTF-8 ({byte} at character {err.start}); pass UTF-8 text"
            ) from None


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what mhf-dist needs: id-ordered vocabulary strings and EOS."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str = EOS) -> None:
        self.tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"tokenizer has no end-of-text token {eos_token!r}; add it as a special token")
        self.eos_id = eos_id
        model = tokenizer.model
        # A word-level model maps a word outside its vocabulary to its unk_token: a silently wrong id
        # unless that token is an explicit unknown (the recall tokenizer's is EOS).
        fixed_words = isinstance(model, models.WordLevel) and not (
            model.unk_token in UNK_TOKENS and tokenizer.token_to_id(model.unk_token) is not None
        )
        self.unknown_word = model.unk_token if fixed_words else None

    @classmethod
    def load(cls, path: str | Path | Location) -> TextTokenizer:
        """A tokenizer.json file; EOS is the first of EOS_CANDIDATES in its vocabulary."""
        fix = "pass a tokenizer.json file"
        text = read_text(path, DataError, fix)
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as err:  # tokenizers raises a bare Exception for a damaged file
            raise DataError(f"cannot read tokenizer {str(path)!r}: {first_line(err)}; {fix}") from None
        eos = next((token for token in EOS_CANDIDATES if tokenizer.token_to_id(token) is not None), None)
        if eos is None:
            raise DataError(
                f"tokenizer {str(path)!r} has none of the EOS tokens {', '.join(EOS_CANDIDATES)}; add one"
            )
        return cls(tokenizer, eos)

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> TextTokenizer:
        """A byte-level BPE (GPT-2 style pre-tokenisation) with EOS as its first special token."""
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer)

    @classmethod
    def bytes(cls) -> TextTokenizer:
        """259 ids: byte value b is id b, then <bos>, <eos>, <pad> (the byte-level benchmarks' vocabulary)."""
        vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens(list(BYTE_SPECIALS))
        return cls(tokenizer, eos_token="<eos>")

    @classmethod
    def recall(cls, vocab_size: int) -> TextTokenizer:
        """Word-level names of the associative-recall ids (filler = EOS, keys `k1`.., values `v0`..)."""
        vocab = {token: index for index, token in enumerate(recall_vocabulary(vocab_size))}
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tokenizer.add_special_tokens([EOS])
        return cls(tokenizer)

    @classmethod
    def resolve(cls, spec: str, vocab_size: int, training_texts: Iterable[str]) -> TextTokenizer:
        """`bytes`, `bpe` (trained on `training_texts`), `mistral-v0.3` or a tokenizer.json path or URI."""
        from mhf_dist.data import mistral

        if spec == "bytes":
            return cls.bytes()
        if spec == "bpe":
            return cls.train_bpe(training_texts, vocab_size)
        if spec == mistral.NAME:  # converted once from mistral-common and cached
            return cls(Tokenizer.from_str(mistral.tokenizer_json()), eos_token="</s>")
        path = Location.of(spec)
        if not path.is_file():
            raise DataError(
                f"tokenizer {spec!r} is neither 'bpe', 'bytes', '{mistral.NAME}' nor an existing "
                "tokenizer.json file"
            )
        return cls.load(path)

    @property
    def default_bos_id(self) -> int | None:
        """The token the default special tokens put before a text (`<s> $A`), or None."""
        plain = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        if len(full) > len(plain) and full[1 : 1 + len(plain)] == plain:
            return full[0]
        return None

    def resolve_format(self, requested: str) -> str:
        """`auto` -> `bos` when the default special tokens lead with a BOS, else `eos`."""
        if requested == "auto":
            return "bos" if self.default_bos_id is not None else "eos"
        if requested not in DOCUMENT_FORMATS:
            raise DataError(f"document format {requested!r}; use auto, bos or eos")
        if requested == "bos":
            _ = self.bos_id  # raises when there is none
        return requested

    @property
    def bos_id(self) -> int:
        """The BOS of `bos` documents: the default template's, else the first of BOS_CANDIDATES."""
        candidates = (self.tokenizer.token_to_id(token) for token in BOS_CANDIDATES)
        index = next((i for i in (self.default_bos_id, *candidates) if i is not None), None)
        if index is not None:
            return index
        raise DataError(
            f"the tokenizer has no BOS token ({', '.join(BOS_CANDIDATES)}); set data.document_format=eos"
        )

    def boundaries(self, document_format: str) -> tuple[list[int], list[int]]:
        """(ids before, ids after) each document's tokens: ([BOS], []) or ([], [EOS])."""
        if document_format == "bos":
            return [self.bos_id], []
        if document_format == "eos":
            return [], [self.eos_id]
        raise DataError(f"document format {document_format!r}; use bos or eos")

    def encode_documents(self, texts: Sequence[str], document_format: str) -> list[list[int]]:
        """Each text's ids framed as a document of `document_format`."""
        before, after = self.boundaries(document_format)
        return [[*before, *ids, *after] for ids in self.encode_batch(texts)]

    def context_prefix(self, document_format: str) -> list[int]:
        """What a scored context starts with: [BOS] for `bos` models, nothing for `eos` models."""
        return self.boundaries(document_format)[0]

    def empty_context(self, document_format: str) -> list[int]:
        """The context of a text scored from its start (lm-eval's prefix token): BOS, or EOS for `eos`."""
        return [self.bos_id] if document_format == "bos" else [self.eos_id]

    def with_added_tokens(self, tokens: Sequence[str]) -> TextTokenizer:
        """Append `tokens` as whole-string tokens (matched before pre-tokenisation)."""
        known = set(self.vocabulary())
        seen: set[str] = set()
        for token in tokens:
            if token in seen:
                raise DataError(f"token {token!r} is listed twice; list each new token once")
            if token in known:
                raise DataError(f"token {token!r} is already in the vocabulary; list new tokens only")
            seen.add(token)
        tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
        tokenizer.add_tokens(list(tokens))
        return self._extended(tokenizer)

    def with_trained_tokens(self, texts: Iterable[str], count: int) -> TextTokenizer:
        """Append up to `count` BPE tokens learned from `texts` (`tokenizers` cannot extend a trained BPE:
        a new one's merges whose result is new and whose parts are known are appended in order)."""
        spec = json.loads(self.tokenizer.to_str())
        if spec["model"]["type"] != "BPE":
            raise DataError(
                f"--train-new-tokens needs a BPE tokenizer, not {spec['model']['type']}; use --add-tokens"
            )
        learner = Tokenizer.from_str(self.tokenizer.to_str())
        learner.model = models.BPE()
        trainer = trainers.BpeTrainer(
            vocab_size=self.vocab_size + 4 * count,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        learner.train_from_iterator(texts, trainer=trainer)
        learned = json.loads(learner.to_str())["model"]["merges"]
        vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
        # Added tokens (specials) keep their ids only if the model's vocabulary holds them too.
        vocab.update({added["content"]: added["id"] for added in spec["added_tokens"]})
        known = set(self.vocabulary())
        next_id = self.vocab_size
        for merge in learned:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            token = left + right
            if token in known or left not in known or right not in known:
                continue
            vocab[token] = next_id
            merges.append(merge)
            known.add(token)
            next_id += 1
            if next_id - self.vocab_size == count:
                break
        return self._extended(Tokenizer.from_str(json.dumps(spec)))

    def _extended(self, tokenizer: Tokenizer) -> TextTokenizer:
        extended = TextTokenizer(tokenizer, self.tokenizer.id_to_token(self.eos_id))
        extended.check_extends(self)
        return extended

    def check_extends(self, old: TextTokenizer) -> None:
        """Every old id must keep its string: new tokens may only be appended."""
        new_vocab = self.vocabulary()
        for index, token in enumerate(old.vocabulary()):
            if index >= len(new_vocab) or new_vocab[index] != token:
                now = new_vocab[index] if index < len(new_vocab) else "nothing"
                raise DataError(
                    f"the new tokenizer renumbers old token {token!r} (id {index} is now {now!r}); "
                    "append new tokens after the old vocabulary"
                )

    @property
    def pad_token(self) -> str:
        """The padding token (all-zero reference signature): a pad token, else EOS as in the reference."""
        known = (token for token in PAD_CANDIDATES if self.tokenizer.token_to_id(token) is not None)
        return next(known, self.tokenizer.id_to_token(self.eos_id))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> list[str]:
        """Token strings in id order (special tokens included): the keys of the signature table."""
        by_id = {index: token for token, index in self.tokenizer.get_vocab(with_added_tokens=True).items()}
        missing = [index for index in range(len(by_id)) if index not in by_id]
        if missing:
            raise DataError(
                f"tokenizer ids are not contiguous (id {missing[0]} missing); renumber the vocabulary"
            )
        return [by_id[index] for index in range(len(by_id))]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids; non-UTF-8 text or a word a fixed word-level vocabulary lacks is an error."""
        texts = list(texts)
        try:
            encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        except TypeError:  # what tokenizers raises for a str with surrogates
            check_utf8(texts)
            raise
        except Exception:  # tokenizers' refusal of an unknown word when unk_token is not in the vocabulary
            if self.unknown_word is not None:
                self._refuse_unknown(self._words_outside_vocabulary(texts))
            raise
        if self.unknown_word is not None:
            self._refuse_unknown(self._words_read_as_unknown(texts, encodings))
        return [encoding.ids for encoding in encodings]

    def outside_vocabulary(self, text: str) -> bool:
        """Whether `text` holds a word a fixed word-level vocabulary lacks (`encode_batch` refuses it)."""
        if self.unknown_word is None:
            return False
        try:
            self.encode_batch([text])
        except DataError:
            return True
        return False

    def _words_read_as_unknown(self, texts: Sequence[str], encodings: Sequence[Encoding]) -> list[str]:
        unknown_id = self.tokenizer.token_to_id(self.unknown_word)
        return [
            text[start:end]
            for text, encoding in zip(texts, encodings, strict=True)
            for index, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if index == unknown_id and text[start:end] != self.unknown_word
        ]

    def _words_outside_vocabulary(self, texts: Sequence[str]) -> list[str]:
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        split = self.tokenizer.pre_tokenizer
        words = [word for text in texts for word, _ in split.pre_tokenize_str(text)] if split else texts
        return [word for word in words if word not in vocab]

    def _refuse_unknown(self, words: Sequence[str]) -> None:
        unknown = dict.fromkeys(words)
        if unknown:
            shown = ", ".join(repr(word) for word in list(unknown)[:SHOWN_WORDS])
            more = f" and {len(unknown) - SHOWN_WORDS} more" if len(unknown) > SHOWN_WORDS else ""
            raise DataError(
                f"unknown word(s) {shown}{more}: the tokenizer is word-level with a fixed vocabulary of "
                f"{self.vocab_size} words and no <unk> token; use only its words"
            )

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as lm-eval's Hugging Face model splits them: the context's
        trailing spaces move to the continuation, whose ids are the whole text's past the context's
        (SentencePiece encodes " word" alone as `▁▁word`, never as it appears in text)."""
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        context_ids, whole = self.encode_batch([context, context + continuation])
        return context_ids, whole[len(context_ids) :]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
