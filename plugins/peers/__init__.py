"""Engines a user would pick instead of ours, behind the same Backend protocol, converted from our
checkpoints by each project's own converter: CTranslate2 (ctranslate2.py), llama.cpp (llamacpp.py)."""
