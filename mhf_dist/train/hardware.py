"""What a training worker's hardware holds and can do: memory use and peak FLOP/s."""

from __future__ import annotations

import gc
import resource
import sys
import warnings

import torch


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Every reachable tensor's storage, each once: between steps, the model state's memory."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch attributes
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type != device_type:
            continue
        try:
            storage = obj.untyped_storage()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # meta, sparse or fake (torch.compile's) tensors
            continue
        if pointer:
            seen[pointer] = max(seen.get(pointer, 0), storage.nbytes())
    return sum(seen.values())


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's peak allocation on GPU, the peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched against the device name.
GPU_PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def default_peak_flops(device: torch.device) -> float:
    """The bf16 peak of a known GPU; 0 (MFU left out) for CPUs and GPUs not in the table."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_BF16_FLOPS.items() if key in name), 0.0)
