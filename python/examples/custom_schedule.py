"""A schedule smelt train does not have, owned by Python: linear warmup, then the inverse
square root of the step (as in "Attention is all you need"), with an eval every 50 steps.

    python python/examples/custom_schedule.py MODEL_DIR 'data/train-*.bin' data/eval.bin
"""

import sys

import smelt

model, train_file, eval_file = sys.argv[1:4]
steps, warmup, peak = 200, 20, 1e-3
trainer = smelt.Trainer(model, from_scratch=True, batch_size=8, seq_len=512, steps=steps)
data = smelt.DataLoader(train_file, 512)
evals = smelt.DataLoader(eval_file, 512)
for step in range(steps):
    lr = peak * min((step + 1) / warmup, (warmup / (step + 1)) ** 0.5)
    trainer.step(*data.next(trainer.sequences_per_step))
    result = trainer.update(lr=lr)
    if (step + 1) % 50 == 0:
        loss, _ = trainer.eval(*evals.next(trainer.sequences_per_eval))
        print(f"step {step + 1}: loss {result['loss']:.4f}, eval loss {loss:.4f}, lr {lr:.2e}")
trainer.close()
