"""The observability checks: what the run records for the next incident (per-layer
gradient norms, a batch log)."""

from __future__ import annotations

from ckptforensics.detectors.audit.rows import AuditEvidence, Check, row

__all__ = ["grad_norm_logging", "batch_log"]


_RECORDER = (
    "attach ckptforensics' flight recorder: `from ckptforensics.record import Recorder; rec = Recorder('runs/x/flight', "
    "checkpoint_every=N)` and call rec.on_batch / after_backward / after_step / on_checkpoint in the loop "
    "(transformers: `ckptforensics.record.hf.hf_callback`, Lightning: `ckptforensics.record.lightning.lightning_callback`)"
)


def grad_norm_logging(ev: AuditEvidence) -> Check:
    """Per-layer gradient norms in the log: what locates the layer a spike starts in."""
    src = "docs/signatures.md#audit-grad-norm-logging (OLMo-core logs optim/grad/<param>.norm; Megatron --log-params-norm)"
    if ev.log_file is None:
        return row(
            "grad_norm_logging",
            "observability",
            "risk",
            0,
            None,
            "no training log found",
            src,
            "info",
            fix=_RECORDER,
        )
    if ev.per_param_grad_columns:
        return row(
            "grad_norm_logging",
            "observability",
            "ok",
            ev.per_param_grad_columns,
            None,
            f"{ev.per_param_grad_columns} per-parameter gradient-norm columns in {ev.log_file}",
            src,
        )
    return row(
        "grad_norm_logging",
        "observability",
        "risk",
        0,
        None,
        f"{ev.log_file} has no per-layer gradient norms",
        src,
        "info",
        fix=_RECORDER,
    )


def batch_log(ev: AuditEvidence) -> Check:
    """A batch log makes the next incident replayable step by step."""
    src = "docs/signatures.md#audit-batch-log (PaLM's replay of a spike from the batches around it, arXiv 2204.02311, sec. 5.1)"
    if ev.batch_log:
        return row(
            "batch_log", "observability", "ok", ev.batch_log, None, f"batch log {ev.batch_log}", src
        )
    return row(
        "batch_log",
        "observability",
        "risk",
        None,
        None,
        "no batch log next to the checkpoints: a spike's batches cannot be replayed",
        src,
        "info",
        fix=_RECORDER,
    )
