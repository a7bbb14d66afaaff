"""Exceptions shared by the command line and the library."""


class UsageError(Exception):
    """A problem with the user's input: the `dgemma` command reports it in one line, exit code 2."""
