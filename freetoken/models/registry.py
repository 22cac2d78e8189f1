"""The one table that maps a checkpoint's architecture (config.json `architectures[0]`, not
`model_type`) to how FreeToken reads its config and weights and which model class runs it.

Pure data: importing it loads nothing (config.py reads it while parsing a config.json).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str                 # what log lines and errors call it
    model_class: str          # "module:Class" of the forward pass (imported on use)
    text_config: bool = False  # the text model's fields sit under config.json's "text_config"
    hybrid: bool = False      # Gated DeltaNet layers between gated full-attention layers
    gemma_norms: bool = False  # RMSNorm weights are stored as w - 1 (the model scales by 1 + w)
    router_renormalises: bool = False  # top-k weights always renormalised (norm_topk_prob ignored)


QWEN3_MOE = Family("Qwen3-MoE", "freetoken.models.qwen3_moe:Qwen3Moe")
QWEN3_5_MOE = Family("Qwen3.5/3.6-MoE", "freetoken.models.qwen3_next:Qwen3Next", hybrid=True, gemma_norms=True,
                     router_renormalises=True)

ARCHITECTURES: dict[str, Family] = {
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    "Qwen3_5MoeForConditionalGeneration": Family(QWEN3_5_MOE.name, QWEN3_5_MOE.model_class, text_config=True,
                                                 hybrid=True, gemma_norms=True, router_renormalises=True),
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    "Qwen3NextForCausalLM": Family("Qwen3-Next", QWEN3_5_MOE.model_class, hybrid=True, gemma_norms=True),
}


def family(architecture: str | None) -> Family | None:
    return ARCHITECTURES.get(architecture or "")


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def model_class(architecture: str):
    """The class that runs this architecture (its module is imported here, on first use)."""
    module, name = ARCHITECTURES[architecture].model_class.split(":")
    return getattr(importlib.import_module(module), name)
