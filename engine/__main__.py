"""Command-line tools: `python -m engine <command> --help`."""

from engine.cli import main

if __name__ == "__main__":
    main()
