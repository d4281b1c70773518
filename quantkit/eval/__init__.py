"""Evaluation: lm-eval-style tasks, perplexity on several texts, side-by-side generations, reports.

Entry point: `quantkit.eval.runner.run_eval`. Submodules import torch and friends on use only.
"""
