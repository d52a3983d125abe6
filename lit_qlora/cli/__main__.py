"""`python -m lit_qlora.cli`: the `litqlora` command (what `litqlora compare` runs its stages with)."""

from lit_qlora.cli import main

main()
