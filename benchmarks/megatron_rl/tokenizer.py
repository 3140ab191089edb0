"""The task's tokenizer, built offline: one word-level token per number, command and special.

Megatron-LM loads it with ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``
(``HF_HUB_OFFLINE=1``). It needs an end token and a pad id other than 0 for the RL path; this one
pads with ``<pad>`` (id 1) and ends with ``<eos>`` (id 3)::

    python tokenizer.py DIR
"""

from __future__ import annotations

import json
import os
import sys

from task import BOS, EOS, PAD, UNK, vocabulary


def write(directory: str) -> str:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([UNK, PAD, BOS, EOS])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
        "pad_token": PAD,
        "bos_token": BOS,
        "eos_token": EOS,
        "model_max_length": 4096,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory


if __name__ == "__main__":
    print(write(sys.argv[1]))
