"""Typed run configuration: pydantic models, YAML presets and `--set a.b=c` overrides.

A config is built in three layers: a preset (`mhf_dist/presets/<name>.yaml`) or a YAML file (which
may itself name a `preset:` to start from), then `--set` overrides. Every mistake is a `ConfigError`
whose one-line message names the bad key or value and what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from mhf_dist.errors import ConfigError, first_problem, problem_line, refused_value
from mhf_dist.plugins import BACKBONES, FAMILIES, Registry
from mhf_dist.readers import DuplicateKeyError, check_file, load_yaml, read_yaml
from mhf_dist.storage import Location, check_trimmed, redact

PRESET_DIR = Path(__file__).parent / "presets"


def _registered(registry: Registry) -> AfterValidator:
    """A name `registry` holds: the built-in ones and those an outside package registers."""

    def check(name: str) -> str:
        if name not in registry:
            raise ValueError(registry.unknown(name))
        return name

    return AfterValidator(check)


# The model families (`mhf_dist.models.registry.register_family` adds one).
Family = Annotated[str, _registered(FAMILIES)]
# The stacks a MultiHashFormer can run between its hash encoder and decoder (`register_backbone`).
BackboneKind = Annotated[str, _registered(BACKBONES)]
# The largest vocabulary a config may name: 64x the largest tokenizers in use, and the bound under
# which `mhf plan` and `mhf count` can afford a table row per token.
MAX_VOCAB = 2**24
MIN_VOCAB = 2  # an id to predict besides one other: a model of one token has nothing to learn
MAX_SEED = 2**63 - 1  # the largest 64-bit integer: what every config integer fits (`StrictModel`)
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
HASH_SPEC = re.compile(r"^H(\d{1,12})B(\d{1,12})(K?)$")  # digits enough for every bound below
# A Dataset source's callable: `package.module:function`, returning a ray.data.Dataset of documents.
DATASET_CALLABLE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
DATASET_PREFIX = "dataset:"  # data.corpus (or --corpus) naming such a callable


def check_place(location: str) -> str:
    """A name, path or URI to read or write: not empty (a path would be the current directory) and not
    surrounded by white space (` s3://b/x` would be a local folder)."""
    if not location:
        raise ValueError("empty; give a value ('.' is the current directory)")
    check_trimmed(location, ValueError)  # pydantic reports a ValueError in its words
    return location


def check_corpus(corpus: str) -> str:
    """An `hf:` corpus names a Hugging Face Hub dataset (the hub's own rule), a `dataset:` one
    package.module:function (other forms are checked where they are read)."""
    if corpus.startswith("hf:"):
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(corpus.removeprefix("hf:"))
        except ValueError:  # HFValidationError
            raise ValueError(
                f"{corpus!r} names no dataset; write hf:NAME or hf:OWNER/NAME (e.g. hf:wikitext), in the "
                "hub's letters, digits, - _ and ."
            ) from None
    callable_name = corpus.removeprefix(DATASET_PREFIX)
    if callable_name != corpus and not re.fullmatch(DATASET_CALLABLE, callable_name):
        raise ValueError(f"{corpus!r}: write {DATASET_PREFIX}package.module:function")
    return corpus


Place = Annotated[str, AfterValidator(check_place)]
Corpus = Annotated[Place, AfterValidator(check_corpus)]
# Overrides: dotted keys and their values, or `KEY=VALUE` texts (see `load_config`).
Overrides = Mapping[str, Any] | Iterable[str]


# A name mhf makes one directory of (a run, a sweep): one path component, never `.` or `..`.
MAX_NAME = 200
DIRECTORY_NAME = rf"^[A-Za-z0-9][A-Za-z0-9_.=,+-]{{0,{MAX_NAME - 1}}}$"
DIRECTORY_NAME_RULE = (
    f"use letters, digits and . _ - = , + (one directory name: at most {MAX_NAME} characters, starting "
    "with a letter or digit)"
)


class StrictModel(BaseModel):
    """Rejects unknown keys (a typo is an error, not an ignored setting), numbers that are not finite, and
    values of another type (`true` is no number, `"50"` no integer: YAML 1.2 has already typed them)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    @field_validator("*")
    @classmethod
    def _fits_64_bits(cls, value: Any) -> Any:
        """What torch, numpy and Arrow hold: a 400-digit integer is a typo, not a setting."""
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ValueError(f"a {len(str(abs(value)))}-digit number; use a 64-bit integer")
        return value


# The paper's K-names whose B is not a multiple of 1024 (HUIYINXUE/MHF README: "MHF(H3B10K)" is the
# checkpoint `..._10624_3_0_64_twe`); every other K-name is x1024 (H4B16K = 16,384 as `_16384_4_0_64`).
PAPER_K_BUCKETS = {10: 10_624}
MAX_HASHES, MAX_BUCKETS = 256, 2**32
SPEC_HELP = (
    "write H<hashes>B<buckets>[K], e.g. H4B16K or H2B64; K is x1024 except the paper's B10K = 10,624 "
    "(H3B10K), and the exact number always works (H3B10624, H3B10240)"
)


def parse_hash_spec(spec: str) -> tuple[int, int]:
    """`H4B16K` -> (4, 16384): H hash functions, B buckets (K: x1024, but `B10K` is the paper's 10,624)."""
    match = HASH_SPEC.match(spec.strip())
    if match is None:
        raise ConfigError(f"bad hash spec {spec!r}; {SPEC_HELP}")
    num_hashes, count = int(match[1]), int(match[2])
    num_buckets = PAPER_K_BUCKETS.get(count, count * 1024) if match[3] else count
    if not 1 <= num_hashes <= MAX_HASHES:
        raise ConfigError(f"hash spec {spec!r} has H={num_hashes}; use 1 to {MAX_HASHES} hashes")
    if not 2 <= num_buckets <= MAX_BUCKETS:  # a bucket is a 32-bit MurmurHash3 value modulo B
        raise ConfigError(f"hash spec {spec!r} has B={num_buckets}; use 2 to 2**32 buckets")
    return num_hashes, num_buckets


def format_hash_spec(num_hashes: int, num_buckets: int) -> str:
    """(4, 16384) -> `H4B16K`, (3, 10624) -> `H3B10K`; `parse_hash_spec` reads every result back."""
    paper = {buckets: count for count, buckets in PAPER_K_BUCKETS.items()}
    if num_buckets in paper:
        return f"H{num_hashes}B{paper[num_buckets]}K"
    if num_buckets % 1024 == 0 and num_buckets // 1024 not in PAPER_K_BUCKETS:
        return f"H{num_hashes}B{num_buckets // 1024}K"
    return f"H{num_hashes}B{num_buckets}"


# Far past any published language model (Llama 3.1 405B: width 16,384, 126 layers), yet finite: a mistyped
# size is an error, not a parameter count that overflows (or a plan that builds a million layers).
MAX_WIDTH, MAX_LAYERS = 65_536, 1_024


class BackboneConfig(StrictModel):
    """The model's stack: a Qwen3 decoder (QK-norm, grouped-query attention, RoPE, SwiGLU MLP) unless
    `kind` names a triple-latent stack, which reuses the widths, layers, MLP and norms."""

    kind: BackboneKind = Field("qwen3", description="family mhf: the stack between hash encoder and decoder")
    hidden_size: int = Field(gt=0, le=MAX_WIDTH)
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    num_heads: int = Field(gt=0, le=MAX_WIDTH)
    num_kv_heads: int = Field(gt=0, le=MAX_WIDTH)
    head_dim: int = Field(gt=0, le=MAX_WIDTH)
    intermediate_size: int = Field(gt=0, le=16 * MAX_WIDTH)
    rope_theta: float = Field(1_000_000.0, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    max_position_embeddings: int = Field(32768, gt=0)
    tie_word_embeddings: bool = Field(
        True, description="the output layer reuses the input table (qwen3: V x d; mhf reference: H*B x d)"
    )

    @model_validator(mode="after")
    def _heads_group_evenly(self) -> BackboneConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "pick num_kv_heads that divides num_heads"
            )
        return self


class HashConfig(StrictModel):
    """Signature shape (`spec`, e.g. H4B16K), the hash I/O design, its objective and its widths. `io:
    reference` is the authors' model (HUIYINXUE/MHF): one [H*B, d_model] table shared by the encoder and
    the tied decoder, a full-width cascade, the `bottleneck` k in the gate and mixers; `io: compact` is a
    cheaper variant: one narrow table (`d_hash`), a reduced cascade (`d_casc`, `mixer_hidden`)."""

    spec: str = "H4B16K"
    seed: int = Field(0, ge=0, lt=2**32)  # a 32-bit MurmurHash3 seed (and seed + H - 1 too: below)
    io: Literal["reference", "compact"] = Field(
        "reference", description="reference: the paper's hash encoder/decoder; compact: narrower and cheaper"
    )
    loss: Literal["coordinates", "vocab"] = Field(
        "coordinates",
        description="coordinates: sum of the B-way cross-entropies (the paper's); vocab: exact V likelihood",
    )
    scheme: Literal["reference", "murmur32"] | None = Field(
        None, description="signature scheme; default: reference under io=reference, else murmur32"
    )
    num_lsh: int = Field(
        0,
        ge=0,
        description="reference scheme: the first num_lsh coordinates are LSH buckets of the token's "
        "character trigrams (the authors' num_lsh; the paper's LSH:MMH3 ablation); 0: none",
    )
    lsh_only_embed: bool = Field(
        False, description="the encoder reads only the num_lsh LSH coordinates; the decoder predicts all H"
    )
    bottleneck: int = Field(64, gt=0, description="reference I/O: k of the gate and the cascade mixers")
    d_hash: int | None = Field(None, gt=0, description="compact I/O: bucket-embedding width; default hidden")
    gate_hidden: int = Field(64, gt=0, description="compact I/O: bottleneck of the encoder's gate")
    d_casc: int | None = Field(None, gt=0, description="compact I/O: cascade width; default hidden/4")
    mixer_hidden: int | None = Field(None, gt=0, description="compact I/O: mixer bottleneck; default d_casc")

    @property
    def signature_scheme(self) -> str:
        return self.scheme or ("reference" if self.io == "reference" else "murmur32")

    @model_validator(mode="before")
    @classmethod
    def _accept_spec_string(cls, value: Any) -> Any:
        return {"spec": value} if isinstance(value, str) else value

    @field_validator("spec")
    @classmethod
    def _valid_spec(cls, spec: str) -> str:
        try:
            parse_hash_spec(spec)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return spec.strip()

    @model_validator(mode="after")
    def _lsh_fits(self) -> HashConfig:
        if self.seed + self.num_hashes - 1 >= 2**32:  # hash j is seeded seed + j, a 32-bit MurmurHash3 seed
            raise ValueError(
                f"seed={self.seed}: its {self.num_hashes} hashes are seeded seed to "
                f"seed+{self.num_hashes - 1}, all below 2**32; use a seed below {2**32 - self.num_hashes + 1}"
            )
        if self.num_lsh > self.num_hashes:
            raise ValueError(
                f"num_lsh={self.num_lsh} exceeds the {self.num_hashes} hashes of {self.spec}; "
                f"use num_lsh <= {self.num_hashes}"
            )
        if self.num_lsh and self.signature_scheme != "reference":
            raise ValueError(
                f"num_lsh={self.num_lsh} needs the reference signature scheme (LSH coordinates are the "
                f"authors'), not {self.signature_scheme}; set model.hash.scheme=reference"
            )
        if self.lsh_only_embed and not self.num_lsh:
            raise ValueError("lsh_only_embed=true embeds the LSH coordinates only; set num_lsh > 0 as well")
        return self

    @property
    def num_hashes(self) -> int:
        return parse_hash_spec(self.spec)[0]

    @property
    def num_buckets(self) -> int:
        return parse_hash_spec(self.spec)[1]


class TripleConfig(StrictModel):
    """The triple-latent layer (families triple_* and gated_hybrid); it reuses the backbone's sizes, MLP,
    norms and tie_word_embeddings, not its attention settings."""

    num_heads: int | None = Field(None, gt=0, description="heads of the pair memory; default backbone's")
    state_dim: int | None = Field(None, gt=0, description="S: running state and pair memory S x S per head")
    chunk_size: int = Field(16, gt=0, le=16, description="time steps per scan chunk (<= scans.MAX_CHUNK)")
    conv_kernel: int = Field(4, gt=0, description="triple_hybrid: width of the causal local convolution")
    num_slots: int = Field(4, gt=0, description="triple_slot: slots (the rank of the slot memory)")
    memory_dim: int | None = Field(None, gt=0, description="gated_hybrid: key/value width; default hidden")
    memory_top_k: int = Field(8, gt=0, description="gated_hybrid: keys retrieved per query")
    match_params: bool = Field(
        False, description="standard-head families: an MLP width giving the parameter count of `match_to`"
    )
    match_to: Literal["qwen3", "mhf"] = Field(
        "qwen3", description="match_params target: the qwen3 baseline, or mhf over model.backbone.kind"
    )


class ModelConfig(StrictModel):
    family: Family = "mhf"
    vocab_size: int = Field(32000, ge=MIN_VOCAB, le=MAX_VOCAB)
    backbone: BackboneConfig
    hash: HashConfig = HashConfig()
    triple: TripleConfig = TripleConfig()

    @model_validator(mode="after")
    def _kind_fits_family(self) -> ModelConfig:
        kind = self.backbone.kind
        if kind not in ("qwen3", self.family) and self.family != "mhf":
            raise ValueError(
                f"model.backbone.kind={kind} puts hash I/O around that stack (family mhf); family "
                f"{self.family} builds its own stack: set model.family=mhf or model.backbone.kind=qwen3"
            )
        return self

    def hash_widths(self) -> tuple[int, int, int]:
        """Compact I/O: (d_hash, d_casc, mixer_hidden) with the defaults resolved against the width."""
        d_model = self.backbone.hidden_size
        d_hash = self.hash.d_hash or d_model
        d_casc = self.hash.d_casc or max(1, d_model // 4)
        return d_hash, d_casc, self.hash.mixer_hidden or d_casc

    def triple_widths(self) -> tuple[int, int, int]:
        """(heads, state_dim, memory_dim) of the triple-latent layer with defaults resolved."""
        bb = self.backbone
        return (
            self.triple.num_heads or bb.num_heads,
            self.triple.state_dim or bb.head_dim,
            self.triple.memory_dim or bb.hidden_size,
        )


class TrainConfig(StrictModel):
    seed: Seed = 0
    steps: int = Field(100, gt=0)
    batch_size: int = Field(8, gt=0, description="the global batch: rows per optimizer step, all workers")
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="rows per worker per forward; batch_size / (micro x workers) steps are accumulated; "
        "default: batch_size / workers (no accumulation)",
    )
    seq_len: int = Field(128, ge=2)
    lr: float = Field(3e-4, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")
    log_every: int = Field(10, gt=0)
    checkpoint_every: int = Field(0, ge=0, description="steps between checkpoints; 0: only at the end")
    keep_checkpoints: int = Field(2, gt=0, description="checkpoints kept (the newest)")
    eval_every: int = Field(0, ge=0, description="steps between validation passes (exact NLL); 0: at the end")
    eval_rows: int = Field(
        0, ge=0, description="validation rows per pass (0: the whole split), less the last rows % workers"
    )
    precision: Literal["auto", "fp32", "bf16", "bf16-pure"] = Field(
        "auto",
        description="auto: bf16 on GPUs, fp32 on CPUs; bf16: bf16 compute, fp32 master weights and Adam "
        "states; bf16-pure: bf16 weights, grads and Adam states, no fp32 copy (the authors' recipe)",
    )
    activation_checkpointing: Literal["none", "layers"] = Field(
        "none", description="layers: recompute each layer (and mhf's cascade) in the backward"
    )
    compile: bool = Field(False, description="torch.compile the model before DeepSpeed wraps it (ZeRO 0-2)")
    trainable: list[str] | None = Field(
        None,
        description="globs over parameter names that train (`layers.-1` counts from the end); the rest "
        "are frozen; null or []: all train; mhf cpt: null means the authors' recipe (train/trainable.py)",
    )


class RecallDataConfig(StrictModel):
    """`data.corpus: recall`: generated multi-query associative recall rows (`mhf_dist.data.recall`)."""

    examples: int = Field(4096, gt=0, description="training rows; validation gets val_percent of this")
    num_pairs: int = Field(8, gt=0, description="key-value pairs at the start of each row")
    num_queries: int = Field(4, gt=0, description="keys asked again later in the row")


# How `mhf cpt` starts a baseline's new embedding/head rows (mhf adds none).
INIT_NEW_ROWS = ("subword", "mean")


class ReplayConfig(StrictModel):
    """A second source mixed into the training split (`mhf_dist.data.mixture`), e.g. the parent's corpus
    in continued pretraining: about `fraction` of the training tokens come from it."""

    corpus: Corpus | None = Field(None, description="the replayed corpus (same forms as data.corpus)")
    fraction: float = Field(0.0, ge=0, lt=1, description="share of the training tokens from replay.corpus")
    seed: int = Field(0, ge=0, lt=2**32, description="documents are chosen in MurmurHash3(text, seed) order")

    @model_validator(mode="after")
    def _corpus_given(self) -> ReplayConfig:
        if self.fraction > 0 and self.corpus is None:
            raise ValueError(f"fraction={self.fraction} needs data.replay.corpus, the text to replay")
        if self.corpus is not None and self.fraction == 0:
            raise ValueError(
                f"corpus={self.corpus!r} is replayed only with a fraction > 0; set data.replay.fraction "
                "(mhf cpt: --replay-fraction)"
            )
        return self


class SourceConfig(StrictModel):
    """One source of a mixture (`data.sources`): a corpus or a ray.data.Dataset, and its token share."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_-]+$",
        description="the source's name in the manifest, the logs and the MLflow metric tokens_seen.<name>",
    )
    corpus: Corpus | None = Field(None, description="the same forms as data.corpus (not recall)")
    dataset: str | None = Field(
        None,
        pattern=DATASET_CALLABLE,
        description="instead of corpus: package.module:function returning a ray.data.Dataset of documents, "
        "staged once by mhf prepare (neither: the Dataset is given in Python, prepare(datasets=...))",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of `dataset`")
    weight: float = Field(gt=0, description="its share of the training tokens, relative to the others'")
    text_field: str | None = Field(None, description="default: data.text_field")

    @model_validator(mode="after")
    def _one_origin(self) -> SourceConfig:
        if self.corpus is not None and self.dataset is not None:
            raise ValueError(f"source {self.name!r} names a corpus and a dataset; give one of them")
        if self.args and self.dataset is None:
            raise ValueError(
                f"source {self.name!r} has args but no dataset; args are the dataset's arguments"
            )
        return self


class DataConfig(StrictModel):
    """Where text comes from, how it is tokenized and split, and where prepared shards live."""

    corpus: Corpus = Field(
        "builtin",
        description="builtin | recall | hf:NAME | dataset:package.module:function (a ray.data.Dataset) | a "
        "file, directory or glob, local or s3:// / gs://, of .txt/.raw/.jsonl/.json (each optionally "
        ".gz/.zst/.bz2), .parquet, .arrow (optionally .zst)",
    )
    sources: list[SourceConfig] = Field(
        default_factory=list,
        description="a mixture instead of data.corpus: [{name, corpus | dataset (+ args), weight, "
        "text_field?}]; weights are shares of the training tokens (no upsampling: the source that runs "
        "out first sets the total)",
    )
    mixture_seed: int = Field(
        0, ge=0, lt=2**32, description="data.sources: documents are taken in MurmurHash3(text, seed) order"
    )
    text_field: str = Field("text", description="the JSON field, parquet or Arrow column holding the text")
    tokenizer: Place = Field(
        "bpe",
        description="bpe (trained to model.vocab_size) | bytes | mistral-v0.3 (Mistral-7B-v0.3's, 32768 "
        "ids; the authors' models) | a tokenizer.json (path or URI)",
    )
    document_format: Literal["auto", "bos", "eos"] = Field(
        "auto",
        description="document boundaries: bos = `<s> text`, no EOS (the authors' Mistral data); eos = "
        "`text EOS`; auto: bos when the tokenizer's default special tokens lead with a BOS, else eos",
    )
    signatures: Place | None = Field(
        None,
        description="an exported model (or its signatures.safetensors) whose table the shards carry, e.g. "
        "one `mhf import-hf` wrote; default: built from the tokenizer by model.hash",
    )
    val_percent: float = Field(5.0, ge=0, lt=100, description="share of documents held out for validation")
    missing_text: Literal["error", "skip"] = Field(
        "error",
        description="records without text (no text_field, or null): error stops prepare naming the first "
        "and their count; skip leaves them out, counted in the manifest and MLflow",
    )
    packing: Literal["overlap", "blocks"] = Field(
        "overlap",
        description="rows of seq_len + 1 tokens: overlap = consecutive rows share one token (every token a "
        "target once); blocks = disjoint blocks, tail dropped (the authors' group_texts)",
    )
    rows_per_shard: int = Field(2048, gt=0)
    shuffle: bool = Field(True, description="rows in a seeded permutation each epoch; false: prepared order")
    shuffle_window: int = Field(
        64, gt=0, description="shards whose rows are mixed together (the shard order is shuffled too)"
    )
    path: Place = Field("runs/data", description="the prepared shard directory (prepare output, train input)")
    recall: RecallDataConfig = RecallDataConfig()
    replay: ReplayConfig = ReplayConfig()

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> DataConfig:
        if not self.sources:
            return self
        if self.corpus != DataConfig.model_fields["corpus"].default:
            raise ValueError(
                f"corpus={self.corpus!r} and sources name the text twice; drop data.corpus or make it one "
                "of data.sources"
            )
        if self.replay.corpus is not None:
            raise ValueError(
                "replay and sources together: add the replayed corpus as one more source instead"
            )
        names = [source.name for source in self.sources]
        if len(set(names)) < len(names):
            raise ValueError(f"sources have repeated names ({', '.join(names)}); give each its own")
        if any(source.corpus == "recall" for source in self.sources):
            raise ValueError("recall generates its rows and mixes with nothing; use it as data.corpus alone")
        return self


ZeroStage = Annotated[int, Field(ge=0, le=3)]  # the key's, its flag's (`--zero-stage`) and run.json's bounds


class TopologyConfig(StrictModel):
    """What a run trains on: Ray Train workers, their GPUs, the ZeRO stage and where runs are stored
    (each key also a CLI flag: `--workers`, ...). `check_topology` checks the batch split over it."""

    workers: int = Field(2, gt=0, description="Ray Train workers, one process each")
    gpus_per_worker: int = Field(0, ge=0, description="GPUs per worker; 0 trains on CPUs")
    zero_stage: ZeroStage = Field(0, description="DeepSpeed ZeRO stage (0: plain data parallel)")
    storage: Place = Field(
        "runs/train", description="Ray Train storage: run directories, checkpoints, the embedded MLflow"
    )


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Rows per worker per forward: train.micro_batch_size, a divisor of each worker's share of the batch."""
    if cfg.batch_size % world_size:
        raise ConfigError(
            f"train.batch_size={cfg.batch_size} does not split over {world_size} workers; "
            f"use a multiple of {world_size}"
        )
    share = cfg.batch_size // world_size
    micro = cfg.micro_batch_size or share
    if share % micro:
        raise ConfigError(
            f"train.micro_batch_size={micro} does not divide the {share} rows each of {world_size} workers "
            f"gets per step (train.batch_size={cfg.batch_size}); use a divisor of {share}"
        )
    return micro


def accumulation_steps(cfg: TrainConfig, world_size: int) -> int:
    return cfg.batch_size // world_size // micro_batch_size(cfg, world_size)


def check_topology(cfg: Config) -> None:
    """Before a run starts (train, cpt, each sweep trial; not count, plan, prepare): the batch splits
    over the workers, and no compile under ZeRO-3."""
    try:
        micro_batch_size(cfg.train, cfg.topology.workers)
    except ConfigError as err:
        raise ConfigError(f"{err} (topology.workers={cfg.topology.workers})") from None
    if cfg.train.compile and cfg.topology.zero_stage == 3:
        raise ConfigError(
            "train.compile under ZeRO-3 is not supported; set topology.zero_stage to 2 or lower, or "
            "train.compile=false"
        )


class Config(StrictModel):
    preset: str | None = None
    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    topology: TopologyConfig = TopologyConfig()

    @model_validator(mode="after")
    def _rows_fit_the_positions(self) -> Config:
        """A row reads seq_len positions: past max_position_embeddings the model has none to give."""
        most = self.model.backbone.max_position_embeddings
        if self.train.seq_len > most:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} is above model.backbone.max_position_embeddings={most}; "
                "lower train.seq_len or raise max_position_embeddings"
            )
        return self

    def flat(self) -> dict[str, Any]:
        """`{"model.backbone.hidden_size": 64, ...}`: the form MLflow params and `--set` use."""
        return dict(flatten(self.model_dump(mode="json")))


def available_presets() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def load_config(source: str | Path | None = None, overrides: Overrides = ()) -> Config:
    """Resolve a preset name or YAML path plus overrides (`{"train.steps": 50}` as sweep files write
    them, or `["train.steps=50"]` as `--set` takes them; later ones win) into a validated `Config`."""
    raw = _load_source(source if source is not None else "tiny")
    parsed = parse_overrides(overrides)
    if (preset := parsed.get("preset", raw.get("preset"))) != raw.get("preset"):  # the one started from
        fix = f"--config {preset}" if preset in available_presets() else "--config"
        raise ConfigError(
            f"preset={preset} cannot be set; choose the preset with {fix} (or a file's `preset:`)"
        )
    given = apply_overrides(raw, parsed)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        # A problem at a key no override touches (the key, inside it or around it) is a file's: the line
        # names the file that sets it. A rule across sections names its keys, whoever gave them.
        key, _ = first_problem(err)
        named = ""
        if _is_file(source or "") and key and not any(_nested(key, setting) for setting in given):
            found = setting_file(file_settings(source), key)  # None: no file of the chain sets it
            named = f"{found[0] if found else redact(str(source))}: "
        raise ConfigError(named + _describe(err)) from None


def _nested(key: str, other: str) -> bool:
    """Whether two dotted keys are one, or one lies inside the other (`train` and `train.steps`)."""
    return f"{key}.".startswith(f"{other}.") or f"{other}.".startswith(f"{key}.")


def file_settings(source: str | Path) -> list[tuple[str, str]]:
    """(file, key as written) for every key the files of `source`'s `preset:` chain set, the nearest file
    (whose values win the merge) first; a preset, even by path, is no file."""
    settings, where = [], source
    while _is_file(where) and Path(Location.of(where).path).resolve().parent != PRESET_DIR.resolve():
        raw = read_yaml(where, ConfigError, "fix the YAML syntax")
        raw = raw if isinstance(raw, dict) else {}
        settings += [(redact(str(where)), given) for given, _ in flatten(raw) if given != "preset"]
        where = raw.get("preset") or ""
    return settings


def setting_file(settings: list[tuple[str, str]], key: str) -> tuple[str, str] | None:
    """The first of `file_settings` that sets `key`, a key inside it or around it (`model.hash`)."""
    return next(((file, given) for file, given in settings if _nested(key, given)), None)


def _is_file(source: str | Path) -> bool:
    """A config source is a YAML file by its suffix or a folder in its path (`./tiny`), else a preset's
    name."""
    return Path(source).suffix.lower() in (".yaml", ".yml") or "/" in str(source)


def _load_source(source: str | Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A preset by name, or a YAML file (local or in a bucket) with the `preset:` chain it names."""
    if not _is_file(source):
        where = Location.of(PRESET_DIR / f"{source}.yaml")
        if not where.is_file():
            raise ConfigError(
                f"unknown preset {str(source)!r}; choose one of {', '.join(available_presets())} "
                "or pass a path to a .yaml file"
            )
    elif not (where := Location.of(source)).is_file():
        if seen:  # named by a file's `preset:`
            raise ConfigError(
                f"{redact(seen[-1])}: `preset: {source}` names no file ({str(where)!r}: a relative path is "
                "from the working directory); check the path"
            )
        check_file(where, ConfigError, "config file")
    raw = read_yaml(where, ConfigError, "fix the YAML syntax")
    if not isinstance(raw, dict | None):
        raise ConfigError(f"{where} must hold a mapping of config sections, not a {type(raw).__name__}")
    raw = raw or {}
    base = raw.pop("preset", None)
    file = Path(where.path)
    preset = file.stem if file.parent == PRESET_DIR else None  # a bucket's path is never the package's
    if base is None:
        return raw if preset is None else {**raw, "preset": preset}
    if not isinstance(base, str):
        raise ConfigError(f"{where}: `preset: {base!r}` names no preset; give one name or YAML file")
    if preset is not None:
        raise ConfigError(f"preset {preset!r} names another preset; presets must be self-contained")
    chain, named = (*seen, where.real), Location.of(str(base)).real if _is_file(base) else None
    if named in chain:
        names = " -> ".join([*chain, named])
        raise ConfigError(f"config files name each other as `preset:` ({names}); end the chain at a preset")
    merged = _load_source(str(base), chain)
    _deep_merge(merged, raw, Config)
    return merged


def parse_override(text: str) -> tuple[str, Any]:
    """`train.steps=50` -> ("train.steps", 50): the value as YAML 1.2 types it (`010` is 10, `yes` text,
    `[a, b]` a list), text kept as it is written (unquoted, or not YAML at all)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{text!r} is not KEY=VALUE; write e.g. --set train.steps=50")
    key = key.strip()
    try:
        parsed = load_yaml(value)
    except DuplicateKeyError as err:
        raise ConfigError(f"{text!r}: {err.problem}; {err.fix}") from None
    except yaml.YAMLError:
        return key, value
    # Text stays as written: YAML would cut `runs/exp #2` at its comment and `&a x` at its anchor.
    plain = value.strip()
    text_as_written = isinstance(parsed, str) or (parsed is None and "#" in plain)
    return key, plain if text_as_written and plain[:1] not in ("'", '"', "!") else parsed


def parse_overrides(overrides: Overrides) -> dict[str, Any]:
    """Overrides as one mapping of dotted keys in the order they apply (a repeated key: last value, place)."""
    if isinstance(overrides, Mapping):
        return dict(overrides)
    settings: dict[str, Any] = {}
    for key, value in map(parse_override, overrides):
        settings.pop(key, None)
        settings[key] = value
    return settings


def apply_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> list[str]:
    """Set each dotted key of `overrides` in `raw` (a config as read from YAML), in order; returns the
    keys set. A value given to a whole section merges into it: a mapping key by key, a shorthand as its
    model reads it (`model.hash=H2B64` is `{spec: H2B64}`: the spec changes, the widths stay)."""
    given = []
    for key, value in overrides.items():
        node, section = raw, Config
        *parents, last = key.split(".")
        for depth, part in enumerate(parents):
            child = _field_section(section, key, depth)
            path = ".".join(parents[: depth + 1])
            if child is None:
                raise ConfigError(f"{path} is a value, not a section; use --set {path}=...")
            node[part] = _section_keys(child, node.get(part) or {}, path)
            node, section = node[part], child
        child = _field_section(section, key, len(parents))
        if child is None:
            node[last] = value
            given.append(key)
        else:  # key by key: a shorthand, here or deeper down, is read as its section does
            keys = _section_keys(child, value, key)
            given += apply_overrides(
                raw, {f"{key}.{sub_key}": sub_value for sub_key, sub_value in keys.items()}
            )
    return given


def _field_section(model_cls: type[BaseModel], key: str, depth: int) -> type[BaseModel] | None:
    """The section model of `key`'s part at `depth` under `model_cls`, None for a plain value."""
    parts = key.split(".")
    fields = model_cls.model_fields
    if parts[depth] not in fields:
        raise ConfigError(_unknown_key(key, ".".join(parts[:depth]), model_cls))
    annotation = fields[parts[depth]].annotation
    return None if get_origin(annotation) is list else _submodel(annotation)  # data.sources: set whole


def _section_keys(section: type[BaseModel], value: Any, path: str) -> dict[str, Any]:
    """`value` given to a section as the keys it sets; a shorthand is read by the section's own model."""
    if isinstance(value, Mapping):
        return dict(value)
    try:
        return section.model_validate(value).model_dump(mode="json", exclude_unset=True)
    except ValidationError as err:
        where, message = first_problem(err)
        if where:  # read as the shorthand, but a bad one (`model.hash=X9`)
            raise ConfigError(f"{path}: {message}") from None
    example = next(iter(section.model_fields))
    raise ConfigError(f"{path} is a section; set one of its keys, e.g. --set {path}.{example}=...") from None


def _unknown_key(key: str, under: str, section: type[BaseModel]) -> str:
    """The one line for a key no section has, from a file or a --set alike."""
    return f"unknown key {key!r}; keys under {under or 'the top level'}: {', '.join(section.model_fields)}"


def _submodel(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", (annotation,))
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _deep_merge(
    base: dict[str, Any], update: Mapping[str, Any], section: type[BaseModel] | None = None
) -> None:
    """`update` (a file) over `base` (its `preset:`), key by key; a shorthand given to a section (of
    `section`'s) merges as `--set` merges it: `hash: H2B64` changes the spec and keeps the widths."""
    for key, value in update.items():
        field = section.model_fields.get(key) if section else None
        child = _submodel(field.annotation) if field and get_origin(field.annotation) is not list else None
        if child and not isinstance(value, Mapping) and isinstance(base.get(key), dict):
            with suppress(ConfigError):  # a bad shorthand: the validation names the file and the key
                value = _section_keys(child, value, key)
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value, child)
        else:
            base[key] = value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    """A nested mapping's (dotted key, value) pairs: `{"train": {"seed": 5}}` gives `("train.seed", 5)`."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    location, _ = first_problem(err)
    if first["type"] == "extra_forbidden":
        under = ".".join(str(part) for part in first["loc"][:-1])
        return _unknown_key(location, under, section_model(first["loc"][:-1]))
    if first["type"] == "missing":
        if section_model(first["loc"]) is not None:  # a whole section: what a preset gives
            return (
                f"missing section {location!r}; start the file with `preset: NAME` (one of "
                f"{', '.join(available_presets())}) or write the section"
            )
        at = next((i for i, part in enumerate(first["loc"]) if isinstance(part, int)), None)
        if at is not None:  # inside a list (data.sources), which --set replaces whole
            listed = ".".join(str(part) for part in first["loc"][:at])
            return (
                f"missing key {location!r}; give entry {first['loc'][at]} of {listed} a `{first['loc'][-1]}`"
            )
        return f"missing key {location!r}; add it to the config or pass --set {location}=..."
    return problem_line(err) + refused_value(err)


def section_model(loc: Iterable[str | int], root: type[BaseModel] = Config) -> type[BaseModel] | None:
    """The section a validation error's `loc` names under `root` (an index names an entry of a list of
    sections), None for a plain value."""
    model_cls: type[BaseModel] | None = root
    for part in loc:
        if isinstance(part, int):
            continue
        if model_cls is None or part not in model_cls.model_fields:
            return None
        model_cls = _submodel(model_cls.model_fields[part].annotation)
    return model_cls
