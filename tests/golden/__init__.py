"""Golden files: outputs of the transformers reference, stored so that the default test run needs no torch.

`python -m tests.golden.make_golden` (needs the `[ref]` extra) regenerates them; see store.py.
"""
