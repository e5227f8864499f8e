"""Device resolution, NPU branches included, tested with a fake `torch_npu` (never install torch-npu here)."""

import sys
import types

import pytest
import torch

from inference.runtime import devices
from inference.runtime.errors import UserError


class FakeNpu:
    def __init__(self, count: int):
        self.count = count
        self.synchronized = []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def synchronize(self, device=None):
        self.synchronized.append(device)

    # torch.manual_seed seeds every registered device module through these.
    def manual_seed_all(self, seed):
        pass

    def _is_in_bad_fork(self):
        return False


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """Install a fake torch_npu that, like the real one, names the privateuse1 backend 'npu'.

    The backend name cannot be undone, so afterwards `torch.npu` stays registered as an NPU module
    with no devices (other code, e.g. optimizers, probes the privateuse1 module once it is named).
    """

    def install(count: int = 1, import_error: Exception | None = None):
        module = types.ModuleType("torch_npu")
        if import_error is not None:
            def fail(name):
                raise import_error
            monkeypatch.setattr(devices.importlib, "import_module", fail)
        if torch._C._get_privateuse1_backend_name() != "npu":
            torch.utils.rename_privateuse1_backend("npu")
        npu = FakeNpu(count)
        monkeypatch.setitem(sys.modules, "torch_npu", module)
        torch.npu = npu
        return npu

    yield install
    torch.npu = FakeNpu(0)


@pytest.fixture
def no_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ImportError


def test_npu_without_torch_npu_is_one_clear_error(no_torch_npu):
    with pytest.raises(UserError, match="torch_npu.*CANN"):
        devices.resolve_device("npu")


def test_npu_whose_torch_npu_fails_without_cann_is_a_clear_error(fake_torch_npu):
    fake_torch_npu(import_error=RuntimeError("libascendcl.so: cannot open shared object file"))
    with pytest.raises(UserError, match="failed to initialise.*libascendcl"):
        devices.resolve_device("npu")


def test_npu_with_no_visible_device_is_a_clear_error(fake_torch_npu):
    fake_torch_npu(count=0)
    with pytest.raises(UserError, match="no NPU is visible"):
        devices.resolve_device("npu")


def test_npu_index_is_resolved_and_checked(fake_torch_npu):
    fake_torch_npu(count=2)
    assert devices.resolve_device("npu:1") == torch.device("npu", 1)
    with pytest.raises(UserError, match="only 2 NPU"):
        devices.resolve_device("npu:2")


def test_auto_prefers_npu(fake_torch_npu):
    fake_torch_npu(count=1)
    assert devices.resolve_device("auto") == torch.device("npu", 0)


def test_auto_falls_back_to_cpu_without_accelerators(no_torch_npu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.resolve_device("auto") == torch.device("cpu")


def test_synchronize_waits_on_the_npu(fake_torch_npu):
    npu = fake_torch_npu(count=1)
    devices.synchronize(torch.device("npu", 0))
    assert npu.synchronized == [torch.device("npu", 0)]


def test_cuda_without_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="no CUDA GPU"):
        devices.resolve_device("cuda")


@pytest.mark.parametrize("name", ["gpu", "npu:x", "cuda:-1", ""])
def test_unknown_device_names_are_rejected(name):
    with pytest.raises(UserError, match="unknown device"):
        devices.resolve_device(name)


def test_dtypes():
    assert devices.parse_dtype("auto") == devices.AUTO  # chosen per machine by calibration
    assert devices.parse_dtype("checkpoint") is None  # the checkpoint's own
    assert devices.parse_dtype("fp32") == torch.float32 and devices.dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(UserError, match="unknown dtype"):
        devices.parse_dtype("int4")
