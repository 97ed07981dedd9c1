"""Byte-level BPE tokenizer for the zoo, trained with `tokenizers`, saved loadable by AutoTokenizer."""
from __future__ import annotations

from pathlib import Path

from speclab.train.corpus import DOMAINS, EOS_TEXT, read_split

SPECIAL_TOKENS = [EOS_TEXT, "<|pad|>", "<|mask|>"]  # <|mask|> is the block-diffusion drafter's mask token


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int = 8192):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def docs():
        for d in DOMAINS:
            yield from read_split(corpus_dir, d, "train")

    tok.train_from_iterator(docs(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token="<|pad|>",
                                   mask_token="<|mask|>", bos_token=None, unk_token=None)
    fast.model_max_length = 1024
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
