"""`python -m ckptforensics.cli`: the console script, for torchrun and for hosts without it."""

from ckptforensics.cli import main

main()
