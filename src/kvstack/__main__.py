"""`python -m kvstack` runs the command line."""

from kvstack.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
