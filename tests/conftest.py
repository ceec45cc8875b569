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


# The slow tier (`make test` runs it too; `make test-fast` leaves it out): tests marked `slow`, and every
# per-architecture test (parametrised by a model family or HF model type) except on a few representative families
# that keep a decoder, an encoder and plain torch modules in the fast tier.
_ARCHITECTURE_PARAMS = ("family", "model_type")
_FAST_FAMILIES = frozenset({"llama", "bert", "torch-encoder-layer", "torch-mha", "torch-relu-mlp"})


def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        architecture = next((params[p] for p in _ARCHITECTURE_PARAMS if p in params), None)
        if architecture is not None and architecture not in _FAST_FAMILIES:
            item.add_marker(pytest.mark.slow)
