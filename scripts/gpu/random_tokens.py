"""Writes N random tokens of a vocabulary as a BIN.TOK version 2 token file (no mask), for
runs whose speed, not their loss, is measured.

    python3 scripts/gpu/random_tokens.py OUT.bin [TOKENS] [VOCAB]
"""

import struct
import sys

import numpy as np

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4 << 20
vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 151936  # Qwen2.5's
header = bytearray(1024)
header[0:8] = b"BIN.TOK\n"
struct.pack_into("<5i", header, 8, 2, 4, n, vocab, 0)  # version, bytes a token, count, vocab, mask
tokens = np.random.default_rng(0).integers(0, vocab, n, dtype=np.int32)
with open(out, "wb") as f:
    f.write(bytes(header) + tokens.astype("<i4").tobytes())
