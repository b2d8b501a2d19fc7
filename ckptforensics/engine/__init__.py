"""The engines that measure a run: the streaming diff, the replay, the traced forward pass,
bisection and what-if replays, the recovery's legs. They ask `trainers` and `optim` what a
run is and hand records to `detectors`; they never decide what went wrong."""
