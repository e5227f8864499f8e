"""Hub ids resolve through the local Hugging Face cache (no network here), and fail clearly offline."""

import shutil

import pytest

from inference.runtime.errors import UserError
from inference.runtime.loading import resolve_model_dir
from medusa_helpers import random_heads
from medusa_model import MedusaModel, save_heads


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An HF cache laid out like huggingface_hub's (models--org--name/snapshots/REV + refs/main), offline."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read at import time from the environment
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo_id: str, source) -> None:
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        revision = "0123456789abcdef0123456789abcdef01234567"
        shutil.copytree(source, repo / "snapshots" / revision)
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(revision)

    return add


def test_base_and_heads_load_from_hub_ids_in_the_local_cache(tiny_pangu, tmp_path, hub_cache):
    directory, model = tiny_pangu
    save_heads(random_heads(model, num_heads=2), tmp_path / "heads")
    hub_cache("tiny-org/openpangu-tiny", directory)
    hub_cache("tiny-org/openpangu-tiny-medusa", tmp_path / "heads")
    loaded = MedusaModel.from_pretrained("tiny-org/openpangu-tiny", "tiny-org/openpangu-tiny-medusa",
                                         device="cpu", dtype="fp32", tree=[[0], [0, 0]])
    assert loaded.medusa_head.num_heads == 2
    out = [t for s in loaded.medusa_generate([1, 5, 9], max_new_tokens=6, eos_token_id=()) for t in s]
    assert len(out) == 6


def test_an_uncached_hub_id_offline_is_a_clear_error(hub_cache):
    with pytest.raises(UserError, match="could not fetch nobody/nothing"):
        resolve_model_dir("nobody/nothing")
