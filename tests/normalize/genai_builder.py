"""A tiny random Llama-like checkpoint and what onnxruntime-genai's model builder makes of
it, offline (PyTorch, transformers and onnxruntime-genai needed)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

VOCAB, LAYERS, KV_HEADS = 96, 2, 2


def save_tiny_llama(folder: Path, hidden: int = 64, heads: int = 4) -> None:
    """A random LlamaForCausalLM and a word-level tokenizer, saved as a local checkpoint
    (the vocabulary differs from every layer width: the builder takes a Linear of the
    vocabulary's width for the LM head)."""
    import tokenizers
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=heads,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        words = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3")
        tokenizer = tokenizers.Tokenizer(words)
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer,
            bos_token="t1",
            eos_token="t2",
            unk_token="t3",
            pad_token="t0",
        )
        fast.save_pretrained(folder)


def build(source: Path, out: Path, precision: str, *options: str) -> Path:
    """``python -m onnxruntime_genai.models.builder`` on the checkpoint ``source``, for the
    CPU, offline, with the builder's ``--extra_options`` ``options`` (``key=value``);
    ``RuntimeError`` with the end of its output when it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", source, "-o", out]
    command += ["-p", precision, "-e", "cpu", "-c", out.parent / "cache"]
    if options:
        command += ["--extra_options", *options]
    done = subprocess.run(
        [str(c) for c in command], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the builder failed: {done.stderr[-2000:]}")
    return out
