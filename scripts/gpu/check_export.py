"""Loads a model smelt exported into transformers and recomputes smelt's final eval loss.

    python3 scripts/gpu/check_export.py MODEL_DIR 'EVAL_GLOB' SEQ LOG.jsonl [--tolerance 0.01]

Reads the eval token files (llm.q BIN.TOK) the way smelt's eval does: each file cut into
sequences of SEQ tokens at multiples of SEQ, each position predicting the next token (masked
targets ignored), files in sorted order. The mean cross-entropy over every trained target is
compared with the last full eval in smelt's JSON Lines log. Exits 1 when they differ by more
than the tolerance. Prints one `RESULT {json}` line.
"""
import argparse
import glob
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def read_token_file(path):
    raw = open(path, "rb").read()
    if raw[:8] != b"BIN.TOK\n":
        sys.exit(f"{path}: not a BIN.TOK file")
    header = np.frombuffer(raw[:1024], dtype="<i4")
    count, has_mask = int(header[4]), int(header[2]) == 2 and int(header[6]) != 0
    tokens = np.frombuffer(raw[1024:1024 + 4 * count], dtype="<i4").astype(np.int64)
    trained = np.ones(count, dtype=bool)
    if has_mask:
        bits = np.frombuffer(raw[1024 + 4 * count:], dtype=np.uint8)
        trained = np.unpackbits(bits, bitorder="little")[:count].astype(bool)
    return tokens, trained


def sequences(paths, seq):
    for path in paths:
        tokens, trained = read_token_file(path)
        for c in range((len(tokens) - 1) // seq):
            start = c * seq
            x = tokens[start:start + seq]
            y = np.where(trained[start + 1:start + seq + 1], tokens[start + 1:start + seq + 1], -100)
            yield x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("eval_glob")
    ap.add_argument("seq", type=int)
    ap.add_argument("log")
    ap.add_argument("--tolerance", type=float, default=1e-2)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()

    evals = [json.loads(line) for line in open(a.log) if '"eval"' in line]
    full = [e for e in evals if e.get("event") == "eval" and e.get("full")]
    if not full:
        sys.exit(f"{a.log}: no full eval event")
    smelt_loss = full[-1]["loss"]

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.seq > 4096:
        # f32 attention would otherwise take the math path, which holds every head's T × T
        # scores (56 GiB at 32k); the memory-efficient kernel computes the same in f32, for
        # key and value heads repeated to the query heads (it takes no grouped heads).
        torch.backends.cuda.enable_math_sdp(False)
        import transformers.integrations.sdpa_attention as sdpa
        sdpa.use_gqa_in_sdpa = lambda *args, **kwargs: False
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).to(device).eval()
    paths = sorted(glob.glob(a.eval_glob))
    seqs = list(sequences(paths, a.seq))
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(seqs), a.batch):
            xs = torch.tensor(np.stack([s[0] for s in seqs[i:i + a.batch]]), device=device)
            ys = torch.tensor(np.stack([s[1] for s in seqs[i:i + a.batch]]), device=device)
            logits = model(input_ids=xs).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ys.reshape(-1),
                                     ignore_index=-100, reduction="sum").item()
            count += int((ys != -100).sum())
    hf_loss = total / count
    ok = abs(hf_loss - smelt_loss) <= a.tolerance
    print("RESULT " + json.dumps({"smelt_eval_loss": smelt_loss, "transformers_loss": hf_loss,
                                  "difference": abs(hf_loss - smelt_loss), "tokens": count,
                                  "sequences": len(seqs), "tolerance": a.tolerance, "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
