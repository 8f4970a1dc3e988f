"""`mhf plan`: per-GPU memory at ZeRO 0-3, the stage (and micro-batch) that fits, tokens/s and days.

Model states (Adam) in bytes per parameter, by train.precision (`MIXED_BYTES`, `PURE_BF16_BYTES`;
tests/test_plan.py checks them against live engines):
  bf16 mixed (bf16, auto): 2 bf16 weights, 2 bf16 + 4 fp32 grads, 4 fp32 master weights, 8 Adam moments.
  ZeRO 2 and 3 are DeepSpeed's own estimators (no offload); it has none for 0 and 1, so they count the
  same with nothing partitioned (0: 20) or the fp32 states and optimizer partitioned (1: 4 + 16/N).
  bf16-pure (no fp32 copy; `train/engine.py`): 2 bf16 weights, 2 bf16 grads, 4 for two bf16 moments and,
  at ZeRO 1-3, DeepSpeed's bf16 "master" partition (2). ZeRO-0: 8 (AdamW steps the weights themselves);
  ZeRO-1: 4 + 6/N (gradients whole); ZeRO-2: 2 + 8/N; ZeRO-3: 10/N plus the gathered largest layer's
  weights and grads (4, as DeepSpeed's ZeRO-3 estimator counts it).
Activations: what autograd keeps for the backward per token (checkpointing: each layer's input plus one
  layer recomputed), with fused attention (no T x T scores). Per Qwen3 layer 4h + 6q + 5kv + 4I elements
  (h hidden, q/kv query/key-value widths, I the MLP width). Output side: qwen3 keeps fp32
  log-probabilities over V (its backward briefly V-wide gradients in fp32 and bf16); mhf keeps (2H-1) x B
  coordinate tensors and encoder/decoder widths, which do not grow with V. tests/test_plan.py checks these.
Throughput: tokens/s = MFU x peak FLOP/s x GPUs / (3 x forward FLOPs per token, as `mhf count` reports).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mhf_dist.config import BackboneConfig, Config, ModelConfig, micro_batch_size
from mhf_dist.errors import ConfigError
from mhf_dist.interrupts import importing

GIB = 1024**3
PLAN_FAMILIES = ("mhf", "qwen3", "qwen3_matched")
ZERO_STAGES = (0, 1, 2, 3)
ACCELERATOR_VARIABLE = "DS_ACCELERATOR"  # DeepSpeed's choice of device, read once, at its first use
# Kept free on every GPU: the CUDA context, NCCL buffers and allocator fragmentation.
MEMORY_RESERVE = 0.10
MAX_MICRO_BATCH = 64
FP32 = 4
# Model-state bytes per parameter by ZeRO stage (see the module's docstring): (held whole, of the
# largest layer gathered, partitioned over the GPUs). Mixed ZeRO 2 and 3 are DeepSpeed's estimators.
MIXED_BYTES = {0: (20, 0, 0), 1: (4, 0, 16)}
PURE_BF16_BYTES = {0: (8, 0, 0), 1: (4, 0, 6), 2: (2, 0, 8), 3: (0, 4, 10)}


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int
    nodes: int
    gpu_mem_gb: float
    peak_tflops: float = 989.0  # H100/H200 dense bf16

    def __post_init__(self) -> None:
        for flag, value in (("--gpus", self.gpus_per_node), ("--nodes", self.nodes)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} is a count of at least 1, got {value!r}")
        for flag, value in (("--gpu-mem-gb", self.gpu_mem_gb), ("--peak-tflops", self.peak_tflops)):
            check_positive(flag, value)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Plan:
    family: str
    vocab_size: int
    precision: str  # "bf16-pure" or "bf16" (mixed: fp32 master weights and Adam states)
    params: int
    largest_layer_params: int
    state_gb: dict[int, float]  # ZeRO stage -> model states per GPU
    activation_gb_per_sequence: float
    stage: int | None  # None: nothing fits
    micro_batch: int
    per_gpu_gb: float  # at `stage`; when nothing fits, what ZeRO-3 would need
    checkpointing: bool  # train.activation_checkpointing=layers
    tokens_per_s: float | None  # None: nothing fits
    days: float | None


def check_positive(flag: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} must be a positive finite number, got {value!r}")


@contextmanager
def _deepspeed_told_no_device() -> Iterator[None]:
    """DeepSpeed imported with DS_ACCELERATOR=cpu (unless the user set it): it warns on stdout, in the plan's
    table, of a device it finds none of. It decides once per process: training after planning keeps cpu."""
    chosen = os.environ.get(ACCELERATOR_VARIABLE)
    if chosen is None:
        os.environ[ACCELERATOR_VARIABLE] = "cpu"
    try:
        with importing():  # DeepSpeed's import runs torch's C++
            yield
    except ValueError as err:  # DeepSpeed's refusal of an accelerator name it does not know
        raise ConfigError(f"{ACCELERATOR_VARIABLE}={chosen!r}: {err}; unset it or fix it") from None
    finally:
        if chosen is None:
            os.environ.pop(ACCELERATOR_VARIABLE, None)


def model_state_bytes(
    params: int, largest_layer_params: int, stage: int, cluster: Cluster, pure_bf16: bool = False
) -> int:
    """Per-GPU bytes of weights, gradients and optimizer states at a ZeRO stage (see `MIXED_BYTES`)."""
    with _deepspeed_told_no_device():
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    per_node, nodes = cluster.gpus_per_node, cluster.nodes
    counts = PURE_BF16_BYTES if pure_bf16 else MIXED_BYTES
    if stage in counts:
        whole, gathered, partitioned = counts[stage]
        return whole * params + gathered * largest_layer_params + int(partitioned * params / cluster.gpus)
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=False)[1]
    if stage == 3:
        return estimate_zero3_model_states_mem_needs(
            params, largest_layer_params, per_node, nodes, cpu_offload=False, cpu_offload_params=False
        )[1]
    raise ConfigError(f"ZeRO stage {stage} does not exist; choose 0, 1, 2 or 3")


def layer_activation_elements(backbone: BackboneConfig) -> int:
    """Elements per token one Qwen3 decoder layer keeps for the backward pass: two RMSNorm inputs and
    outputs, Q/K norms, RoPE, attention inputs and output, the SwiGLU products."""
    q = backbone.num_heads * backbone.head_dim
    kv = backbone.num_kv_heads * backbone.head_dim
    return 4 * backbone.hidden_size + 6 * q + 5 * kv + 4 * backbone.intermediate_size


def io_activation_bytes(model: ModelConfig, dtype_bytes: int) -> tuple[int, int]:
    """(bytes kept, bytes held briefly in the backward) per token outside the decoder layers."""
    hidden = model.backbone.hidden_size
    edges = (3 * hidden + 1) * dtype_bytes  # embedding output, final norm input and output
    if model.family != "mhf":
        return edges + FP32 * model.vocab_size, (FP32 + dtype_bytes) * model.vocab_size
    hashes, buckets = model.hash.num_hashes, model.hash.num_buckets
    if model.hash.io == "reference":
        # The H table rows, the gate's hidden and scores, the pooled vector; per cascade step the
        # [h; soft] input, the mixer's hidden and the new state.
        k = model.hash.bottleneck
        widths = (hashes + 1) * hidden + 2 * hashes * k + hashes + (hashes - 1) * (3 * hidden + 2 * k)
    else:
        d_hash, d_casc, mixer = model.hash_widths()
        widths = (
            (hashes + 1) * d_hash
            + 2 * hashes * model.hash.gate_hidden
            + 2 * (hashes - 1) * mixer
            + (5 * hashes - 2) * d_casc
        )
    # Each coordinate's fp32 log-probabilities; all but the last also keep exp() in fp32 and its copy
    # in the compute dtype for the soft bucket embedding (no copy when that dtype is fp32).
    copy = 0 if dtype_bytes == FP32 else dtype_bytes
    coordinates = hashes * buckets * FP32 + (hashes - 1) * buckets * (FP32 + copy)
    return edges + widths * dtype_bytes + coordinates, hashes * buckets * (FP32 + dtype_bytes)


def activation_bytes(
    model: ModelConfig, seq_len: int, micro_batch: int, dtype_bytes: int = 2, checkpointing: bool = False
) -> int:
    """Peak activation bytes of one micro-batch: everything kept, plus the output layer's backward.
    Checkpointing keeps each layer's input plus one recomputed layer; the output side is counted as
    without (an upper bound for `mhf`, whose cascade is recomputed too)."""
    kept, transient = io_activation_bytes(model, dtype_bytes)
    layer = layer_activation_elements(model.backbone)
    layers = model.backbone.num_layers * (model.backbone.hidden_size if checkpointing else layer)
    if checkpointing:
        layers += layer
    return micro_batch * seq_len * (layers * dtype_bytes + kept + transient)


def largest_layer_params(model: ModelConfig) -> int:
    """DeepSpeed's `model_to_params` measure (the most parameters one module owns), on a meta model."""
    import numpy as np

    with _deepspeed_told_no_device():
        import torch
        from deepspeed.runtime.zero.stage3 import model_to_params
    from mhf_dist.models import build_model
    from mhf_dist.signatures import SignatureTable, scheme_for_config

    table = None
    if model.family == "mhf":  # the rows do not matter to a meta model: zeros, not a (LSH: slow) build
        ids = [str(i) for i in range(model.vocab_size)]
        rows = np.zeros((len(ids), model.hash.num_hashes), np.uint32)
        table = SignatureTable(ids, rows, np.zeros(len(ids), np.uint32), scheme_for_config(model.hash))
    with torch.device("meta"):
        built = build_model(model, table)
    return model_to_params(built)[1]


def micro_batches(batch_size: int, gpus: int, micro_batch: int | None) -> list[int]:
    """The micro-batches to try, largest first: the config's, else those `mhf train` takes (divisors of
    each GPU's share of train.batch_size) up to MAX_MICRO_BATCH, or powers of two up to the larger share
    where it does not split."""
    if micro_batch:
        return [micro_batch]
    if batch_size % gpus:
        return [2**k for k in range(min(MAX_MICRO_BATCH, -(-batch_size // gpus)).bit_length())][::-1]
    share = batch_size // gpus
    return [size for size in range(min(share, MAX_MICRO_BATCH), 0, -1) if share % size == 0]


def batch_split(cfg: Config, gpus: int) -> list[str]:
    """A warning where `mhf train` on `gpus` workers would refuse the config's batch split: the table then
    plans what it cannot run as configured."""
    try:
        micro_batch_size(cfg.train, gpus)
    except ConfigError as err:
        return [f"warning: mhf train on {readable(gpus, ',')} GPUs would refuse this: {err}"]
    return []


def recommend(
    state_bytes: dict[int, int], activation_per_sequence: int, usable: float, sizes: list[int]
) -> tuple[int | None, int]:
    """The stage and micro-batch to run: the largest of `sizes` that fits, at the lowest stage that fits
    it; ZeRO-3 (1.5x the communication of 0-2) only when 0-2 fit nothing."""
    for stages in ((0, 1, 2), (3,)):
        for size in sizes:
            for stage in stages:
                if state_bytes[stage] + size * activation_per_sequence <= usable:
                    return stage, size
    return None, sizes[-1]


def plan(
    cfg: Config,
    family: str,
    vocab_size: int,
    cluster: Cluster,
    tokens: float,
    mfu: float,
) -> Plan:
    """`family` at `vocab_size` on `cluster` at the config's train.seq_len and train.micro_batch_size, else
    the largest micro-batch that fits."""
    from mhf_dist.models import param_count
    from mhf_dist.models.registry import resolved_config, train_flops_per_token

    seq_len = cfg.train.seq_len
    if family not in PLAN_FAMILIES:
        raise ConfigError(f"mhf plan covers {', '.join(PLAN_FAMILIES)}; got --family {family}")
    if cfg.model.backbone.kind != "qwen3":
        raise ConfigError(
            f"mhf plan models Qwen3 decoder layers; model.backbone.kind={cfg.model.backbone.kind} has no "
            "activation model yet: plan with model.backbone.kind=qwen3 or measure a step (benchmarks/)"
        )
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu is a fraction of peak in (0, 1], got {mfu}")
    check_positive("--tokens", tokens)
    model = resolved_config(cfg.model.model_copy(update={"family": family, "vocab_size": vocab_size}))
    params = param_count(model)
    largest = largest_layer_params(model)
    pure = cfg.train.precision == "bf16-pure"
    states = {stage: model_state_bytes(params, largest, stage, cluster, pure) for stage in ZERO_STAGES}
    checkpointing = cfg.train.activation_checkpointing == "layers"
    per_sequence = activation_bytes(model, seq_len, 1, checkpointing=checkpointing)
    usable = cluster.gpu_mem_gb * GIB * (1 - MEMORY_RESERVE)
    sizes = micro_batches(cfg.train.batch_size, cluster.gpus, cfg.train.micro_batch_size)
    stage, size = recommend(states, per_sequence, usable, sizes)
    tokens_per_s = days = None
    if stage is not None:  # no throughput for a run that cannot start
        tokens_per_s = mfu * cluster.peak_tflops * 1e12 * cluster.gpus / train_flops_per_token(model, seq_len)
        days = tokens / tokens_per_s / 86400 if tokens_per_s > 0 else math.inf
        if not (math.isfinite(tokens_per_s) and math.isfinite(days)):  # over- or underflowed
            raise ConfigError(
                f"--mfu {mfu:g} of --peak-tflops {cluster.peak_tflops:g} for --tokens {tokens:g} gives "
                f"{tokens_per_s:g} tokens/s and no finite number of days; give the MFU and peak of a real GPU"
            )
    total = states[stage if stage is not None else 3] + size * per_sequence
    return Plan(
        family=family,
        vocab_size=vocab_size,
        precision="bf16-pure" if pure else "bf16",
        params=params,
        largest_layer_params=largest,
        state_gb={stage: value / GIB for stage, value in states.items()},
        activation_gb_per_sequence=per_sequence / GIB,
        stage=stage,
        micro_batch=size,
        per_gpu_gb=total / GIB,
        checkpointing=checkpointing,
        tokens_per_s=tokens_per_s,
        days=days,
    )


def plan_rows(plans: list[Plan]) -> list[dict[str, object]]:
    return [
        {
            "family": item.family,
            "V": item.vocab_size,
            "params (M)": f"{item.params / 1e6:.1f}",
            "precision": item.precision,
            **{f"ZeRO-{stage} GB": readable(gb, ".2f") for stage, gb in item.state_gb.items()},
            "act GB/seq": readable(item.activation_gb_per_sequence, ".2f"),
            "stage": "none fits" if item.stage is None else item.stage,
            "micro-batch": readable(item.micro_batch, ","),
            "GB/GPU": readable(item.per_gpu_gb, ".1f"),
            "tokens/s": "-" if item.tokens_per_s is None else round(item.tokens_per_s),
            "days": "-" if item.days is None else readable(item.days, ".2f"),
        }
        for item in plans
    ]


def readable(value: float, fixed: str) -> str:
    """`value` in the `fixed` format, or from a million on (a mistyped --tokens, --gpus or --micro-batch)
    as 1.23e+95, not as a 90-digit number."""
    return f"{value:{fixed}}" if abs(value) < 1e6 else f"{value:.2e}"


def token_count(tokens: float) -> str:
    """`tokens` in billions (100.0B), or written out below one (a tiny preset's 81,920)."""
    return f"{readable(tokens / 1e9, '.1f')}B" if tokens >= 1e9 else f"{tokens:,.0f}"


def plan_legend(cfg: Config) -> str:
    """What `plan_rows`' columns hold, for `cfg`'s precision and activation checkpointing."""
    layers = cfg.train.activation_checkpointing == "layers"
    checkpointing = "layers checkpointed" if layers else "no checkpointing"
    states = (
        "bf16-pure: bf16 weights, grads and Adam moments, no fp32 copy"
        if cfg.train.precision == "bf16-pure"
        else "bf16 mixed precision: fp32 master weights and Adam states"
    )
    fits = (
        f"stage: the lowest that fits train.micro_batch_size={readable(cfg.train.micro_batch_size, ',')} in "
        "90% of a GPU (train with --zero-stage S)"
        if cfg.train.micro_batch_size
        else "stage and micro-batch: the largest micro-batch that fits in 90% of a GPU, at the lowest stage "
        "(no train.micro_batch_size is set, so mhf train would run each GPU's whole share of the batch at "
        "once: train with --zero-stage S --set train.micro_batch_size=M)"
    )
    return (
        f"GB: GiB per GPU. ZeRO-k GB: weights, grads and Adam states ({states}); act GB/seq: "
        f"activations of one sequence, {checkpointing}; {fits}."
    )


def family_counts(cfg: Config) -> tuple[list[dict[str, object]], list[str]]:
    """`mhf count`'s rows: each family's layers, MLP width, parameters (also less mhf's and qwen3's) and
    forward GFLOP per token; and a line for each family whose parameter match is out of reach."""
    with importing():  # torch
        from mhf_dist.models import FAMILIES, forward_flops_per_token, param_count
        from mhf_dist.models.registry import resolved_config

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
    return rows, unmatched


def check_fits(plans: list[Plan], cluster: Cluster) -> None:
    """Nothing to run when no plan fits: one line with the least memory one needs and the ways out."""
    if not plans or any(item.stage is not None for item in plans):
        return
    options = [
        (gb + item.micro_batch * item.activation_gb_per_sequence, stage, item)
        for item in plans
        for stage, gb in item.state_gb.items()
    ]
    need, stage, smallest = min(options, key=lambda option: option[:2])
    fixes = ["more GPUs (--gpus, --nodes: ZeRO-1 to 3 split the model states)", "a bigger --gpu-mem-gb"]
    if smallest.micro_batch > 1:
        fixes.append("a smaller --micro-batch")
    fixes.append("a shorter --seq-len")
    if not smallest.checkpointing:
        fixes.append("--set train.activation_checkpointing=layers")
    raise ConfigError(
        f"no family and vocabulary fits in {1 - MEMORY_RESERVE:.0%} of {cluster.gpu_mem_gb:g} GiB per GPU "
        f"(the least, {smallest.family} at V={smallest.vocab_size:,}, needs {readable(need, '.1f')} GiB at "
        f"ZeRO-{stage}, micro-batch {readable(smallest.micro_batch, ',')}); give {', '.join(fixes[:-1])} or "
        f"{fixes[-1]}"
    )
