"""train.precision (bf16 and bf16-pure through DeepSpeed, on CPU here) and train.compile, against fp32
eager."""

import gc
import warnings

import pytest
import torch
from safetensors.torch import load_file

from mhf_dist.config import check_topology, load_config
from mhf_dist.errors import ConfigError
from mhf_dist.export import WEIGHTS_FILE, export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.train.engine import DeepSpeedStepper, check_precision_supported, uses_bf16

BF16_LOSS_TOLERANCE = 0.05  # nats: bf16 weights and activations, fp32 master weights and log-softmax
# nats over 6 steps: bf16 weights, gradients and Adam moments, fp32 log-softmax (measured: at most 0.002)
PURE_BF16_LOSS_TOLERANCE = 0.01
ROWS = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))


def stepper_for(cfg, table, compile_model=False, bf16=False):
    """A ZeRO-0 DeepSpeed engine on one worker around the model `cfg` describes, seeded."""
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    if compile_model:
        model.compile()  # in place, as the worker does
    return DeepSpeedStepper(model, cfg.train, zero_stage=0, world_size=1, bf16=bf16, hidden_size=64)


def losses(stepper, steps=6):
    return [stepper.step({"tokens": ROWS})["loss"] for _ in range(steps)]


@pytest.fixture(scope="module")
def fast_cfg(small_cfg):
    return small_cfg.model_copy(
        update={"train": small_cfg.train.model_copy(update={"lr": 3e-3, "warmup_steps": 1})}
    )


@pytest.fixture(scope="module")
def fp32_curve(one_process_group, fast_cfg, small_table):
    return losses(stepper_for(fast_cfg, small_table))


def test_a_bf16_fit_computes_in_bf16_on_fp32_master_weights_and_stays_near_fp32(
    one_process_group, fast_cfg, small_table, fp32_curve
):
    stepper = stepper_for(fast_cfg, small_table, bf16=True)
    engine = stepper.engine
    encoded = []  # the dtype of the hidden states the encoder hands the decoder stack, every forward
    hook = engine.module.encoder.register_forward_hook(lambda module, args, out: encoded.append(out.dtype))
    bf16 = losses(stepper)
    hook.remove()
    assert encoded == [torch.bfloat16] * len(bf16)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    adamw = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed wraps the torch AdamW
    weights = sum(p.numel() for p in engine.module.parameters())
    # mixed precision: AdamW steps an fp32 master copy of every weight
    assert {master.dtype for master in adamw.state} == {torch.float32}
    assert sum(master.numel() for master in adamw.state) == weights
    assert bf16[-1] < bf16[0] - 0.3  # it trains
    gaps = [abs(b - a) for a, b in zip(fp32_curve, bf16, strict=True)]
    assert max(gaps) > 0 and all(gap <= BF16_LOSS_TOLERANCE for gap in gaps)


def _fp32_bytes() -> int:
    """Bytes of the distinct storages of every live float32 tensor."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch attributes
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for tensor in tensors:
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
            continue
        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # sparse or fake (torch.compile's) tensors
            continue
        if pointer:
            storages[pointer] = storage.nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_pure_holds_no_fp32_copy_tracks_fp32_and_checkpoints_and_exports(
    one_process_group, fast_cfg, small_table, small_tokenizer, fp32_curve, zero_stage, tmp_path
):
    """bf16-pure: the engine's weights and AdamW's moments are bf16 and no fp32 tensor the size of the
    weights exists after six steps, at every ZeRO stage; its checkpoint resumes to the same next step, and
    its export is the bf16 weights themselves."""
    train = fast_cfg.train.model_copy(update={"precision": "bf16-pure"})
    fp32_before = _fp32_bytes()
    torch.manual_seed(0)
    model = build_model(fast_cfg.model, small_table)
    weights = sum(p.numel() for p in model.parameters())
    stepper = DeepSpeedStepper(model, train, zero_stage, world_size=1, bf16=True, hidden_size=64)
    pure = losses(stepper)
    assert pure != fp32_curve  # it really ran in bf16
    assert pure == pytest.approx(fp32_curve, abs=PURE_BF16_LOSS_TOLERANCE)
    assert pure[-1] < pure[0] - 0.3  # it trains

    engine = stepper.engine
    held = [p.ds_tensor if zero_stage == 3 else p for p in engine.module.parameters()]
    assert {p.dtype for p in held} == {torch.bfloat16}
    adamw = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch AdamW
    assert isinstance(adamw, torch.optim.AdamW)
    moments = [
        v for state in adamw.state.values() for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")
    ]
    assert {m.dtype for m in moments} == {torch.bfloat16}
    assert sum(m.numel() for m in moments) >= 2 * weights  # ZeRO pads its flat partitions
    assert {stepped.dtype for stepped in adamw.state} == {torch.bfloat16}  # the tensors AdamW updates
    # No fp32 master copy (4 B x weights): only scalars (AdamW's step counts, DeepSpeed's flags) are new.
    assert _fp32_bytes() - fp32_before < 1024 < 4 * weights

    engine.save_checkpoint(str(tmp_path / "state"), tag="state")
    tokenizer = tmp_path / "tokenizer.json"
    small_tokenizer.save(tokenizer)
    with stepper.whole_parameters():
        trained = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        export_model(engine.module, fast_cfg.model, small_table, tokenizer, tmp_path / "model")
    assert {t.dtype for t in load_file(tmp_path / "model" / WEIGHTS_FILE).values()} == {torch.bfloat16}
    exported = load_exported(tmp_path / "model").model.state_dict()
    for name, value in trained.items():
        assert torch.equal(exported[name], value.float()), name  # bf16 -> fp32 is exact

    torch.manual_seed(1)  # other initial weights, replaced by the checkpoint's
    restored = DeepSpeedStepper(
        build_model(fast_cfg.model, small_table), train, zero_stage, world_size=1, bf16=True, hidden_size=64
    )
    restored.engine.load_checkpoint(str(tmp_path / "state"), tag="state")
    assert restored.step({"tokens": ROWS})["loss"] == stepper.step({"tokens": ROWS})["loss"]


def test_the_compiled_model_runs_inductors_graphs_and_gives_the_eager_loss_curve(
    one_process_group, small_cfg, small_table
):
    from torch._dynamo.utils import counters

    eager = losses(stepper_for(small_cfg, small_table), steps=2)
    torch._dynamo.reset()  # compile afresh, not from graphs an earlier test left in this process
    counters.clear()
    compiled = losses(stepper_for(small_cfg, small_table, compile_model=True), steps=2)
    # Dynamo captured the model's graphs and AOTAutograd compiled them with their backward.
    assert counters["stats"]["unique_graphs"] > 0 and counters["aot_autograd"]["ok"] > 0
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_precision_resolves_per_device_and_unsupported_combinations_are_one_line(monkeypatch):
    train = load_config("tiny").train
    assert uses_bf16(train, use_gpu=True) and not uses_bf16(train, use_gpu=False)  # auto
    assert uses_bf16(train.model_copy(update={"precision": "bf16"}), use_gpu=False)
    assert uses_bf16(train.model_copy(update={"precision": "bf16-pure"}), use_gpu=False)
    assert not uses_bf16(train.model_copy(update={"precision": "fp32"}), use_gpu=True)
    with pytest.raises(
        ConfigError, match=r"train.compile under ZeRO-3 is not supported; set topology.zero_stage to 2"
    ):
        check_topology(load_config("tiny", ["train.compile=true", "topology.zero_stage=3"]))
    check_topology(load_config("tiny", ["train.compile=true", "topology.zero_stage=2"]))
    bf16 = load_config("tiny", ["train.precision=bf16"])
    check_precision_supported(bf16)  # this CPU's DeepSpeed accelerator has bf16 (the tests above use it)
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_bf16_supported", lambda: False)
    with pytest.raises(ConfigError, match=r"^train.precision=bf16: DeepSpeed's CPU accelerator .* use fp32$"):
        check_precision_supported(bf16)
    check_precision_supported(load_config("tiny", ["train.precision=fp32"]))
