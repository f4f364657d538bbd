"""Draft tokens: proposed continuations the engine verifies in one step (`verify.py`), and
where they come from (`prompt_lookup.py`; the semantic cache's stored answers)."""
