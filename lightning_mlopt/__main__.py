"""``python -m lightning_mlopt``: the command-line entry point."""

from lightning_mlopt.cli import main

if __name__ == "__main__":
    main()
