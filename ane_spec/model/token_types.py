"""llama.cpp's token types (`llama_token_type`), the values `tokenizer.ggml.token_type` stores:
what a token is decides how text can spell it and how it renders (tokenizer.py)."""

from __future__ import annotations

TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
KNOWN_TYPES = frozenset(range(0, 7))
