"""What every drafter's config and proposals share: the heads config (`MedusaConfig`, also the feature drafter's),
its load error, and the draft vocabulary. Apart from the drafters themselves (medusa_heads.py,
feature_drafter.py), so that each can build on it without importing the other."""

from dataclasses import asdict, dataclass

import torch
from torch import nn

from medusa_choices import DynamicTree, Tree, TreeError, ranks_taken

LAYOUTS = ("shared_lm_head", "own_lm_head")
MEDUSA_HEAD_INPUTS = ("hidden", "hidden_and_next_token", "hidden_and_path")
HEAD_INPUTS = MEDUSA_HEAD_INPUTS + ("features",)  # "features": the feature drafter


class MedusaLoadError(ValueError):
    """Heads that do not fit the base model, or files that are missing or malformed."""


@dataclass
class MedusaConfig:
    medusa_num_heads: int
    medusa_num_layers: int = 1
    medusa_head_layout: str = "shared_lm_head"
    hidden_size: int | None = None
    vocab_size: int | None = None
    base_model_name_or_path: str | None = None
    medusa_choices: str | list | None = None  # the tree these heads were tuned with
    medusa_head_input: str = "hidden"
    medusa_draft_vocab_size: int | None = None  # proposals only from these most frequent tokens
    # acc[i][r]: how often head i's rank-r proposal is right on held-out data (train/medusa_tree_builder.py)
    medusa_head_accuracy: list | None = None
    medusa_feature_layer: dict | None = None  # the feature drafter's decoder layer (inference/runtime/feature_drafter.py)
    # base layers whose inputs a feature drafter fuses into the features of the text (None: the final ones only)
    medusa_feature_aux_layers: list | None = None

    def __post_init__(self):
        for name in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size", "medusa_draft_vocab_size"):
            value = getattr(self, name)
            optional = name not in ("medusa_num_heads", "medusa_num_layers")
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (optional and value is None):
                raise MedusaLoadError(f"{name} must be an integer, not {value!r}")
        for name in ("medusa_head_layout", "medusa_head_input"):
            if not isinstance(getattr(self, name), str):
                raise MedusaLoadError(f"{name} must be a string, not {getattr(self, name)!r}")
        if self.medusa_choices is not None and not isinstance(self.medusa_choices, (str, list)):
            raise MedusaLoadError(f"medusa_choices must be a tree name or a list of rank paths, not {self.medusa_choices!r}")
        if self.medusa_head_accuracy is not None:
            check_accuracy_table(self.medusa_head_accuracy)
        if self.medusa_head_layout not in LAYOUTS:
            raise MedusaLoadError(f"medusa_head_layout must be one of {LAYOUTS}, not {self.medusa_head_layout!r}")
        if self.medusa_head_input not in HEAD_INPUTS:
            raise MedusaLoadError(f"medusa_head_input must be one of {HEAD_INPUTS}, not {self.medusa_head_input!r}")
        if self.medusa_num_heads < 1 or self.medusa_num_layers < 0:
            raise MedusaLoadError("medusa_num_heads must be >= 1 and medusa_num_layers >= 0")
        if (self.medusa_feature_layer is not None) != (self.medusa_head_input == "features"):
            raise MedusaLoadError("medusa_feature_layer describes a feature drafter's layer: it goes with "
                                  "medusa_head_input 'features', and only there")
        aux = self.medusa_feature_aux_layers
        if aux is not None:
            if self.medusa_feature_layer is None:
                raise MedusaLoadError("medusa_feature_aux_layers belong to a feature drafter (medusa_head_input 'features')")
            if not (isinstance(aux, list) and aux and all(isinstance(i, int) and not isinstance(i, bool) and i >= 1
                                                          for i in aux) and aux == sorted(set(aux))):
                raise MedusaLoadError("medusa_feature_aux_layers must be a non-empty increasing list of layer indices "
                                      f">= 1, not {aux!r:.80}")
        if self.medusa_draft_vocab_size is not None:
            if self.medusa_head_layout != "shared_lm_head":
                raise MedusaLoadError("a draft vocabulary needs shared_lm_head heads")
            if self.medusa_draft_vocab_size < 1:
                raise MedusaLoadError("medusa_draft_vocab_size must be >= 1")

    @classmethod
    def from_dict(cls, data: dict) -> "MedusaConfig":
        if "medusa_num_heads" not in data:
            raise MedusaLoadError("the Medusa config has no medusa_num_heads")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        # Upstream Medusa configs predate layouts: their heads always carry their own lm_head.
        fields.setdefault("medusa_head_layout", "own_lm_head")
        return cls(**fields)

    def to_dict(self) -> dict:
        """Fields that are set; the default head input is left out so upstream-style configs stay upstream's."""
        data = {k: v for k, v in asdict(self).items() if v is not None}
        if data["medusa_head_input"] == "hidden":
            del data["medusa_head_input"]
        return data


def check_accuracy_table(table) -> None:
    """`medusa_head_accuracy` as the tree builder writes it: per head, per rank, a fraction in [0, 1]."""
    rows_ok = isinstance(table, list) and table and all(isinstance(row, list) and row for row in table)
    if not rows_ok or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 1
                              for row in table for a in row):
        raise MedusaLoadError("medusa_head_accuracy must be a non-empty list (one per head) of non-empty lists of "
                              f"fractions in [0, 1] (per rank), as train/medusa_tree_builder.py writes it; got {table!r:.80}")


class DraftVocabulary:
    """What every drafter shares about the tokens it proposes: the whole vocabulary, or a draft vocabulary (the
    `draft_vocab` buffer, most frequent token first) scored through those rows of the shared lm_head."""

    def init_draft_vocab(self, config: MedusaConfig) -> None:
        if config.medusa_draft_vocab_size is not None:
            self.register_buffer("draft_vocab", torch.zeros(config.medusa_draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None

    @property
    def proposal_size(self) -> int:
        """How many tokens the heads rank: their draft vocabulary's, else the whole vocabulary."""
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    def check_ranks(self, tree: Tree | DynamicTree) -> None:
        """A tree that takes the heads' top k proposals somewhere must find that many ranked tokens."""
        top_k = ranks_taken(tree)
        if top_k > self.proposal_size:
            raise TreeError(f"the tree takes the heads' top {top_k} proposals, but they rank only "
                            f"{self.proposal_size} tokens{' (their draft vocabulary)' if self.draft_vocab is not None else ''}")

    def proposal_lm_head(self, lm_head: nn.Linear) -> nn.Linear:
        """The projection proposals are scored with: the shared lm_head cut to the draft vocabulary (a copy:
        build it once, not per step), or the lm_head itself. Map its output indices back with `token_ids`."""
        if self.draft_vocab is None:
            return lm_head
        rows = nn.Linear(lm_head.in_features, len(self.draft_vocab), bias=False, device="meta")
        weight = lm_head.weight.detach().index_select(0, self.draft_vocab.to(lm_head.weight.device))
        rows.weight = nn.Parameter(weight, requires_grad=False)
        return rows

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Token ids of indices into the `proposal_lm_head` output."""
        return indices if self.draft_vocab is None else self.draft_vocab[indices]
