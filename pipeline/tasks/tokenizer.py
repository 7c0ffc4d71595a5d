"""Character-level tokenizer for the synthetic tasks, as a Hugging Face fast tokenizer.

One token per character of a fixed alphabet, plus `<pad>`, `<bos>`, `<eos>` and `<unk>` (any
character outside the alphabet). Built with the `tokenizers` library (a BPE model with no merges
is a plain character model) and wrapped as `PreTrainedTokenizerFast`, so `save_pretrained(dir)`
writes a folder that `AutoTokenizer.from_pretrained(dir)` loads.

Encoding, as for Llama tokenizers:
- prompt:   `tok(prompt).input_ids` == [bos] + chars(prompt)  (the post-processor adds `<bos>`);
- response: `tok(response, add_special_tokens=False).input_ids` + [eos].
Being character-level, encode(prompt) + encode(response, add_special_tokens=False) equals
encode(prompt + response): a prompt/response boundary never changes the tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

ALPHABET = "0123456789+*=#; \n"
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, then the alphabet in order
MODEL_MAX_LENGTH = 2048  # the longest context the tiny models are pretrained with (mult with checks)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()  # join characters back without separators
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
