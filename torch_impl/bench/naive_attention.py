"""``python -m torch_impl.bench.naive_attention``: CS336's PyTorch attention benchmark.

Batch 8, no heads, full attention, head dim {16, 32, 64, 128} x sequence {256, 1,024, 4,096, 8,192, 16,384},
fp32; forward and backward times of the naive attention (scores, softmax, weighted sum written out), eager and
``torch.compile``d, with the memory allocated before each backward (the saved n x n matrices) and out-of-memory
configurations kept as rows. It is the attention benchmark's ``naive`` preset
(``python -m torch_impl.bench.attention --preset naive``); every flag of that CLI applies, e.g.
``--seq-lens 256,1024 --out results/naive_attention_h100.jsonl``.
"""

from __future__ import annotations

import sys
from typing import Sequence

from torch_impl.bench import attention


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = ["--preset", "naive", "--suite", "naive_attention", "--out", "results/naive_attention.jsonl"]
    return attention.main(defaults + argv)  # later flags win in argparse


if __name__ == "__main__":
    sys.exit(main())
