"""Transformers' soft-token count per image for a checkpoint directory's image processor settings.

    /path/to/venv-with-transformers/bin/python -m tests.golden.processor_budget_case   # rewrites processor_budget.json

Needs transformers 5.23 only (no torch: `Gemma4ImageProcessorPil` is the Pillow/numpy processor). For each
budget it saves the processor as a checkpoint does (`save_pretrained` -> preprocessor_config.json), loads it
back from that directory as transformers would (`from_pretrained`) and records, per image size,
`num_soft_tokens_per_image`. tests/test_processor_budget.py writes the recorded file into a Hugging Face
checkpoint directory and checks that our soft-token count per image, with no override, is transformers'.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "processor_budget.json")
BUDGETS = (70, 280)
SIZES = ((300, 500), (480, 640), (1024, 768), (64, 64), (33, 1000), (2000, 150), (720, 1280), (17, 23))


def main() -> int:
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    cases = []
    for budget in BUDGETS:
        with tempfile.TemporaryDirectory() as d:
            Gemma4ImageProcessorPil(max_soft_tokens=budget).save_pretrained(d)
            with open(os.path.join(d, "preprocessor_config.json")) as f:
                saved = json.load(f)
            proc = Gemma4ImageProcessorPil.from_pretrained(d)
        counts = {}
        for h, w in SIZES:
            out = proc(np.zeros((h, w, 3), np.uint8))
            counts[f"{h}x{w}"] = int(out["num_soft_tokens_per_image"][0])
        cases.append({"preprocessor_config": saved, "soft_tokens": counts})
    record = {"made_by": "python -m tests.golden.processor_budget_case",
              "transformers": transformers.__version__, "processor": "Gemma4ImageProcessorPil", "cases": cases}
    with open(OUT, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print("wrote", OUT, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
