"""The declarative op and motif rules, installed as package data (symgraph.specs)."""
