"""``python -m symgraph`` runs the command line."""
from .cli import main

main()
