"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as a `tokenizers` byte-level BPE, the same one the
checkpoint's tokenizer.json describes: the vocabulary and merges as stored, control tokens as
special added tokens, user-defined ones (e.g. <think>) as plain added tokens, padding entries
([PADn], type UNUSED) left out as tokenizer.json leaves them out, and the pre-tokenizer llama.cpp
names in `tokenizer.ggml.pre`. The chat template comes from the file; the stop ids are the
eos / eot / eom ids and, as llama.cpp does, every control token whose text ends a turn or a text.
"""
from __future__ import annotations

from freetoken.models.gguf_file import GGUFError, GGUFModel

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5      # llama.cpp's token types
# tokenizer.ggml.pre -> the split regex before byte-level encoding (None: ByteLevel's own GPT-2 one)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5/3.6's tokenizer.json: combining marks (\p{M}) join the letters they follow
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"gpt-2": None, "qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
# control tokens llama.cpp also ends generation on, by their text (the Qwen ones and the common others)
END_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                       "<|end_of_text|>", "<|return|>", "<|call|>"})


def gguf_tokenizer(model: GGUFModel):
    """freetoken.tokenizer.Tokenizer of the file."""
    from freetoken.tokenizer import Tokenizer
    meta, where = model.metadata, model.paths[0]
    kind = model.require("tokenizer.ggml.model", of_architecture=False)
    if kind != "gpt2":
        raise GGUFError(f"{where}: tokenizer.ggml.model is {kind!r}; FreeToken reads byte-level BPE ('gpt2')")
    tokens = model.require("tokenizer.ggml.tokens", of_architecture=False)
    types = meta.get("tokenizer.ggml.token_type") or []
    ends = [int(meta[k]) for k in END_KEYS if meta.get(k) is not None]
    ends += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in END_TEXTS and i not in ends]
    if {"<|return|>", "<|call|>"} <= set(tokens):     # harmony (gpt-oss): <|end|> closes a message, not the reply
        ends = [i for i in ends if tokens[i] != "<|end|>"]
    config = {"chat_template": meta.get("tokenizer.chat_template"),
              "eos_token": tokens[ends[0]] if ends else None,
              "bos_token": tokens[int(meta["tokenizer.ggml.bos_token_id"])]
              if meta.get("tokenizer.ggml.add_bos_token") and meta.get("tokenizer.ggml.bos_token_id") is not None
              else None}
    return Tokenizer(_bpe(meta, tokens, types, where), config, ends)


def _bpe(meta: dict, tokens: list[str], types: list[int], where):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:     # llama.cpp's "default" is a regex of its own: not a guess here
        raise GGUFError(f"{where}: pre-tokenizer {pre!r} is not one FreeToken knows ({', '.join(PRE_TOKENIZERS)})")
    kinds = types or [NORMAL] * len(tokens)
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, kinds)) if k != UNUSED}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    split = PRE_TOKENIZERS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=k == CONTROL, normalized=False)
                    for t, k in zip(tokens, kinds) if k in (CONTROL, USER_DEFINED)])
    return tok
