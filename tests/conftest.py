"""Suite-wide settings. Tests run under pytest-xdist with one worker per core: each worker uses a single torch
thread, otherwise two workers with two OpenMP threads each oversubscribe two cores and tiny ops slow down
a hundredfold."""
import logging

import torch

torch.set_num_threads(1)
logging.getLogger("transformers").setLevel(logging.ERROR)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def zoo_subject():
    """``zoo_subject(family)``: a tiny model of that family, loaded with its example inputs (built once)."""
    import symgraph
    from symgraph import zoo

    cache = {}

    def get(family):
        if family not in cache:
            model = zoo.build(family, seed=0)
            cache[family] = symgraph.load(model, zoo.example_inputs_for(family, model))
        return cache[family]

    return get
