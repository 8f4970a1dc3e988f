"""`mistral-v0.3`: the tokenizer of Mistral-7B-v0.3, which the authors' released MHF models use.

The SentencePiece model ships in the `mistral-common` package (`mistral_instruct_tokenizer_240323.model.v3`,
32,768 pieces: `<unk>` 0, `<s>` 1, `</s>` 2, control tokens 3-770, 256 byte pieces, then the BPE pieces).
It is converted once, offline, into a `tokenizers.Tokenizer` that encodes like Hugging Face's
Mistral-7B-v0.3 fast tokenizer (LlamaTokenizerFast, legacy SentencePiece BPE: byte fallback, a `▁` before
the text and for every space, no pre-tokenizer, the `<s> $A` template), and cached as tokenizer.json.

Two facts the conversion has to get right:
- transformers' `LlamaConverter` cannot run on a BPE model in transformers 5, so only its
  `SentencePieceExtractor` is used, and the normalizer, decoder and template are set here as
  `LlamaConverter` sets them for `legacy=True`.
- mistral-common renamed 24 of the reserved control pieces after v0.3 was released (ids 10-13, 751-770).
  The Mistral-7B-v0.3 tokenizer on the Hub, and so the authors' tokenizer, still calls id i
  (10 <= i <= 770) `[control_{i-2}]`, and a token's string is its hashing key: the conversion restores
  those names.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from mhf_dist.errors import DataError
from mhf_dist.storage import Location

NAME = "mistral-v0.3"
PACKAGE, MODEL_FILE = "mistral_common", "data/mistral_instruct_tokenizer_240323.model.v3"
VOCAB_SIZE = 32768
NAMED_CONTROLS = (  # ids 3-9: the names Mistral-7B-v0.3 gives its first control tokens
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
LAST_CONTROL = 770  # ids 0..770 are special tokens (unk, bos, eos and 768 control tokens)
CONVERTER_VERSION = 1  # part of the cache key: bump when the conversion changes
CACHE_ENV = "MHF_CACHE_DIR"


def source_model() -> Path:
    """The SentencePiece model file inside the installed mistral-common package."""
    try:
        path = importlib.resources.files(PACKAGE) / MODEL_FILE
    except ModuleNotFoundError:
        raise DataError(
            f"tokenizer {NAME!r} needs the mistral-common package; pip install mistral-common"
        ) from None
    if not path.is_file():
        raise DataError(
            f"mistral-common has no {MODEL_FILE}; install a mistral-common release that ships it "
            "(1.13.1 does)"
        )
    return Path(str(path))


def tokenizer_json() -> str:
    """The converted tokenizer.json text: read from the cache, or converted once and cached."""
    source = source_model()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    # $MHF_CACHE_DIR, else $XDG_CACHE_HOME/mhf-dist, else ~/.cache/mhf-dist
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get(CACHE_ENV) or user_cache / "mhf-dist")
    cached = cache / "tokenizers" / f"{NAME}-{digest}-c{CONVERTER_VERSION}.json"
    checksum = cached.with_suffix(".sha256")  # written after the file: a cache is used only if they agree
    try:
        text = cached.read_text(encoding="utf-8")
        if hashlib.sha256(text.encode()).hexdigest() == checksum.read_text(encoding="utf-8").strip():
            return text
    except (OSError, UnicodeDecodeError):
        pass  # no cache yet, or a damaged one: convert again
    text = convert(source).to_str()
    try:  # a read-only home still works: the conversion is then simply redone next time
        cached.parent.mkdir(parents=True, exist_ok=True)
        Location.of(cached).write_text(text)
        Location.of(checksum).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")
    except OSError:
        pass
    return text


def hub_name(index: int, piece: str) -> str:
    """Piece `index`'s string in Mistral-7B-v0.3's tokenizer (the control pieces' v0.3 names)."""
    if 3 <= index < 3 + len(NAMED_CONTROLS):
        return NAMED_CONTROLS[index - 3]
    if 3 + len(NAMED_CONTROLS) <= index <= LAST_CONTROL:
        return f"[control_{index - 2}]"
    return piece


def convert(source: str | Path) -> Tokenizer:
    """The SentencePiece BPE model at `source` as Mistral-7B-v0.3's fast tokenizer (deterministic)."""
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    try:
        extractor = SentencePieceExtractor(str(source))
    except ImportError:  # transformers asks for the sentencepiece and protobuf backends
        raise DataError(
            f"converting {NAME!r} needs the sentencepiece and protobuf packages; pip install them"
        ) from None
    proto = extractor.proto
    if len(proto.pieces) != VOCAB_SIZE or proto.trainer_spec.model_type != 2:  # 2: BPE
        raise DataError(f"{source} is not Mistral's 32,768-piece BPE model; reinstall mistral-common")
    if [piece.piece for piece in proto.pieces[:3]] != ["<unk>", "<s>", "</s>"]:
        raise DataError(f"{source} does not start with <unk>, <s>, </s>; reinstall mistral-common")
    for index in range(3, LAST_CONTROL + 1):
        piece = proto.pieces[index]
        if piece.type not in (3, 4):  # control or user-defined: never produced from text by the BPE
            raise DataError(f"{source}: piece {index} ({piece.piece!r}) is not a control piece")
        piece.piece = hub_name(index, piece.piece)
        piece.type = 3
    extracted = extractor.extract(BPE)  # vocabulary in id order and the merges, from the renamed pieces
    model = BPE(extracted["vocab"], extracted["merges"], unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    # LlamaConverter with legacy=True: `▁` before the text, every space a `▁`, no pre-tokenizer.
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend(prepend="▁"), normalizers.Replace(pattern=" ", content="▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    specials = [proto.pieces[index].piece for index in range(LAST_CONTROL + 1)]
    tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in specials])
    # The tokenizer's default special tokens (add_bos_token=True, add_eos_token=False): `<s>` first.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise DataError(f"converting {source} gave {tokenizer.get_vocab_size()} ids, not {VOCAB_SIZE}")
    return tokenizer
