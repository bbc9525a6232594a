"""Structured outputs: grammars (a JSON schema, a regex, an EBNF grammar) compiled against the model's vocabulary,
and per-request matchers that say which tokens may come next (base.py: the protocol; registry.py: the backends by
name, --grammar-backend; xgrammar_backend.py: xgrammar's)."""
