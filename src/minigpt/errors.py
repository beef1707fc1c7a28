"""The one exception type for mistakes a user can make (bad file, bad flag, bad shape)."""


class InputError(ValueError):
    """A problem with what the user gave us; the CLI prints it as one line and exits with code 2."""
