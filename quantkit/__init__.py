"""quantkit: post-training 4-bit quantization of Hugging Face causal LMs."""

__version__ = "0.1.0"

import quantkit.quantizers  # noqa: E402,F401  (registers the built-in methods and their options)
