"""The pretraining corpus: task documents in megatron's indexed format, for ``pretrain_gpt.py``.

Each document is :func:`task.pretraining_document` tokenized, then the end token. Megatron-LM's
``pretrain_gpt.py`` reads it with ``--data-path PREFIX --split 100,0,0``::

    python corpus.py TOKENIZER_DIR PREFIX --documents 200000 --shift 0.3 --seed 1
"""

from __future__ import annotations

import argparse
import random


def write(tokenizer_dir: str, prefix: str, documents: int, shift: float, seed: int) -> int:
    """Writes ``PREFIX.bin`` and ``PREFIX.idx``; returns the number of tokens written."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from task import EOS, pretraining_document
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    eos = tokenizer.token_to_id(EOS)
    rng = random.Random(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    total = 0
    for _ in range(documents):
        ids = [*tokenizer.encode(pretraining_document(rng, shift)).ids, eos]
        builder.add_document(numpy.array(ids, dtype=numpy.int32), [len(ids)])
        total += len(ids)
    builder.finalize(f"{prefix}.idx")
    return total


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_dir")
    parser.add_argument("prefix")
    parser.add_argument("--documents", type=int, default=200_000)
    parser.add_argument("--shift", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=1)
    a = parser.parse_args()
    print(f"{write(a.tokenizer_dir, a.prefix, a.documents, a.shift, a.seed)} tokens")
