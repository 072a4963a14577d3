"""Data: the batch at step s as a pure function of (seed, s) (`batches`), token files and their
tokenizers (`tokenizer`, `scaleout prepare-data`), the generated demo corpus (`corpus`).
Imports only config and common."""
