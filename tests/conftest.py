"""Suite-wide settings. Tests run under pytest-xdist with one worker per core: each worker uses a single torch
thread, otherwise two workers with two OpenMP threads each oversubscribe two cores and tiny ops slow down
a hundredfold."""
import logging

import torch

torch.set_num_threads(1)
logging.getLogger("transformers").setLevel(logging.ERROR)
