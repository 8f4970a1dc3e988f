"""`mhf plan`: model states from DeepSpeed's estimators (bf16 mixed) and against the live tensors of
bf16-pure engines, activation counts against what autograd keeps."""

import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from mhf_dist.cli import main
from mhf_dist.config import load_config
from mhf_dist.errors import ConfigError
from mhf_dist.models import build_model, param_count
from mhf_dist.models.checkpointing import checkpoint_layers
from mhf_dist.plan import (
    GIB,
    Cluster,
    activation_bytes,
    io_activation_bytes,
    largest_layer_params,
    layer_activation_elements,
    micro_batches,
    model_state_bytes,
    plan,
    recommend,
)
from mhf_dist.signatures import SignatureTable
from mhf_dist.train.engine import DeepSpeedStepper
from mhf_dist.train.hardware import live_tensor_bytes


def _built(model_cfg):
    table = None
    if model_cfg.family == "mhf":
        tokens = [str(i) for i in range(model_cfg.vocab_size)]
        table = SignatureTable.build(tokens, model_cfg.hash.num_hashes, model_cfg.hash.num_buckets)
    torch.manual_seed(0)
    return build_model(model_cfg, table)


@pytest.mark.parametrize("family", ["mhf", "qwen3"])
def test_model_states_agree_with_deepspeeds_estimators_called_directly(family):
    cfg = load_config("tiny", [f"model.family={family}", "train.seq_len=256"])
    cluster = Cluster(gpus_per_node=4, nodes=2, gpu_mem_gb=16)
    result = plan(cfg, family, 5000, cluster, tokens=1e9, mfu=0.4)
    model_cfg = cfg.model.model_copy(update={"vocab_size": 5000})
    params, largest = model_to_params(_built(model_cfg))
    assert result.params == params == param_count(model_cfg)
    assert result.largest_layer_params == largest == largest_layer_params(model_cfg)
    zero2 = estimate_zero2_model_states_mem_needs(params, 4, 2, cpu_offload=False)[1]
    zero3 = estimate_zero3_model_states_mem_needs(params, largest, 4, 2, False, False)[1]
    assert result.state_gb[2] == pytest.approx(zero2 / GIB, rel=1e-12)
    assert result.state_gb[3] == pytest.approx(zero3 / GIB, rel=1e-12)
    # ZeRO-0 partitions nothing: on any number of GPUs it holds what DeepSpeed's estimate gives one GPU.
    unpartitioned = estimate_zero2_model_states_mem_needs(params, 1, 1, cpu_offload=False)[1]
    assert result.state_gb[0] == pytest.approx(unpartitioned / GIB, rel=1e-12)
    assert result.state_gb[0] > result.state_gb[1] > result.state_gb[2]


def _pure_bf16_state_bytes(zero_stage, world_size, rank):
    """(live bytes, parameters, largest layer) of a bf16-pure engine on this worker, after a backward
    once AdamW's moments exist: every live tensor's storage counted once (weights or their ZeRO
    partitions, gradients, moments, DeepSpeed's flat buffers), less the model's buffers."""
    overrides = ["model.vocab_size=300", "model.hash.spec=H2B64", "train.precision=bf16-pure"]
    cfg = load_config("tiny", [*overrides, f"train.batch_size={4 * world_size}"])
    table = SignatureTable.build([f"tok{i}" for i in range(300)], 2, 64)
    rows = torch.randint(0, 300, (4, 33), generator=torch.Generator().manual_seed(rank))
    gc.collect()
    before = live_tensor_bytes()
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    params, largest = model_to_params(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # signatures, RoPE: not states
    stepper = DeepSpeedStepper(model, cfg.train, zero_stage, world_size, bf16=True, hidden_size=64)
    stepper.step({"tokens": rows})
    stepper.engine.backward(stepper.engine(tokens=rows).loss)
    gc.collect()
    measured = live_tensor_bytes() - before - buffers
    stepper.engine.step()
    return measured, params, largest


def _planned_resident(params, largest, zero_stage, gpus):
    """The plan's bf16-pure bytes less ZeRO-3's gathered largest layer (weights and gradient), which
    lives only inside that layer's forward and backward."""
    planned = model_state_bytes(params, largest, zero_stage, Cluster(gpus, 1, 80), pure_bf16=True)
    return planned - 4 * largest if zero_stage == 3 else planned


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_pure_model_states_are_the_live_bytes_of_a_bf16_pure_engine(one_process_group, zero_stage):
    """Measured, not recomputed, on one worker, where no stage partitions anything: the bytes per
    parameter (8 at ZeRO-0; 10 with DeepSpeed's bf16 master partition at 1-3)."""
    measured, params, largest = _pure_bf16_state_bytes(zero_stage, world_size=1, rank=0)
    assert measured == pytest.approx(_planned_resident(params, largest, zero_stage, 1), rel=0.01)
    mixed = model_state_bytes(params, largest, zero_stage, Cluster(1, 1, 80))
    assert measured < 0.55 * mixed  # no fp32 master weights, gradients or moments


def _measure_on_worker(rank, rendezvous, stages, results):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    # A file, not a free port probed beforehand, which another test's process could take meanwhile.
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    for stage in stages:
        results.put((rank, stage, *_pure_bf16_state_bytes(stage, world_size=2, rank=rank)))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_bf16_pure_partitions_are_what_two_workers_hold(tmp_path):
    """Two gloo workers (about 25 s): what ZeRO-2 and ZeRO-3 partition over N, which one worker cannot
    show. (ZeRO-1 holds 6.1 B/param here after DeepSpeed's reduce; the plan's 7 counts the whole
    gradients the backward produces before it.)"""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    rendezvous = tmp_path / "rendezvous"
    workers = [
        context.Process(target=_measure_on_worker, args=(r, rendezvous, (2, 3), results)) for r in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
        assert worker.exitcode == 0, "a measuring worker failed (its traceback is in the captured stderr)"
    measured = [results.get(timeout=10) for _ in range(4)]
    for _rank, stage, live, params, largest in measured:
        assert live == pytest.approx(_planned_resident(params, largest, stage, 2), rel=0.03)
        assert live < 0.7 * _planned_resident(params, largest, stage, 1)  # really partitioned


def _kept_by_autograd(model, tokens):
    """Bytes of the distinct non-parameter storages autograd saves for the backward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in params:
            kept[storage.data_ptr()] = max(kept.get(storage.data_ptr(), 0), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    return sum(kept.values())


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.family=qwen3"],
        ["model.family=qwen3", "model.vocab_size=4000", "model.backbone.num_layers=3"],
        ["model.family=mhf"],
        ["model.family=mhf", "model.hash.spec=H4B512", "model.backbone.intermediate_size=256"],
    ],
    ids=["qwen3", "qwen3-V4000-3-layers", "mhf", "mhf-H4B512"],
)
def test_activation_counts_match_what_autograd_keeps(overrides):
    """fp32 on CPU: every kept tensor is 4 bytes an element, so the count itself is what is checked."""
    model_cfg = load_config("tiny", overrides).model
    batch, seq_len = 2, 64
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1))
    measured = _kept_by_autograd(_built(model_cfg), tokens) / (batch * seq_len)
    layers = model_cfg.backbone.num_layers * layer_activation_elements(model_cfg.backbone) * 4
    predicted = layers + io_activation_bytes(model_cfg, dtype_bytes=4)[0]
    assert predicted == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("family", ["qwen3", "mhf"])
def test_checkpointed_activations_are_what_autograd_keeps_outside_the_recomputed_layers(family):
    """Kept: each layer's input and the output side (all of it for qwen3; mhf recomputes its cascade, so
    the plan's output side is an upper bound there)."""
    model_cfg = load_config("tiny", [f"model.family={family}"]).model
    batch, seq_len = 2, 64
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len + 1))
    model = _built(model_cfg)
    checkpoint_layers(model)
    measured = _kept_by_autograd(model, tokens) / (batch * seq_len)
    kept = model_cfg.backbone.num_layers * model_cfg.backbone.hidden_size * 4
    # The plan: what autograd keeps, one layer live again while it is recomputed, the output's backward.
    planned = activation_bytes(model_cfg, seq_len, batch, dtype_bytes=4, checkpointing=True) / (
        batch * seq_len
    )
    recompute = layer_activation_elements(model_cfg.backbone) * 4
    kept_by_plan = planned - recompute - io_activation_bytes(model_cfg, dtype_bytes=4)[1]
    if family == "qwen3":
        assert kept_by_plan == pytest.approx(measured, rel=0.02)
    else:
        assert kept < measured < kept_by_plan
    big = load_config("1b").model  # where the layers dominate: 20 x 2048 wide
    full = activation_bytes(big, 2048, 1)
    assert activation_bytes(big, 2048, 1, checkpointing=True) < 0.5 * full


def test_recommendation_prefers_big_micro_batches_below_zero3_that_train_takes():
    states = {0: 20 * GIB, 1: 8 * GIB, 2: 6 * GIB, 3: 3 * GIB}
    assert micro_batches(8, 3, None) == [2, 1]  # 8 rows do not split over 3 GPUs: powers of two to 3
    powers = micro_batches(1000, 3, None)
    assert powers == [64, 32, 16, 8, 4, 2, 1]
    assert recommend(states, GIB, usable=100 * GIB, sizes=powers) == (0, 64)
    assert recommend(states, GIB, usable=30 * GIB, sizes=powers) == (1, 16)
    assert recommend(states, GIB, usable=30 * GIB, sizes=micro_batches(8, 2, 4)) == (0, 4)  # --micro-batch
    assert recommend(states, 7 * GIB, usable=10 * GIB, sizes=powers) == (3, 1)
    assert recommend(states, 8 * GIB, usable=10 * GIB, sizes=powers) == (None, 1)
    # a divisor of each GPU's share of the batch, as `mhf train` takes it: 96 rows over 8 GPUs are 12 each
    assert micro_batches(96, 8, None) == [12, 6, 4, 3, 2, 1]
    assert recommend(states, GIB, usable=30 * GIB, sizes=micro_batches(96, 8, None)) == (1, 12)
    assert micro_batches(2048, 2, None)[0] == 64  # at most MAX_MICRO_BATCH


def test_mhf_plan_prints_mhf_and_qwen3_at_both_vocabularies(capsys):
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--tokens", "1e9"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| mhf") or line.startswith("| qwen3")]
    vocabularies = {row.split("|")[2].strip() for row in rows}  # the config's and Qwen3's own
    assert len(rows) == 4 and vocabularies == {f"{load_config('tiny').model.vocab_size:,}", "151,936"}
    assert "| bf16 " in out and "bf16 mixed precision: fp32 master weights" in out
    assert [row[-1] for row in _table_rows(out)[1:]] == ["0.00"] * 4  # days
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--tokens", "1e99"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("; 1.00e+90B tokens")  # not a 90-digit number
    days = [row[-1] for row in _table_rows(out)[1:]]
    assert len(days) == 4 and all(re.fullmatch(r"\d\.\d\de\+\d\d", day) for day in days), days
    huge = ["--gpus", "100000000000000000000", "--micro-batch", "1000000000000000000"]  # (a 64-bit key)
    assert main(["plan", "--config", "tiny", "--gpu-mem-gb", "1", *huge]) == 2
    captured = capsys.readouterr()
    assert "x 1.00e+20 GPU(s)" in captured.out and "micro-batch 1.00e+18)" in captured.err
    assert {row[-4] for row in _table_rows(captured.out)[1:]} == {"1.00e+18"}  # the micro-batch column
    assert main(["plan", "--config", "tiny", "--gpu-mem-gb", "1", "--gpus", "100000000000000000000"]) == 0
    tokens_per_s = [row[-2] for row in _table_rows(capsys.readouterr().out)[1:]]
    assert len(tokens_per_s) == 4 and all(re.fullmatch(r"\d\.\d\de\+\d\d", cell) for cell in tokens_per_s)
    assert main(["plan", "--config", "tiny", "--gpus", "1", "--gpu-mem-gb", "80", "--tokens", "1e17"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("; 1.00e+08B tokens")
    pure = ["--set", "train.precision=bf16-pure"]
    assert (
        main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--tokens", "1e9", *pure]) == 0
    )
    out = capsys.readouterr().out
    assert "| bf16-pure " in out and "bf16-pure: bf16 weights, grads and Adam moments, no fp32 copy" in out
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--mfu", "2"]) == 2
    assert "--mfu" in capsys.readouterr().err  # the flag's own range check
    with pytest.raises(ConfigError, match=r"^--mfu is a fraction of peak in \(0, 1\], got 2"):
        plan(load_config("tiny"), "mhf", 2048, Cluster(2, 1, 1.0), 1e9, 2.0)
    triple = ["--set", "model.backbone.kind=triple_hybrid"]
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", *triple]) == 2
    assert "model.backbone.kind=triple_hybrid has no activation model" in capsys.readouterr().err
    # --seq-len is the config's train.seq_len: it wins over a --set of it (which need not fit the model's
    # positions), and the default token budget is steps x batch x its seq_len
    budget = ["--set", "train.steps=1000000", "--set", "train.batch_size=8", "--set", "train.seq_len=8192"]
    plan_argv = ["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "80", *budget]
    assert main([*plan_argv, "--seq-len", "128"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert ", seq_len 128; " in first and first.endswith("; 1.0B tokens")  # 1,000,000 x 8 x 128
    assert main([*plan_argv, "--seq-len", "16", "--set", "train.steps=10"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("; 1,280 tokens")  # 10 x 8 x 16, not 0.0B
    # a cluster whose GPUs the batch does not split over, or a micro-batch train would refuse, is said
    for cluster, line in (
        (
            ["--gpus", "6"],
            "warning: mhf train on 6 GPUs would refuse this: train.batch_size=256 does not split",
        ),
        (
            ["--gpus", "8", "--micro-batch", "3"],
            "warning: mhf train on 8 GPUs would refuse this: train.micro",
        ),
        (["--gpus", "8"], "GB: GiB per GPU."),  # the legend is the last line
    ):
        assert main(["plan", "--config", "1b", "--gpu-mem-gb", "80", *cluster]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(line)
    # the config's train.micro_batch_size (the 1b preset's 8) is planned; without one, the largest that fits
    unset_micro = ["--set", "train.micro_batch_size=null"]
    for micro, chosen, legend in (
        ([], {"8"}, "stage: the lowest that fits train.micro_batch_size=8 in 90% of a GPU"),
        (["--micro-batch", "4"], {"4"}, "stage: the lowest that fits train.micro_batch_size=4 in"),
        (unset_micro, {"16", "32"}, "(no train.micro_batch_size is set, so mhf train would run each GPU's"),
    ):
        assert main(["plan", "--config", "1b", "--gpu-mem-gb", "80", "--gpus", "8", *micro]) == 0
        out = capsys.readouterr().out
        assert {row[-4] for row in _table_rows(out)[1:]} == chosen and legend in out.splitlines()[-1]
    # a topology key could only be ignored: the cluster is --gpus x --nodes, every stage is planned
    assert (
        main(["plan", "--config", "1b", "--gpu-mem-gb", "80", "--gpus", "8", "--set", "topology.workers=3"])
        == 2
    )
    assert capsys.readouterr().err == (
        "error: --set topology.workers: mhf plan plans --gpus x --nodes at every ZeRO stage; drop it\n"
    )
    # a plan for more positions than the model has is refused
    positions = load_config("tiny").model.backbone.max_position_embeddings
    assert main(["plan", "--config", "tiny", "--gpus", "2", "--gpu-mem-gb", "1", "--seq-len", "100000"]) == 2
    assert capsys.readouterr().err == (
        f"error: train.seq_len=100000 is above model.backbone.max_position_embeddings={positions}; lower "
        "train.seq_len or raise max_position_embeddings\n"
    )


def _table_rows(out):
    return [
        [cell.strip() for cell in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| ")
    ]


def test_the_plan_on_stdout_is_the_plan_alone():
    """DeepSpeed, looking for a device on a machine without GPUs, warns on stdout: `plan > plan.md`."""
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    argv = [sys.executable, "-m", "mhf_dist.cli", "plan", "--config", "tiny", "--gpus", "2",
            "--gpu-mem-gb", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("preset tiny, ") and "WARNING" not in done.stdout + done.stderr
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**env, "DS_ACCELERATOR": "foo"}, timeout=120
    )
    assert done.returncode == 2 and done.stderr.startswith(
        "error: DS_ACCELERATOR='foo': DS_ACCELERATOR must be"
    )
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_row_where_nothing_fits_shows_no_throughput_or_days(capsys):
    argv = [
        "plan",
        "--config",
        "tiny",
        "--gpus",
        "2",
        "--gpu-mem-gb",
        "0.01",
        "--vocab",
        "2048",
        "--vocab",
        "151936",
    ]
    assert main(argv) == 0  # the other rows fit
    header, *rows = _table_rows(capsys.readouterr().out)
    rows = {(row[0], row[1]): dict(zip(header, row, strict=True)) for row in rows}
    assert rows[("qwen3", "151,936")]["stage"] == "none fits"
    assert (rows[("qwen3", "151,936")]["tokens/s"], rows[("qwen3", "151,936")]["days"]) == ("-", "-")
    fitting = rows[("qwen3", "2,048")]
    assert fitting["stage"] != "none fits" and int(fitting["tokens/s"].replace(",", "")) > 0
    assert float(fitting["days"]) >= 0


def test_when_nothing_fits_at_all_plan_exits_2_with_the_least_need_and_the_fixes(capsys):
    assert main(["plan", "--config", "tiny", "--gpus", "1", "--gpu-mem-gb", "0.0001", "--tokens", "1e9"]) == 2
    captured = capsys.readouterr()
    header, *rows = _table_rows(captured.out)  # the table still says what each would need
    assert len(rows) == 4 and all(row[header.index("tokens/s")] == "-" for row in rows)
    (line,) = captured.err.splitlines()
    assert line.startswith("error: no family and vocabulary fits in 90% of 0.0001 GiB per GPU (the least, ")
    assert line.endswith(
        "give more GPUs (--gpus, --nodes: ZeRO-1 to 3 split the model states), a bigger --gpu-mem-gb, "
        "a shorter --seq-len or --set train.activation_checkpointing=layers"
    )
    # The least need is the smallest stage's states plus one sequence's activations of the smallest plan.
    cfg = load_config("tiny")
    plans = [plan(cfg, family, vocab, Cluster(1, 1, 0.0001), 1e9, 0.4)
             for vocab in (cfg.model.vocab_size, 151_936) for family in ("mhf", "qwen3")]  # fmt: skip
    least = min(min(p.state_gb.values()) + p.activation_gb_per_sequence for p in plans)
    assert f"needs {least:.1f} GiB at ZeRO-" in line


@pytest.mark.parametrize("field", ["gpu_mem_gb", "peak_tflops"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_cluster_refuses_memory_or_peak_that_is_not_positive_and_finite(field, value):
    flag = {"gpu_mem_gb": "--gpu-mem-gb", "peak_tflops": "--peak-tflops"}[field]
    with pytest.raises(ConfigError, match=rf"^{flag} must be a positive finite number, got {value!r}$"):
        Cluster(**{"gpus_per_node": 1, "nodes": 1, "gpu_mem_gb": 80.0, field: value})
    with pytest.raises(ConfigError, match=r"^--nodes is a count of at least 1, got 0$"):
        Cluster(1, 0, 80.0)


def test_plan_refuses_a_token_count_that_is_not_positive_and_finite():
    cfg = load_config("tiny")
    for tokens in (0.0, float("nan")):
        with pytest.raises(ConfigError, match=r"^--tokens must be a positive finite number"):
            plan(cfg, "mhf", 2048, Cluster(1, 1, 80.0), tokens, 0.4)


@pytest.mark.parametrize("mfu, peak", [(1e-310, 989.0), (0.5, 1e300)])
def test_a_throughput_that_overflows_is_one_line_not_inf_days(mfu, peak):
    with pytest.raises(
        ConfigError, match=r"tokens/s and no finite number of days; give the MFU and peak of a real"
    ):
        plan(load_config("tiny"), "mhf", 2048, Cluster(1, 1, 80.0, peak), 1e9, mfu)
