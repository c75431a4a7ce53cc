"""``python -m drifttool …``: the same command line as the ``drifttool`` console script."""

from drifttool.cli.app import main

if __name__ == "__main__":
    main()
