"""symgraph: find a model's parameter-space symmetries from its traced graph, and align models with them."""
