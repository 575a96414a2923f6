"""The models a repository is built from (`ModelSpec`; export.repository.model_variants picks them from
the options): a trained scheme's weights, a rope inference-time scaling variant, a further training seed
(weights/seed<N>/<scheme>), or random weights of a size; what each is loaded as, for its export and for
the PyTorch run its graphs are checked against."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from contract.names import seed_model_name
from models.config import RopeScaling
from models.sizes import random_model
from models.transformer import Transformer

# The scheme whose models take inference-time rope scaling (see model_variants).
ROPE_SCHEME = "rope"


def rope_scaled_name(scaling: RopeScaling) -> str:
    """Model name of a rope model with inference-time scaling, e.g. rope-ntk-x4."""
    return f"rope-{scaling.kind}-x{scaling.factor:g}"


# Further training runs of a scheme's recipe: weights/seed<N>/<scheme>/ (issue 55).
SEED_FOLDER = re.compile(r"seed(?P<seed>[0-9]+)")


@dataclass(frozen=True)
class ModelSpec:
    """One model to export: its name, scheme, weights folder, and rope scaling (None: as trained)."""

    name: str
    scheme: str
    weights: Path
    scaling: RopeScaling | None = None
    size: str | None = None  # a random size (ExportOptions.size): no weights are read
    n_layers: int | None = None

    def model(self) -> tuple[Transformer, dict[str, object]]:
        """The model to export and its training record (a random size: none, and the manifest says so)."""
        if self.size is None:
            return load_weights(self.weights)
        overrides = {} if self.n_layers is None else {"n_layers": self.n_layers}
        return random_model(self.scheme, self.size, **overrides), {}


def training_seed(training: dict[str, object]) -> int | None:
    """The seed a model was trained with, from its training.json (None: not recorded)."""
    config = training.get("train_config")
    seed = config.get("seed") if isinstance(config, dict) else None
    return None if seed is None else int(seed)


def weights_folder(folder: Path, scheme: str) -> Path:
    """A weights folder; a missing weights file stops the export, named."""
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(
            f"{folder / 'model.safetensors'}: no weights for scheme {scheme!r}; train with python -m models.train"
        )
    return folder


def load_weights(folder: Path) -> tuple[Transformer, dict[str, object]]:
    training_file = folder / "training.json"
    training = json.loads(training_file.read_text()) if training_file.is_file() else {}
    return Transformer.load(folder), training


def extra_seeds(weights: Path, schemes: tuple[str, ...]) -> list[ModelSpec]:
    """Every `weights/seed<N>/<scheme>` with weights, for the schemes asked, by seed then scheme order."""
    found = []
    for folder in weights.iterdir() if weights.is_dir() else ():
        match = SEED_FOLDER.fullmatch(folder.name)
        if match is None or not folder.is_dir():
            continue
        for scheme in schemes:
            if (folder / scheme / "model.safetensors").is_file():
                found.append((int(match["seed"]), schemes.index(scheme), folder / scheme, scheme))
    return [ModelSpec(seed_model_name(scheme, seed), scheme, path) for seed, _, path, scheme in sorted(found)]


def reference_model(spec: ModelSpec) -> Transformer:
    """The PyTorch model an export is checked against: the weights with the spec's scaling."""
    model = spec.model()[0]
    if spec.scaling is not None:
        model.config.rope_scaling = RopeScaling(spec.scaling.kind, spec.scaling.factor, model.config.train_context)
    return model
