"""`python -m jaxkv ...`: the command line (jaxkv.front.cli)."""

from jaxkv.front.cli import main

main()
