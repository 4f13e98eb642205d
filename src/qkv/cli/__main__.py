"""`python -m qkv.cli`: the `qkv` program, as torchrun and the tests start it."""

from qkv.cli import main

main()
