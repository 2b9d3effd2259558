"""The ``attrindex`` console script's entry point.

It lives outside the ``attrindex`` package so that it runs before the library is imported: a
Ctrl-C while the library loads (about half a second) ends the command quietly with exit status
130, as a Ctrl-C later does, instead of printing the import's traceback.
"""

EXIT_INTERRUPTED = 130  #: as attrindex.cli_errors.EXIT_INTERRUPTED (not imported: that loads the library)


def main() -> int:
    """Import the command (``attrindex.cli.main``) and run it; Ctrl-C at any point exits 130."""
    try:
        from attrindex.cli import main as command

        return command()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
