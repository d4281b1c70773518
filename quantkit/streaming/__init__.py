"""Streaming quantization of local safetensors checkpoints, layer by layer, resumable after a kill."""

from quantkit.streaming.checkpoint import SafetensorsCheckpoint, streamable_reason
from quantkit.streaming.run import StreamedRun, open_streamed_model, quantize_streaming

__all__ = ["SafetensorsCheckpoint", "StreamedRun", "open_streamed_model", "quantize_streaming", "streamable_reason"]
