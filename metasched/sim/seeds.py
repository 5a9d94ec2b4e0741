"""The simulation seeds of training, validation and evaluation: disjoint ranges, so a
policy is never judged on an instance it was trained or selected on.

- training episodes draw from ``TRAIN_SIM_SEEDS`` = [0, 999,000);
- validation during training uses ``VALIDATION_SEEDS`` = 999,000 .. 999,999;
- evaluation uses ``EVAL_SEED_OFFSET`` = 1,000,000 onwards.
"""

from __future__ import annotations

EVAL_SEED_OFFSET = 1_000_000
TRAIN_SEED_MAX = EVAL_SEED_OFFSET  # training and validation seeds are below this
VALIDATION_SEEDS = tuple(range(TRAIN_SEED_MAX - 1000, TRAIN_SEED_MAX))
TRAIN_SIM_SEEDS = (0, TRAIN_SEED_MAX - 1000)  # episodes draw simulation seeds from here
