"""Built-in quantization methods; importing this package registers them."""

from quantkit.quantizers import awq, awq_gptq, fp8, gptq, qqq, rtn  # noqa: F401
