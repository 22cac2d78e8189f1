"""The one table that maps a checkpoint's architecture (config.json `architectures[0]`, not
`model_type`) to how FreeToken reads its config and weights and which model class runs it.

Pure data: importing it loads nothing (models/hf_config.py reads it while parsing a config.json;
the weights loader and the model class are imported on first use).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Family:
    name: str                 # what log lines and errors call it
    model_class: str          # "module:Class" of the forward pass (imported on use)
    loader: str               # "module:function" reading its safetensors into ModelWeights
    text_config: bool = False  # the text model's fields sit under config.json's "text_config"
    gdn: bool = False         # Gated DeltaNet layers between gated full-attention layers
    router_renormalises: bool = False  # top-k weights always renormalised (norm_topk_prob ignored)
    gpt_oss: bool = False     # sinks, sliding windows, biases, the clamped SwiGLU (hf_config._gpt_oss_fields)
    gguf: str = ""            # general.architecture llama.cpp's converter writes for it ("": not read from GGUF)


GDN_MODEL, GDN_LOADER = "freetoken.models.qwen3_next:Qwen3Next", "freetoken.models.hf_gdn:load_gdn"
QWEN3_MOE = Family("Qwen3-MoE", "freetoken.models.qwen3_moe:Qwen3Moe", "freetoken.models.weights:load_qwen3_moe",
                   gguf="qwen3moe")
QWEN3_5_MOE = Family("Qwen3.5/3.6-MoE", GDN_MODEL, GDN_LOADER, gdn=True, router_renormalises=True,
                     gguf="qwen35moe")

ARCHITECTURES: dict[str, Family] = {
    "Qwen3MoeForCausalLM": QWEN3_MOE,
    # a qwen35moe GGUF holds the text model: it reads as Qwen3_5MoeForCausalLM
    "Qwen3_5MoeForConditionalGeneration": replace(QWEN3_5_MOE, text_config=True, gguf=""),
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    "Qwen3NextForCausalLM": Family("Qwen3-Next", GDN_MODEL, GDN_LOADER, gdn=True, gguf="qwen3next"),
    # top-k of the logits then a softmax over the k: the router op's renormalised top-k of the softmax
    "GptOssForCausalLM": Family("gpt-oss", "freetoken.models.gpt_oss:GptOss",
                                "freetoken.models.gpt_oss_weights:load_gpt_oss", router_renormalises=True, gpt_oss=True,
                                gguf="gpt-oss"),
}


def family(architecture: str | None) -> Family | None:
    return ARCHITECTURES.get(architecture or "")


def supported() -> str:
    return ", ".join(ARCHITECTURES)


def from_gguf(gguf_architecture: str) -> str | None:
    """The architectures[0] a GGUF's general.architecture stands for, or None."""
    return next((arch for arch, fam in ARCHITECTURES.items() if fam.gguf and fam.gguf == gguf_architecture), None)


def gguf_supported() -> str:
    return ", ".join(fam.gguf for fam in ARCHITECTURES.values() if fam.gguf)


def model_class(architecture: str):
    """The class that runs this architecture (its module is imported here, on first use)."""
    return _named(ARCHITECTURES[architecture].model_class)


def weights_loader(architecture: str):
    """loader(checkpoint, cfg, dtype, log) -> ModelWeights of this architecture (imported on use)."""
    return _named(ARCHITECTURES[architecture].loader)


def _named(spec: str):
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)
