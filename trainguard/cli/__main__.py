"""``python -m trainguard.cli``: the same CLI without relying on the console script on PATH."""

from trainguard.cli.main import main

if __name__ == "__main__":
    main()
