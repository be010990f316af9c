"""Kept for the tests and benches that import `vocab` from this directory: the
twin's token space and toy model live in twin/tokens.py."""
from twin.tokens import VOCAB_SIZE, WORDS, decode, encode, generate_text, next_tokens  # noqa: F401
