"""Device and dtype resolution for Ascend NPU, CUDA and CPU.

`torch_npu` is imported only when an NPU is asked for (or probed by `auto`): importing it without the
Ascend CANN toolkit breaks `import torch` itself, so it must never be a hard dependency.
"""

import importlib
import re

import torch

from inference.runtime.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NPU_INSTALL_HINT = (
    "install the Ascend CANN toolkit, `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, "
    "then `pip install torch-npu` matching your torch version (see README, 'Ascend NPU')"
)


def _import_torch_npu():
    """Import torch_npu, turning every way it can fail into one actionable message."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as error:
        raise UserError(f"--device npu needs torch_npu, which could not be imported ({error}): {NPU_INSTALL_HINT}")
    except Exception as error:  # torch_npu raises assorted errors when CANN libraries are missing
        raise UserError(f"torch_npu failed to initialise ({type(error).__name__}: {error}): {NPU_INSTALL_HINT}")


def npu_available() -> bool:
    """True when torch_npu imports and sees at least one NPU; never raises."""
    try:
        _import_torch_npu()
        return bool(torch.npu.is_available())
    except (UserError, AttributeError):
        return False


def resolve_device(name: str = "auto") -> torch.device:
    """`auto|cpu|cuda[:N]|npu[:N]` to a torch.device; auto prefers npu, then cuda, then cpu."""
    name = name.strip().lower()
    if name == "auto":
        if npu_available():
            return torch.device("npu:0")
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    match = re.fullmatch(r"(cpu|cuda|npu)(?::(\d+))?", name)
    if not match:
        raise UserError(f"unknown device {name!r}: use auto, cpu, cuda, cuda:N, npu or npu:N")
    kind, index = match.group(1), int(match.group(2) or 0)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA GPU is visible to this torch build")
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        return torch.device("cuda", index)
    _import_torch_npu()
    if not torch.npu.is_available():
        raise UserError(f"--device npu: torch_npu is installed but no NPU is visible; {NPU_INSTALL_HINT}")
    if index >= torch.npu.device_count():
        raise UserError(f"--device {name}: only {torch.npu.device_count()} NPU(s) are visible")
    return torch.device("npu", index)


AUTO = "auto"  # a dtype chosen per machine from its calibrated step costs
CHECKPOINT = "checkpoint"  # the dtype the checkpoint's weights are stored in


def parse_dtype(name: str) -> torch.dtype | str | None:
    """`auto|checkpoint|bf16|fp16|fp32` as what the layers below take: AUTO (the fastest here, chosen from
    this machine's calibrated step costs), None (the checkpoint's own) or a torch.dtype."""
    name = name.strip().lower()
    if name == AUTO:
        return AUTO
    if name == CHECKPOINT:
        return None
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}: use auto, checkpoint, bf16, fp16 or fp32")
    return DTYPES[name]


def as_dtype(dtype: str | torch.dtype | None) -> torch.dtype | str | None:
    """A dtype given to the Python API as a name or a torch.dtype, in `parse_dtype`'s terms."""
    return parse_dtype(dtype) if isinstance(dtype, str) else dtype


def as_device(device: str | torch.device) -> torch.device:
    """A device given to the Python API as a name or a torch.device."""
    return resolve_device(device) if isinstance(device, str) else device


def dtype_name(dtype: torch.dtype) -> str:
    """bf16 / fp16 / fp32, the names the flags, messages and files use."""
    return {v: k for k, v in DTYPES.items()}[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so that wall-clock timings measure the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def set_threads(threads: int | None) -> None:
    """Pin intra-op CPU threads; on a 2-core machine an oversubscribed pool is 10-50x slower."""
    if threads is not None:
        if threads < 1:
            raise UserError("--threads must be at least 1")
        torch.set_num_threads(threads)
