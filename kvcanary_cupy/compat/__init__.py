"""Compatibility layers that give users of other canary implementations the names they already have.

:mod:`kvcanary_cupy.compat.sglang` mirrors SGLang's ``kv_canary`` API on torch tensors; it needs torch
(``pip install kvcanary-cupy[torch]``). Importing this package imports nothing else.
"""
