"""Write a tiny Llama or Qwen2 checkpoint (safetensors + a local tokenizer) and its state dict.

Run with the vLLM venv's Python (it has transformers):
``python make_checkpoint.py OUT_DIR STATE_DICT.pt SEED [tied] [qwen2] [vocabN]``. With ``tied`` the input
embedding and the output layer share one tensor (``tie_word_embeddings=True``); ``qwen2`` is the
Qwen2 family (q/k/v biases), the architecture of Qwen2.5-0.5B and 1.5B, which are tied. Nothing is downloaded: the tokenizer
is a word-level one built here. Heads are 32 wide (vLLM's CPU attention rejects narrower ones).
The state dict (``torch.save`` of the checkpoint's tensors, saved outside the model folder so
vLLM never sees it) is what a test's trainer sends.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

#: Up to 320 words; a model takes the first :data:`DEFAULT_VOCAB` unless told (``vocabN``).
VOCAB = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(317)]
DEFAULT_VOCAB = 256  # a multiple of 64: vLLM pads none of it


def main(
    out_dir: str,
    state_path: str,
    seed: int,
    *,
    tied: bool = False,
    qwen2: bool = False,
    vocab: int = DEFAULT_VOCAB,
    width: int = 1,
    layers: int = 2,
) -> None:
    """``vocab``: the first words only; vLLM pads one that is not a multiple of 64 (200 to
    256, 300 to 320). ``width`` multiplies the hidden sizes and heads (a benchmark's bigger
    model)."""
    out = Path(out_dir)
    words = VOCAB[:vocab]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    config = (Qwen2Config if qwen2 else LlamaConfig)(
        vocab_size=len(words),
        hidden_size=64 * width,
        intermediate_size=128 * width,
        num_hidden_layers=layers,
        num_attention_heads=2 * width,
        num_key_value_heads=width,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM if qwen2 else LlamaForCausalLM)(config)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    with torch.no_grad():  # the default init is tiny; spread the logits so argmax is stable
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):  # Qwen2's biases: A's differ from B's
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    torch.save(state, state_path)


if __name__ == "__main__":
    flags = set(sys.argv[4:])
    sizes = [int(f[5:]) for f in flags if f.startswith("vocab")]
    main(
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        tied="tied" in flags,
        qwen2="qwen2" in flags,
        vocab=sizes[0] if sizes else DEFAULT_VOCAB,
    )
