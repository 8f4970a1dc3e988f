"""train.precision (bf16 and bf16-pure through DeepSpeed, on CPU here) and train.compile, against fp32
eager."""

import gc
import warnings

import pytest
import torch
from safetensors.torch import load_file

from mhf_dist.config import load_config
from mhf_dist.data.tokenizer import TextTokenizer
from mhf_dist.errors import ConfigError
from mhf_dist.export import WEIGHTS_FILE, export_model, load_exported
from mhf_dist.models import build_model
from mhf_dist.train.engine import DeepSpeedStepper, check_training_options, uses_bf16

BF16_LOSS_TOLERANCE = 0.05  # nats: bf16 weights and activations, fp32 master weights and log-softmax
# nats over 6 steps: bf16 weights, gradients and Adam moments, fp32 log-softmax (measured: at most 0.002)
PURE_BF16_LOSS_TOLERANCE = 0.01


def losses(cfg, table, steps=6, compile_model=False, bf16=False):
    torch.manual_seed(0)
    model = build_model(cfg.model, table)
    if compile_model:
        model.compile()
    stepper = DeepSpeedStepper(model, cfg.train, zero_stage=0, world_size=1, bf16=bf16, hidden_size=64)
    rows = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))
    return [stepper.step({"tokens": rows})["loss"] for _ in range(steps)]


def test_a_bf16_fit_trains_and_stays_near_fp32(one_process_group, small_cfg, small_table):
    cfg = small_cfg.model_copy(
        update={"train": small_cfg.train.model_copy(update={"lr": 3e-3, "warmup_steps": 1})}
    )
    fp32, bf16 = losses(cfg, small_table), losses(cfg, small_table, bf16=True)
    assert bf16[-1] < bf16[0] - 0.3  # it trains
    assert bf16 != fp32  # it really ran in bf16
    for a, b in zip(fp32, bf16, strict=True):
        assert b == pytest.approx(a, abs=BF16_LOSS_TOLERANCE)


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


@pytest.fixture(scope="module")
def fast_cfg(small_cfg):
    return small_cfg.model_copy(
        update={"train": small_cfg.train.model_copy(update={"lr": 3e-3, "warmup_steps": 1})}
    )


@pytest.fixture(scope="module")
def fp32_curve(one_process_group, fast_cfg, small_table):
    return losses(fast_cfg, small_table)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_bf16_pure_holds_no_fp32_copy_tracks_fp32_and_checkpoints_and_exports(
    one_process_group, fast_cfg, small_table, fp32_curve, zero_stage, tmp_path
):
    """bf16-pure: the engine's weights and AdamW's moments are bf16 and no fp32 tensor the size of the
    weights exists after six steps, at every ZeRO stage; its checkpoint resumes to the same next step, and
    its export is the bf16 weights themselves."""
    train = fast_cfg.train.model_copy(update={"precision": "bf16-pure"})
    rows = torch.randint(0, 300, (8, 33), generator=torch.Generator().manual_seed(0))
    fp32_before = _fp32_bytes()
    torch.manual_seed(0)
    model = build_model(fast_cfg.model, small_table)
    weights = sum(p.numel() for p in model.parameters())
    stepper = DeepSpeedStepper(model, train, zero_stage, world_size=1, bf16=True, hidden_size=64)
    pure = [stepper.step({"tokens": rows})["loss"] for _ in range(6)]
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
    TextTokenizer.bytes().save(tokenizer)
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
    assert restored.step({"tokens": rows})["loss"] == stepper.step({"tokens": rows})["loss"]


def test_the_compiled_model_gives_the_eager_loss_curve(one_process_group, small_cfg, small_table):
    eager = losses(small_cfg, small_table, steps=2)
    compiled = losses(small_cfg, small_table, steps=2, compile_model=True)
    assert compiled == pytest.approx(eager, abs=1e-5)


def test_precision_resolves_per_device_and_unsupported_combinations_are_one_line():
    train = load_config("tiny").train
    assert uses_bf16(train, use_gpu=True) and not uses_bf16(train, use_gpu=False)  # auto
    assert uses_bf16(train.model_copy(update={"precision": "bf16"}), use_gpu=False)
    assert uses_bf16(train.model_copy(update={"precision": "bf16-pure"}), use_gpu=False)
    assert not uses_bf16(train.model_copy(update={"precision": "fp32"}), use_gpu=True)
    with pytest.raises(ConfigError, match=r"train.compile under ZeRO-3 is not supported; use --zero-stage 2"):
        check_training_options(train.model_copy(update={"compile": True}), zero_stage=3, use_gpu=False)
    check_training_options(train.model_copy(update={"compile": True}), zero_stage=2, use_gpu=False)
