import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

torch.set_num_threads(2)
# Compiling a step costs seconds even for the tiny models: only the tests of graph mode ask for it.
os.environ["OPENPANGU_MEDUSA_COMPILE"] = "off"


@pytest.fixture(scope="session")
def tiny_pangu(tmp_path_factory):
    """(directory, fp32 model) of a tiny OpenPangu-Embedded checkpoint in the real layout."""
    from tiny_pangu import write_tiny_pangu

    directory = tmp_path_factory.mktemp("tiny_pangu")
    model = write_tiny_pangu(directory)
    return directory, model


@pytest.fixture(scope="session")
def pangu_on_device(tiny_pangu):
    """The tiny OpenPangu model (fp32) on the test device: the CPU's copy itself, else a copy moved there."""
    import copy

    from inference.runtime.devices import resolve_device
    from medusa_helpers import TEST_DEVICE

    model = tiny_pangu[1]
    if TEST_DEVICE.type == "cpu":
        return model
    return copy.deepcopy(model).to(resolve_device(str(TEST_DEVICE)))  # one clear line where it is not there


@pytest.fixture(scope="session")
def demo_dir():
    from inference.runtime.demo_model import prepare_demo_model

    return prepare_demo_model(quiet=True)


@pytest.fixture(scope="session")
def demo_model(demo_dir):
    """The demo model in fp32 (greedy equality needs fp32: bf16 ties break differently across kernels)."""
    from inference.runtime.loading import load_causal_lm, load_tokenizer

    return load_causal_lm(demo_dir, torch.device("cpu"), torch.float32), load_tokenizer(demo_dir)
