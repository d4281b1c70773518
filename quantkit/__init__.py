"""quantkit: post-training 4-bit quantization of Hugging Face causal LMs."""

__version__ = "0.1.0"
