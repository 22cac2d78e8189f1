"""Where a model comes from: a Hugging Face directory, a GGUF file, the packaged demo model, or
``synth:NAME``.

Returns everything the engine needs to build the model, so core.py never branches on the source.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from freetoken.config import ModelConfig
from freetoken.models.gguf_file import is_gguf
from freetoken.models.hf_config import read_model_config

SYNTH_PREFIX = "synth:"


@dataclass(frozen=True)
class LoadedModel:
    name: str
    path: Path | None          # None for in-memory synthetic models
    config: ModelConfig
    weights: object            # weights.ModelWeights
    tokenizer: object          # tokenizer.Tokenizer


def model_path(model: str | None, log) -> Path:
    """What the server names the model by and reads generation_config.json from: the model
    directory (the demo's when none is given). A ``synth:NAME`` model has no directory: its path
    is the spec itself (its name is the served name; no file is read from it), so every --model
    form ``generate`` loads, ``serve`` serves."""
    if model and model.startswith(SYNTH_PREFIX):
        from freetoken.models.synth import parse_spec
        parse_spec(model[len(SYNTH_PREFIX):])       # a bad spec fails here, before the server binds
        return Path(model)
    if model and is_gguf(model):
        from freetoken.models.gguf_file import check_path
        return check_path(model)                    # a split set with a part missing fails here too
    from freetoken.models.demo import resolve_model_dir
    return resolve_model_dir(model, log)


def load_model(model: str | None, log) -> LoadedModel:
    from freetoken.models.demo import resolve_model_dir, synth_tokenizer_dir
    from freetoken.tokenizer import Tokenizer
    from freetoken.models.weights import load_weights
    t0 = time.perf_counter()
    if model and model.startswith(SYNTH_PREFIX):
        from freetoken.models.synth import synth_model
        cfg, weights = synth_model(model[len(SYNTH_PREFIX):], log)
        tokenizer = Tokenizer.from_dir(synth_tokenizer_dir())
        loaded = LoadedModel(model, None, cfg, weights, tokenizer)
    elif model and is_gguf(model):
        loaded = _load_gguf(Path(model).expanduser(), log)
    else:
        path = resolve_model_dir(model, log)
        cfg = read_model_config(path)
        loaded = LoadedModel(path.name, path, cfg, load_weights(path, cfg, log), Tokenizer.from_dir(path))
    cfg = loaded.config
    log.info("loaded %s (%d layers, %d experts, top-%d) in %.2f s", loaded.name, cfg.num_layers,
             cfg.num_experts, cfg.num_experts_per_tok, time.perf_counter() - t0)
    return loaded


def _load_gguf(path: Path, log) -> LoadedModel:
    """A GGUF file (or the first part of a split set): config, weights and tokenizer from the file;
    the Gated DeltaNet families through models/gguf_gdn.py, gpt-oss through gguf_gpt_oss.py, the
    others through gguf_weights.py."""
    from freetoken.models import registry
    from freetoken.models.gguf_file import open_gguf
    from freetoken.models.gguf_tokenizer import gguf_tokenizer
    model = open_gguf(path)
    family = registry.family(registry.from_gguf(model.architecture))
    if family is not None and family.gdn:
        from freetoken.models.gguf_gdn import gdn_gguf_config as gguf_config, gdn_gguf_weights as gguf_weights
    elif family is not None and family.gpt_oss:
        from freetoken.models.gguf_gpt_oss import gpt_oss_gguf_config as gguf_config, gpt_oss_gguf_weights as gguf_weights
    else:                                                            # unknown ones fail there, naming the list
        from freetoken.models.gguf_weights import gguf_config, gguf_weights
    cfg, tokenizer = gguf_config(model), gguf_tokenizer(model)      # both fail in seconds, before the widening
    return LoadedModel(path.name, path, cfg, gguf_weights(model, cfg, log), tokenizer)
