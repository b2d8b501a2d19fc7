"""Training-side flight recorder: the evidence the next incident's replay needs.

`Recorder` for any loop (`on_batch`, `after_backward`, `after_step`, `on_checkpoint`);
`hf_callback` wraps one for transformers' Trainer. See record/recorder.py.
"""

from ckptforensics.record.monitor import Spike, SpikeMonitor
from ckptforensics.record.recorder import Recorder, RecorderConfig

__all__ = ["Recorder", "RecorderConfig", "SpikeMonitor", "Spike"]
