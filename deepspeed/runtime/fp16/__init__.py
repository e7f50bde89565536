"""DeepSpeed's import path for fp16 pieces; the code lives in runtime/precision."""
