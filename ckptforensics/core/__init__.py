"""What every other room of the house stands on: errors, options, dtype limits and bits,
robust statistics, the fused C kernels, paths a run recorded. Imports nothing above it."""
