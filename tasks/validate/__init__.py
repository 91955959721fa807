"""Stage 5, validate: proof that vLLM serves the draft, and the acceptance it achieves.

    draft_check.py: static checks against vLLM's EAGLE-3 loader
    -> vllm_live.py: the verifier served alone and with the draft, greedy (a subprocess each)
    -> stage.py: acceptance per position, outputs compared, an optional baseline's regression

Hands on: `validation/<fingerprint>/report.{json,md}` and a `ValidationResult`.
"""
