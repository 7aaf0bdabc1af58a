"""Prompt sources and eval sets that training, the n-gram corpus and the benchmark share: kept below all
three, so none of them imports another for its data."""
