"""Replay: rebuild model and optimizer from *before*, re-run the window's steps with probes
(`run.replay`; the window's plan is `window`, one session's steps `session`)."""
