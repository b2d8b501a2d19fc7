"""`python -m ckptforensics.cli`: the console script, for torchrun and for hosts without it."""

from . import main

main()
